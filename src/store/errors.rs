//! object_store errors to the crate's error, with secrets and request echoes scrubbed.

use std::io;

use object_store::client::{HttpError, HttpErrorKind};
use url::Url;

use super::descriptors;
use crate::error::Error;

pub(super) fn unsupported(uri: &str, message: impl Into<String>) -> Error {
    Error::UnsupportedUri {
        uri: uri.to_string(),
        message: message.into(),
    }
}

/// An [`Error::Io`] naming `uri`, of `kind`, with `message` scrubbed of known secrets: how every
/// remote source (object stores, the Hub) words a failure that is not a missing object.
pub fn io_error(uri: &str, kind: io::ErrorKind, message: impl Into<String>) -> Error {
    Error::Io {
        path: uri.to_string(),
        source: io::Error::new(kind, crate::error::scrub(&message.into())),
    }
}

pub(super) fn build_error(uri: &str, e: object_store::Error) -> Error {
    if descriptors::exhausted(&e) {
        return descriptors::error(uri);
    }
    io_error(
        uri,
        io::ErrorKind::InvalidInput,
        format!("cannot configure the store: {}", clean_message(&chain(&e))),
    )
}

/// Maps an object_store error for `uri`: a missing object is [`Error::NotFound`]; a missing bucket
/// or container, and every other failure, is [`Error::Io`] whose `io::ErrorKind` says what failed
/// (from the error's types, see `failure_kind`).
pub fn storage_error(uri: &str, e: object_store::Error) -> Error {
    if let Some(found) = credentials_unavailable(&e) {
        return Error::Io {
            path: uri.to_string(),
            source: io::Error::new(io::ErrorKind::PermissionDenied, scrub(&found.message)),
        };
    }
    let text = chain(&e);
    let detail = clean_message(&text);
    if descriptors::in_chain(&e) {
        return descriptors::error(uri);
    }
    let kind = failure_kind(&e);
    let message = match kind {
        io::ErrorKind::NotFound if !names_missing_container(&text) => {
            return Error::NotFound {
                path: uri.to_string(),
            };
        }
        io::ErrorKind::NotFound => format!("bucket or container not found ({detail})"),
        io::ErrorKind::PermissionDenied => {
            format!("access denied: check the credentials and their rights ({detail})")
        }
        _ => detail,
    };
    // Constructed directly: `Error::io` would turn kind NotFound (a missing bucket) into NotFound.
    Error::Io {
        path: uri.to_string(),
        source: io::Error::new(kind, scrub(&message)),
    }
}

/// The AWS credential chain (aws_credentials.rs) could not give credentials: its message says
/// where it looked, or which flow failed and how.
#[derive(Debug)]
pub(super) struct CredentialsUnavailable {
    pub message: String,
}

impl std::fmt::Display for CredentialsUnavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for CredentialsUnavailable {}

/// The credential chain's failure inside an object_store error, if that is what it is.
fn credentials_unavailable(e: &object_store::Error) -> Option<&CredentialsUnavailable> {
    sources(e).find_map(|err| err.downcast_ref::<CredentialsUnavailable>())
}

/// `e` and the errors below it, outermost first.
fn sources(e: &object_store::Error) -> impl Iterator<Item = &(dyn std::error::Error + 'static)> {
    let first: &(dyn std::error::Error + 'static) = e;
    std::iter::successors(Some(first), |err| err.source())
}

/// What kind of failure `e` is, from its variant and the types in its source chain:
/// - object_store's variants carry the HTTP status it recognises (404, 401 and 403);
/// - a transport failure is object_store's `HttpError` (timeout, connect, interrupted) or
///   reqwest's error, and below them the `io::Error` of the socket, whose kind is the most precise
///   (`ConnectionRefused`, `ConnectionReset`, ...).
///
/// Other statuses (5xx, 429) reach us only as text: object_store keeps them in an error type it
/// does not export. They stay `Other`, as they were retried already; a listing's 401 and 403,
/// which reach us so too, are read from that text ([`unmapped_status`]).
pub(super) fn failure_kind(e: &object_store::Error) -> io::ErrorKind {
    match e {
        object_store::Error::NotFound { .. } => return io::ErrorKind::NotFound,
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => return io::ErrorKind::PermissionDenied,
        _ => {}
    }
    let mut kind = io::ErrorKind::Other;
    for err in sources(e) {
        if let Some(http) = err.downcast_ref::<HttpError>() {
            match http.kind() {
                HttpErrorKind::Timeout => return io::ErrorKind::TimedOut,
                HttpErrorKind::Connect => kind = io::ErrorKind::NotConnected,
                HttpErrorKind::Interrupted => kind = io::ErrorKind::ConnectionAborted,
                _ => {}
            }
        } else if let Some(req) = err.downcast_ref::<reqwest::Error>() {
            if req.is_timeout() {
                return io::ErrorKind::TimedOut;
            }
            if req.is_connect() {
                kind = io::ErrorKind::NotConnected;
            }
        } else if let Some(os) = err.downcast_ref::<io::Error>() {
            match os.kind() {
                io::ErrorKind::TimedOut => return io::ErrorKind::TimedOut,
                io::ErrorKind::Other => {}
                precise => kind = precise,
            }
        }
    }
    if kind == io::ErrorKind::Other && matches!(unmapped_status(e), Some(401 | 403)) {
        return io::ErrorKind::PermissionDenied;
    }
    kind
}

/// The HTTP status of a failed request that object_store answers without one of its status
/// variants (a listing's: it maps only single-object requests' 401, 403 and 404 to them). Its
/// retry error, which it does not export, displays as `Server returned non-2xx status code: 403
/// Forbidden: ...`; only an error of the chain whose own text begins so is read, never a
/// message that quotes one.
fn unmapped_status(e: &object_store::Error) -> Option<u16> {
    const STATUS: &str = "Server returned non-2xx status code: ";
    let line =
        sources(e).find_map(|err| err.to_string().strip_prefix(STATUS).map(str::to_string))?;
    line.get(..3)?.parse().ok()
}

/// True when a 404 is about the bucket or container rather than the object. The status is the
/// same; only the service's error code in the response body tells them apart, and object_store
/// passes the body on as text. So this reads the body's `<Code>` element (S3, GCS's XML API and
/// Azure all answer in XML), and nothing else of the text.
fn names_missing_container(text: &str) -> bool {
    const CODES: &[&str] = &["NoSuchBucket", "ContainerNotFound"];
    xml_element(text, "Code").is_some_and(|code| CODES.contains(&code.trim()))
}

/// The text of the first `<name>...</name>` element of an XML error body quoted in `text`.
fn xml_element<'a>(text: &'a str, name: &str) -> Option<&'a str> {
    let body = &text[text.find("<?xml").or_else(|| text.find("<Error>"))?..];
    let open = format!("<{name}>");
    let start = body.find(&open)? + open.len();
    let len = body[start..].find(&format!("</{name}>"))?;
    Some(&body[start..start + len])
}

/// The error and its sources, without repeating what an outer message already quotes.
pub(super) fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        source = s.source();
    }
    out
}

/// Replaces an XML error body (which can echo the request, signature details included) by its
/// `Code: Message`, and keeps messages to a readable length.
pub(super) fn clean_message(text: &str) -> String {
    let mut out = match text.find("<?xml").or_else(|| text.find("<Error>")) {
        Some(at) => {
            let summary = match (xml_element(text, "Code"), xml_element(text, "Message")) {
                (Some(c), Some(m)) => format!("{c}: {m}"),
                (Some(c), None) => c.to_string(),
                _ => "(XML error body)".to_string(),
            };
            format!("{}{summary}", &text[..at])
        }
        None => text.to_string(),
    };
    let trimmed = out.trim_end_matches([':', ' ']).len();
    out.truncate(trimmed);
    if out.len() > 2000 {
        let mut cut = 2000;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// The crate's one registry of credentials (src/error.rs): what is remembered here is scrubbed
/// from every message that leaves fastload, whichever error carries it.
pub(super) use crate::error::{remember_secret, scrub};

pub(super) fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    let names_a_file = ["file", "path", "uri", "url"]
        .iter()
        .any(|m| key.contains(m));
    !names_a_file
        && [
            "secret",
            "token",
            "key",
            "password",
            "sas",
            "credential",
            "connection",
        ]
        .iter()
        .any(|m| key.contains(m))
}

pub(super) fn remember_secrets(options: &[(String, String)], env: &[(String, String)]) {
    let cloud_env = env.iter().filter(|(k, _)| {
        k.starts_with("AWS_") || k.starts_with("AZURE_") || k.starts_with("GOOGLE_")
    });
    for (k, v) in options.iter().chain(cloud_env) {
        if is_secret_key(k) {
            remember_secret(v);
        }
    }
}

/// The URI without user info, query or fragment (a presigned query holds credentials).
pub fn redact_uri(uri: &str) -> String {
    match Url::parse(uri) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            url.to_string()
        }
        Err(_) => uri.split(['?', '#']).next().unwrap_or(uri).to_string(),
    }
}
