//! The peer protocol's endpoints (docs/peers.md): `/v1/manifest`, `/v1/files/{NAME}/{path}`,
//! `/metrics`, `/healthz`. Files are found by an exact lookup in the catalog; bodies go out in
//! bounded chunks, each read when the connection is ready for it.

use std::net::IpAddr;
use std::sync::Arc;

use axum::body::Body;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Extension, Router};
use bytes::Bytes;

use super::auth::Token;
use super::manifest::{Catalog, Content, Served};
use super::metrics::Metrics;
use super::ranges::{self, Asked};

/// The header both sides put the canonical identity in.
pub const IDENTITY_HEADER: &str = "x-fastload-identity";

/// What every request's handler shares.
pub struct Shared {
    pub catalog: Arc<Catalog>,
    pub token: Option<Token>,
    pub metrics: Arc<Metrics>,
}

/// The address a connection came from (set per connection by the listener).
#[derive(Clone, Copy)]
pub struct Client(pub IpAddr);

type St = State<Arc<Shared>>;

pub fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/v1/manifest", get(manifest))
        .route("/metrics", get(metrics))
        .route("/v1/files/{name}/{*path}", get(file))
        .fallback(|| async { StatusCode::NOT_FOUND })
        .with_state(shared)
}

/// The 401 answer, unless the request carries the serve's token (or the serve has none).
fn refused(shared: &Shared, headers: &HeaderMap, client: IpAddr) -> Option<Response> {
    let token = shared.token.as_ref()?;
    let given = headers
        .get(header::AUTHORIZATION)
        .map(HeaderValue::as_bytes);
    if token.admits(given) {
        return None;
    }
    shared.metrics.answered(client, 401);
    Some(
        (
            StatusCode::UNAUTHORIZED,
            [(header::WWW_AUTHENTICATE, "Bearer")],
            "a bearer token is required\n",
        )
            .into_response(),
    )
}

async fn manifest(State(s): St, Extension(c): Extension<Client>, headers: HeaderMap) -> Response {
    if let Some(r) = refused(&s, &headers, c.0) {
        return r;
    }
    s.metrics.answered(c.0, 200);
    let json = s.catalog.manifest().to_string();
    ([(header::CONTENT_TYPE, "application/json")], json).into_response()
}

async fn metrics(State(s): St, Extension(c): Extension<Client>, headers: HeaderMap) -> Response {
    if let Some(r) = refused(&s, &headers, c.0) {
        return r;
    }
    s.metrics.answered(c.0, 200);
    let (files, bytes) = s.catalog.held();
    let text = s.metrics.render(files, bytes);
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

async fn file(
    State(s): St,
    Extension(c): Extension<Client>,
    Path((name, path)): Path<(String, String)>,
    headers: HeaderMap,
) -> Response {
    if let Some(r) = refused(&s, &headers, c.0) {
        return r;
    }
    let answer = |code: StatusCode| {
        s.metrics.answered(c.0, code.as_u16());
        code
    };
    // The decoded names, looked up exactly: `..`, `%2e%2e`, absolute paths find nothing.
    let Some(served) = s.catalog.get(&name, &path).cloned() else {
        return answer(StatusCode::NOT_FOUND).into_response();
    };
    let mut out = HeaderMap::new();
    let etag = served.identity.etag_header();
    for (k, v) in [
        (header::ETAG, etag.as_str()),
        (
            header::HeaderName::from_static(IDENTITY_HEADER),
            served.canonical.as_str(),
        ),
        (header::ACCEPT_RANGES, "bytes"),
    ] {
        if let Ok(v) = HeaderValue::from_str(v) {
            out.insert(k, v);
        }
    }
    let wanted = headers.get(IDENTITY_HEADER).map(HeaderValue::as_bytes);
    if wanted.is_some_and(|w| w != served.canonical.as_bytes()) {
        // Another version of the file: the client reads its origin.
        let code = answer(StatusCode::CONFLICT);
        return (code, out, "not here: another version\n").into_response();
    }
    let range = headers.get(header::RANGE).and_then(|v| v.to_str().ok());
    let (code, start, end) = match ranges::parse(range, served.size) {
        Asked::Whole => (StatusCode::OK, 0, served.size),
        Asked::Part { start, end } => {
            let value = format!("bytes {start}-{}/{}", end - 1, served.size);
            out.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&value).expect("ascii"),
            );
            (StatusCode::PARTIAL_CONTENT, start, end)
        }
        Asked::Unsatisfiable => {
            let value = format!("bytes */{}", served.size);
            out.insert(
                header::CONTENT_RANGE,
                HeaderValue::from_str(&value).expect("ascii"),
            );
            return (answer(StatusCode::RANGE_NOT_SATISFIABLE), out).into_response();
        }
    };
    out.insert(header::CONTENT_LENGTH, HeaderValue::from(end - start));
    out.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    answer(code);
    let body = body(served, start, end, s.metrics.clone(), c.0);
    (code, out, body).into_response()
}

/// `[start, end)` of `served` as a stream of chunks, each read when the previous one went out.
/// A read that fails ends the body early (the client sees it short and resumes elsewhere).
fn body(served: Arc<Served>, start: u64, end: u64, metrics: Arc<Metrics>, client: IpAddr) -> Body {
    use futures_util::stream::{self, StreamExt};
    let pieces = stream::iter(ranges::chunks(start, end));
    let stream = pieces.then(move |(at, len)| {
        let (served, metrics) = (served.clone(), metrics.clone());
        async move {
            let chunk = read(&served, at, len).await;
            if let Err(e) = &chunk {
                eprintln!(
                    "fastload serve: {}: {}",
                    served.path,
                    crate::error::scrub(&e.to_string())
                );
            } else {
                metrics.sent(client, len as u64);
            }
            chunk
        }
    });
    Body::from_stream(stream)
}

async fn read(served: &Served, at: u64, len: usize) -> crate::error::Result<Bytes> {
    match served.content() {
        Content::Held(held) => Ok(held.bytes(at, len)),
        Content::Source(source) => {
            let mut buf = vec![0u8; len];
            source.read_into(at, &mut buf).await?;
            Ok(Bytes::from(buf))
        }
    }
}
