//! The crate's one error type. Every fallible function returns [`Result`]; the Python bindings map
//! these variants to exceptions in exactly one place (`python/errors.rs`).
//!
//! Every message that leaves the crate (an exception, the CLI's error line, a warning) goes
//! through [`Error::message`] or [`scrub`]: credentials fastload knows of are replaced by `***`,
//! from any source (a URL's user info, the Hub token, cloud keys in storage options or the
//! environment), wherever they appear in the text (a server that echoes the request, a library's
//! own message with the URL in it). The registry is filled where options, URIs and variables
//! are read ([`remember_secret`], [`remember_url_credentials`]).

use std::io;

use crate::format::FormatError;

/// Everything that can go wrong while planning or running a load.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is not a valid safetensors file (or the index file is malformed).
    #[error("{path}: invalid safetensors file: {source}")]
    Format {
        path: String,
        #[source]
        source: FormatError,
    },

    /// A file, object or directory does not exist.
    #[error("{path}: no such file or object")]
    NotFound { path: String },

    /// A directory holds no `*.safetensors` file (and no index): nothing to load. Raised as
    /// Python's `NotFoundError` with `filename` the directory.
    #[error("{path}: no .safetensors files in this directory (and no {index})", index = crate::format::INDEX_FILE)]
    NoShards { path: String },

    /// An I/O or network failure while reading. For object stores, `source.kind()` says what
    /// kind of failure it was (`NotFound` for a missing bucket, `PermissionDenied`, `TimedOut`,
    /// `ConnectionRefused`, ...).
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },

    /// Host memory for buffers could not be mapped. `what` says for what (` for tensor "x" of
    /// FILE`), empty where not known.
    #[error("host memory: cannot map {bytes} bytes{what}: {source}")]
    Memory {
        bytes: usize,
        what: String,
        #[source]
        source: io::Error,
    },

    /// Requested tensor names that no file contains.
    #[error("tensors not found in {uri}: {}", quoted(.names))]
    MissingTensors { uri: String, names: Vec<String> },

    /// An option value that cannot be used (bad size string, zero concurrency, unknown device, ...).
    #[error("invalid option {option}: {message}")]
    InvalidOption { option: String, message: String },

    /// A URI scheme this build does not handle.
    #[error("{uri}: unsupported URI: {message}")]
    UnsupportedUri { uri: String, message: String },

    /// The load ended without an error before every planned tensor was delivered (a worker
    /// stopped early).
    #[error("load ended after {delivered} of {planned} tensors")]
    Incomplete { delivered: u64, planned: u64 },

    /// The load was closed (from another thread, or interrupted) before it delivered every
    /// tensor; what was delivered stays valid.
    #[error(
        "the stream was closed before it finished: {delivered} of {planned} tensors delivered"
    )]
    Closed { delivered: u64, planned: u64 },

    /// Work given up before it finished (an open whose caller was interrupted); nobody waits for
    /// its result.
    #[error("{what}: cancelled")]
    Cancelled { what: String },

    /// A stream used in a process forked after it was opened: its reads run on threads of the
    /// process that opened it, which the child does not have.
    #[error(
        "this stream was opened in process {opened_in}; a forked child cannot iterate it: \
         open it again in the child"
    )]
    Forked { opened_in: u32 },

    /// A bug in fastload, such as a worker task that panicked.
    #[error("internal error: {message}")]
    Internal { message: String },

    /// CUDA is unavailable (no driver, no such device) or a driver call failed.
    #[error("{message}")]
    Device { message: String },

    /// The caller-supplied allocator of destination memory failed (for Python: the exception it
    /// raised, re-raised as is).
    #[error("allocating destination memory failed: {source}")]
    Allocation {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// A Tink-encrypted file (source/tink/) could not be decrypted: a segment failed
    /// authentication (`segment`), the file is cut short, or it was opened without a keyset.
    /// Raised as Python's `FormatError`.
    #[error("{path}: {message}")]
    Decryption {
        path: String,
        segment: Option<u64>,
        message: String,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn format(path: impl Into<String>, source: FormatError) -> Self {
        Error::Format {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn option(option: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidOption {
            option: option.into(),
            message: message.into(),
        }
    }

    pub(crate) fn device(message: impl Into<String>) -> Self {
        Error::Device {
            message: message.into(),
        }
    }

    /// The message as it may leave the crate: [`Display`](std::fmt::Display) with every known
    /// credential scrubbed out (`scrub`).
    pub fn message(&self) -> String {
        scrub(&self.to_string())
    }

    /// A [`Error::Memory`] told what the memory was for (` for tensor "x" of FILE`); other
    /// errors unchanged.
    pub(crate) fn memory_for(self, what: impl FnOnce() -> String) -> Self {
        match self {
            Error::Memory { bytes, source, .. } => Error::Memory {
                bytes,
                what: what(),
                source,
            },
            e => e,
        }
    }

    /// Wraps an `io::Error` for `path`, turning "not found" into [`Error::NotFound`].
    pub(crate) fn io(path: impl Into<String>, source: io::Error) -> Self {
        let path = path.into();
        if source.kind() == io::ErrorKind::NotFound {
            Error::NotFound { path }
        } else {
            Error::Io { path, source }
        }
    }
}

/// Names as the messages show them: quoted, escaped, comma-separated.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Credentials shorter than this are not scrubbed as plain text (they would scrub ordinary words,
/// and "true" is no secret); a URL's password is scrubbed by its place whatever its length.
const MIN_SECRET_LEN: usize = 6;

/// Credentials seen by this process, longest first (so that a secret containing another is
/// replaced whole). Per process: a forked child starts empty and remembers what its own opens
/// see (every open reads its options and environment again).
static SECRETS: crate::per_process::PerProcess<Vec<String>> =
    crate::per_process::PerProcess::new(Vec::new);

/// Remembers a credential to scrub from every message (and its percent-encoded form, as it
/// would appear in a URL).
pub fn remember_secret(value: &str) {
    let value = value.trim();
    if value.len() < MIN_SECRET_LEN {
        return;
    }
    let encoded = percent_encoding::utf8_percent_encode(value, percent_encoding::NON_ALPHANUMERIC)
        .to_string();
    let mut secrets = SECRETS.lock();
    for v in [value.to_string(), encoded] {
        if !secrets.contains(&v) {
            secrets.push(v);
        }
    }
    secrets.sort_by_key(|s| std::cmp::Reverse(s.len()));
}

/// Remembers the credentials in a URL's user info: the password (as written and decoded), and
/// the `Authorization: Basic` value an HTTP client sends for it, which a server may echo.
pub fn remember_url_credentials(uri: &str) {
    use base64::Engine;
    let Ok(url) = url::Url::parse(uri) else {
        return;
    };
    let Some(password) = url.password() else {
        return;
    };
    let decode = |s: &str| {
        percent_encoding::percent_decode_str(s)
            .decode_utf8_lossy()
            .into_owned()
    };
    let (user, plain) = (decode(url.username()), decode(password));
    remember_secret(password);
    remember_secret(&plain);
    let basic = base64::engine::general_purpose::STANDARD.encode(format!("{user}:{plain}"));
    remember_secret(&basic);
    remember_secret(basic.trim_end_matches('='));
}

/// `text` with every remembered credential and every URL password replaced by `***`.
pub fn scrub(text: &str) -> String {
    let secrets = SECRETS.lock().clone();
    let text = secrets
        .iter()
        .fold(text.to_string(), |t, s| t.replace(s.as_str(), "***"));
    scrub_url_passwords(&text)
}

/// `scheme://user:password@host` → `scheme://user:***@host`, wherever it appears in `text`.
fn scrub_url_passwords(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("://") {
        let (before, after) = rest.split_at(at + 3);
        out.push_str(before);
        // The authority ends at the first '/', '?', '#' or whitespace; user info before its
        // last '@'.
        let end = after
            .find(|c: char| matches!(c, '/' | '?' | '#') || c.is_whitespace())
            .unwrap_or(after.len());
        let authority = &after[..end];
        match authority.rfind('@') {
            Some(at_sign) => {
                let userinfo = &authority[..at_sign];
                match userinfo.split_once(':') {
                    Some((user, _)) => {
                        out.push_str(user);
                        out.push_str(":***");
                    }
                    None => out.push_str(userinfo),
                }
                out.push_str(&authority[at_sign..]);
            }
            None => out.push_str(authority),
        }
        rest = &after[end..];
    }
    out.push_str(rest);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_passwords_are_scrubbed_wherever_they_appear() {
        let text = "GET http://user:PASS@127.0.0.1:9/x failed; see https://a:b:c@h/ and s3://b/k";
        assert_eq!(
            scrub_url_passwords(text),
            "GET http://user:***@127.0.0.1:9/x failed; see https://a:***@h/ and s3://b/k"
        );
        assert_eq!(scrub_url_passwords("x://"), "x://");
        assert_eq!(scrub_url_passwords("://u:p@"), "://u:***@");
    }

    #[test]
    fn remembered_secrets_are_scrubbed_in_every_form() {
        remember_secret("s3cr3t/value+1");
        remember_secret("abc"); // too short to scrub as text
        let text = "a s3cr3t/value+1 b s3cr3t%2Fvalue%2B1 c abc";
        assert_eq!(scrub(text), "a *** b *** c abc");
        remember_url_credentials("http://alice:p%40ssword9@host/x");
        let echoed = "auth: Basic YWxpY2U6cEBzc3dvcmQ5, raw p@ssword9, encoded p%40ssword9";
        assert_eq!(scrub(echoed), "auth: Basic ***, raw ***, encoded ***");
    }

    #[test]
    fn messages_leave_scrubbed() {
        remember_secret("hf_token_for_message_test");
        let err = Error::Io {
            path: "http://u:pw@h/x".into(),
            source: io::Error::other("the server said hf_token_for_message_test"),
        };
        assert_eq!(err.message(), "http://u:***@h/x: the server said ***");
    }
}
