//! The Hub's HTTP API, as `huggingface_hub` calls it: `GET /api/models/{repo}/revision/{rev}`
//! (the commit and the file list), `HEAD /{repo}/resolve/{commit}/{path}` without following the
//! redirect to the storage host (size, ETag, location), and the retry loop every Hub request
//! goes through (429 with `Retry-After`, 5xx, connection errors; the store's [`RetrySettings`]).

use std::io;
use std::sync::Arc;
use std::time::Duration;

use reqwest::header::{HeaderMap, AUTHORIZATION, LOCATION, RETRY_AFTER};
use reqwest::{Method, RequestBuilder, Response, StatusCode};

use super::location::Location;
use super::{HubSettings, HubUri};
use crate::bounded::{Capped, Whole};
use crate::error::{Error, Result};
pub use crate::source::remote::io_error;
use crate::source::remote::{self, Attempt};
use crate::store::RetrySettings;
use crate::store::{clients, descriptors};

/// Redirects to follow within the Hub (a renamed repo answers 307 with a relative location).
const MAX_HUB_REDIRECTS: usize = 5;

/// A client for one load: settings, an HTTP client that follows no redirect itself, retries.
#[derive(Debug, Clone)]
pub struct Hub {
    pub settings: Arc<HubSettings>,
    pub endpoint: url::Url,
    pub client: reqwest::Client,
    pub retry: RetrySettings,
}

/// A revision resolved: its commit and every file in the repo at it.
#[derive(Debug, Clone)]
pub struct RepoInfo {
    pub commit: String,
    pub files: Vec<String>,
}

/// What `resolve/` said about one file.
#[derive(Debug, Clone)]
pub struct FileMeta {
    pub size: u64,
    /// `X-Linked-Etag` (an LFS file's sha256) else `ETag`, without quotes or `W/`.
    pub etag: Option<String>,
    /// Whether `etag` is an LFS sha256 (`X-Linked-Etag` was sent).
    pub lfs: bool,
    /// Whether the ETag was weak (`W/"..."`, from a proxy or mirror): no identity of the bytes.
    pub weak: bool,
    /// The `ETag` header as sent (quotes, `W/`): what a GET of a file the Hub serves itself
    /// answers, and the version such a read is pinned to.
    pub etag_header: Option<String>,
    pub location: Location,
}

impl Hub {
    pub fn new(settings: HubSettings, retry: RetrySettings) -> Result<Hub> {
        crate::store::install_crypto();
        let endpoint = crate::options::check_endpoint(&settings.endpoint)
            .map_err(|e| Error::option("HF_ENDPOINT", e))?;
        // One client per process (crate::store::clients): its settings are the same for
        // every open, and each of its own would hold sockets and read the CA files again.
        let client = clients::hub_client(|| {
            reqwest::Client::builder()
                .redirect(reqwest::redirect::Policy::none())
                .connect_timeout(Duration::from_secs(5))
                .read_timeout(Duration::from_secs(30))
                .pool_max_idle_per_host(clients::IDLE_PER_HOST)
                .pool_idle_timeout(clients::IDLE_TIMEOUT)
                .user_agent(concat!("fastload/", env!("CARGO_PKG_VERSION")))
                .build()
        })
        .map_err(|e| {
            if descriptors::exhausted(&e) {
                descriptors::error(&settings.endpoint)
            } else {
                Error::io(&settings.endpoint, io::Error::other(e))
            }
        })?;
        Ok(Hub {
            settings: Arc::new(settings),
            endpoint,
            client,
            retry,
        })
    }

    /// `{endpoint}/{segments...}`, each segment percent-encoded (a `/` inside one too). The
    /// endpoint was checked to be an http(s) URL with a host ([`crate::options::check_endpoint`]), which
    /// always has a path; were it not, the segments would be left off and the request fail.
    fn url<'a>(&self, segments: impl IntoIterator<Item = &'a str>) -> url::Url {
        let mut url = self.endpoint.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// The `resolve/` URL of a file at a commit.
    pub fn resolve_url(&self, repo_id: &str, commit: &str, path: &str) -> url::Url {
        let mut segments: Vec<&str> = repo_id.split('/').collect();
        segments.extend(["resolve", commit]);
        segments.extend(path.split('/'));
        self.url(segments)
    }

    /// A request, with the token when `url` is on the Hub's own origin.
    pub fn request(&self, method: Method, url: &url::Url) -> RequestBuilder {
        let builder = self.client.request(method, url.clone());
        match &self.settings.token {
            Some((token, _)) if super::location::same_origin(url, &self.endpoint) => {
                builder.header(AUTHORIZATION, format!("Bearer {token}"))
            }
            _ => builder,
        }
    }

    /// The revision's commit and file list.
    pub async fn repo_info(&self, uri: &HubUri) -> Result<RepoInfo> {
        let mut segments = vec!["api", "models"];
        segments.extend(uri.repo_id.split('/'));
        segments.extend(["revision", uri.revision()]);
        let url = self.url(segments);
        let name = format!("hf://{}@{}", uri.repo_id, uri.revision());
        let response = self.get_on_hub(&name, url).await?;
        let response = self.check(&name, &uri.repo_id, response).await?;
        let body = read_whole(&name, Whole::Body, response).await?;
        let value: serde_json::Value = serde_json::from_slice(&body)
            .map_err(|e| io_error(&name, io::ErrorKind::InvalidData, format!("bad JSON: {e}")))?;
        let commit = value
            .get("sha")
            .and_then(|s| s.as_str())
            .filter(|s| super::is_commit(s))
            .ok_or_else(|| {
                io_error(
                    &name,
                    io::ErrorKind::InvalidData,
                    "no commit sha in the answer",
                )
            })?;
        let files = value
            .get("siblings")
            .and_then(|s| s.as_array())
            .map(|a| {
                a.iter()
                    .filter_map(|s| s.get("rfilename")?.as_str().map(str::to_string))
                    .collect()
            })
            .unwrap_or_default();
        Ok(RepoInfo {
            commit: commit.to_lowercase(),
            files,
        })
    }

    /// `HEAD resolve/` of a file: size, ETag and where the bytes are, following the Hub's own
    /// relative redirects (renamed repos) but not the one to the storage host.
    pub async fn file_meta(&self, name: &str, repo_id: &str, url: &url::Url) -> Result<FileMeta> {
        let mut url = url.clone();
        for _ in 0..=MAX_HUB_REDIRECTS {
            let response = self.send(name, || self.request(Method::HEAD, &url)).await?;
            let status = response.status();
            let headers = response.headers().clone();
            let location = header(&headers, LOCATION.as_str())
                .map(|l| url.join(l))
                .transpose()
                .map_err(|e| {
                    io_error(
                        name,
                        io::ErrorKind::InvalidData,
                        format!("bad Location: {e}"),
                    )
                })?;
            if status.is_redirection() {
                let Some(to) = location else {
                    return Err(io_error(
                        name,
                        io::ErrorKind::InvalidData,
                        "redirect without a Location",
                    ));
                };
                // The Hub's own redirect (relative, or to its own origin) is followed with the
                // token; a redirect elsewhere is the storage location (as huggingface_hub).
                if super::location::same_origin(&to, &self.endpoint) {
                    url = to;
                    continue;
                }
                return meta(name, &headers, Location::new(to, &self.endpoint));
            }
            self.check(name, repo_id, response).await?;
            return meta(name, &headers, Location::new(url, &self.endpoint));
        }
        Err(io_error(
            name,
            io::ErrorKind::InvalidData,
            "too many redirects",
        ))
    }

    /// A GET that follows the Hub's redirects to its own origin (a renamed repo), with the token.
    async fn get_on_hub(&self, name: &str, mut url: url::Url) -> Result<Response> {
        for _ in 0..=MAX_HUB_REDIRECTS {
            let response = self.send(name, || self.request(Method::GET, &url)).await?;
            let to = header(response.headers(), LOCATION.as_str()).and_then(|l| url.join(l).ok());
            match to {
                Some(to)
                    if response.status().is_redirection()
                        && super::location::same_origin(&to, &self.endpoint) =>
                {
                    url = to
                }
                _ => return Ok(response),
            }
        }
        Err(io_error(
            name,
            io::ErrorKind::InvalidData,
            "too many redirects",
        ))
    }

    /// A whole small file (an index), through `resolve/`, with what `resolve/` said about it;
    /// never more than the cap on bodies read whole.
    pub async fn fetch(
        &self,
        name: &str,
        repo_id: &str,
        url: &url::Url,
    ) -> Result<(FileMeta, Vec<u8>)> {
        let meta = self.file_meta(name, repo_id, url).await?;
        let location = meta.location.url.clone();
        let response = self
            .send(name, || self.request(Method::GET, &location))
            .await?;
        let response = self.check(name, repo_id, response).await?;
        let bytes = read_whole(name, Whole::Index, response).await?;
        Ok((meta, bytes))
    }

    /// Sends the request `make` builds, again after a 429 (waiting `Retry-After`), a 5xx or a
    /// connection error, as the retry settings allow. Other answers come back as they are.
    pub async fn send(&self, name: &str, make: impl Fn() -> RequestBuilder) -> Result<Response> {
        let attempt = || async {
            Ok(match make().send().await {
                Ok(r) if !retryable(r.status()) => Attempt::Done(r),
                Ok(r) => Attempt::Again {
                    wait: retry_after(r.headers()),
                    last: Ok(r),
                },
                Err(e) if e.is_builder() => return Err(net_error(name, e)),
                Err(e) => Attempt::Again {
                    wait: None,
                    last: Err(e),
                },
            })
        };
        remote::send(&self.retry, attempt, |last| match last {
            Ok(r) => Err(status_error(name, r.status(), r.headers(), "after retries")),
            Err(e) => Err(net_error(name, e)),
        })
        .await
    }

    /// The response when it succeeded; else the error it means, naming the repo and where the
    /// token came from.
    pub async fn check(&self, name: &str, repo_id: &str, response: Response) -> Result<Response> {
        let status = response.status();
        if status.is_success() {
            return Ok(response);
        }
        let headers = response.headers().clone();
        let code = header(&headers, "x-error-code")
            .unwrap_or_default()
            .to_string();
        let hub_message = header(&headers, "x-error-message").map(str::to_string);
        let token = self.settings.token_note();
        let detail = hub_message
            .map(|m| format!(" The Hub says: {m}"))
            .unwrap_or_default();
        let (kind, text) = match (status.as_u16(), code.as_str()) {
            (_, "GatedRepo") => (
                io::ErrorKind::PermissionDenied,
                format!(
                    "{repo_id} is a gated repo: accept its conditions on the Hub with the account \
                     whose token is used (the request was made {token}).{detail}"
                ),
            ),
            (_, "RepoNotFound") | (401, _) => (
                io::ErrorKind::PermissionDenied,
                format!(
                    "repo {repo_id} was not found, or it is private and cannot be read {token} \
                     (status {status}).{detail}"
                ),
            ),
            (_, "RevisionNotFound") => (
                io::ErrorKind::NotFound,
                format!("repo {repo_id} has no such revision ({status}).{detail}"),
            ),
            (404, _) => {
                return Err(Error::NotFound {
                    path: name.to_string(),
                })
            }
            (403, _) => (
                io::ErrorKind::PermissionDenied,
                format!("access to {repo_id} refused (status {status}) {token}.{detail}"),
            ),
            _ => return Err(status_error(name, status, &headers, "")),
        };
        Err(io_error(name, kind, text))
    }
}

/// A whole body, refused once it passes the cap on bodies read whole (`crate::bounded`): by its
/// `Content-Length` before a byte is read, else while it streams (a chunked body claims nothing).
async fn read_whole(name: &str, what: Whole, mut response: Response) -> Result<Vec<u8>> {
    let mut out = Capped::new(name, what, response.content_length())?;
    while let Some(chunk) = response.chunk().await.map_err(|e| net_error(name, e))? {
        out.push(&chunk)?;
    }
    Ok(out.finish())
}

fn meta(name: &str, headers: &HeaderMap, location: Location) -> Result<FileMeta> {
    let linked = header(headers, "x-linked-etag");
    let raw = linked.or_else(|| header(headers, "etag"));
    let etag = raw.map(clean_etag);
    let size = header(headers, "x-linked-size")
        .or_else(|| header(headers, "content-length"))
        .and_then(|s| s.parse::<u64>().ok())
        .ok_or_else(|| {
            io_error(
                name,
                io::ErrorKind::InvalidData,
                "the Hub sent no file size",
            )
        })?;
    Ok(FileMeta {
        size,
        etag,
        lfs: linked.is_some(),
        weak: raw.is_some_and(|e| e.trim_start().starts_with("W/")),
        etag_header: header(headers, "etag").map(str::to_string),
        location,
    })
}

/// `"abc"` or `W/"abc"` → `abc`.
fn clean_etag(etag: &str) -> String {
    etag.trim()
        .trim_start_matches("W/")
        .trim_matches('"')
        .to_string()
}

pub fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers.get(name).and_then(|v| v.to_str().ok())
}

/// Statuses worth asking again: too many requests, and server errors.
pub fn retryable(status: StatusCode) -> bool {
    status == StatusCode::TOO_MANY_REQUESTS || status.is_server_error()
}

/// `Retry-After` in seconds (the Hub sends seconds; an HTTP date is treated as "soon").
pub fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let value = header(headers, RETRY_AFTER.as_str())?;
    value
        .trim()
        .parse::<u64>()
        .ok()
        .map(|s| Duration::from_secs(s.min(60)))
}

pub fn status_error(name: &str, status: StatusCode, headers: &HeaderMap, when: &str) -> Error {
    let kind = match status.as_u16() {
        404 => io::ErrorKind::NotFound,
        401 | 403 => io::ErrorKind::PermissionDenied,
        _ => io::ErrorKind::Other,
    };
    let message = header(headers, "x-error-message")
        .map(|m| format!(": {m}"))
        .unwrap_or_default();
    let when = if when.is_empty() {
        String::new()
    } else {
        format!(" {when}")
    };
    io_error(name, kind, format!("HTTP {status}{when}{message}"))
}

/// A transport error, without the URL (a signed location's query is a credential).
pub fn net_error(name: &str, e: reqwest::Error) -> Error {
    if descriptors::in_chain(&e) {
        return descriptors::error(name);
    }
    let kind = if e.is_timeout() {
        io::ErrorKind::TimedOut
    } else if e.is_connect() {
        io::ErrorKind::ConnectionRefused
    } else {
        io::ErrorKind::Other
    };
    let e = e.without_url();
    let mut message = e.to_string();
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        message.push_str(&format!(": {s}"));
        source = s.source();
    }
    io_error(name, kind, message)
}
