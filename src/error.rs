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

use crate::arguments::FrontEnd;
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

    /// A file, object or directory does not exist. Worded as safetensors (and the OS) word it.
    #[error("No such file or directory: {path}")]
    NotFound { path: String },

    /// Something that does not exist, where the message says where it was looked for (a Hub
    /// repo absent from the offline cache). Python's `NotFoundError`, as [`Error::NotFound`].
    #[error("{path}: {message}")]
    Missing { path: String, message: String },

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

    /// A name from data (an object key, an `auto_map` module, a pipeline's component) that would
    /// place or read a file outside the model's folder or destination
    /// ([`crate::format::check_inside`]); `path` says where the name came from. Refused before
    /// anything is read or written. (An index's entries are [`FormatError::IndexEntryOutside`].)
    #[error("{path}: {name:?} is not a file inside the model's folder: {reason}")]
    NameOutside {
        path: String,
        name: String,
        reason: crate::format::NameProblem,
    },

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

    /// Something used in a process forked after it was opened, where it cannot work: a stream
    /// (`what` "stream", `verb` "iterate": its reads run on threads of the process that opened
    /// it, which the child does not have), a remote file of `safe_open` (its connections are
    /// driven by that process's runtime; in the child a request would wait for ever).
    #[error(
        "this {what} was opened in process {opened_in}; a forked child cannot {verb} it: \
         open it again in the child"
    )]
    Forked {
        what: String,
        verb: &'static str,
        opened_in: u32,
    },

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

    /// A write's destination exists and overwriting was not asked for. Raised as Python's
    /// `fastload.DestinationExistsError` (a `FileExistsError`) with `filename` the destination.
    #[error("{}", exists(.path, FrontEnd::Python))]
    Exists { path: String },

    /// Tensors that cannot be written as they are (a duplicate or reserved name, a shape too
    /// large, or bytes that do not match the header).
    #[error("{uri}: cannot write these tensors: {message}")]
    InvalidTensors { uri: String, message: String },

    /// A Tink-encrypted file (source/decrypt/) could not be decrypted: a segment failed
    /// authentication (`segment`), the file is cut short, or it was opened without a keyset.
    /// Raised as Python's `FormatError`.
    #[error("{path}: {message}")]
    Decryption {
        path: String,
        segment: Option<u64>,
        message: String,
    },

    /// A file read without a keyset that is not safetensors (`detail` says why) and looks
    /// Tink-encrypted. Raised as Python's `FormatError`.
    #[error("{}", encrypted(.path, .detail, FrontEnd::Python))]
    Encrypted { path: String, detail: String },

    /// A copy asked to encrypt a file that is Tink-encrypted already. Raised as Python's
    /// `ConfigError` (`option` the keyset).
    #[error("{}", already_encrypted(.path, FrontEnd::Python))]
    AlreadyEncrypted { path: String },
}

// The messages that name arguments, worded for one front end (see `arguments::ARGUMENTS`):
// `Display` words them for Python, `Error::message_for` for either.

fn exists(path: &str, front: FrontEnd) -> String {
    format!(
        "{path}: already exists (pass {} to replace it)",
        front.given("overwrite")
    )
}

fn encrypted(path: &str, detail: &str, front: FrontEnd) -> String {
    format!(
        "{path}: not a safetensors file ({detail}); it looks like a Tink-encrypted file \
         (streaming AEAD header): pass {}",
        front.given("keyset")
    )
}

fn already_encrypted(path: &str, front: FrontEnd) -> String {
    format!(
        "invalid option {}: {path} looks Tink-encrypted already (its first bytes are a streaming \
         AEAD header, not a safetensors header): copy it without {} to keep it as it is",
        front.name("encrypt"),
        front.without("encrypt"),
    )
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
    /// credential scrubbed out (`scrub`). Python's words: see [`Error::message_for`].
    pub fn message(&self) -> String {
        self.message_for(FrontEnd::Python)
    }

    /// The message as `front` shows it: the arguments it names are that front end's (a flag on
    /// the command line, a keyword in Python), every known credential scrubbed out.
    pub fn message_for(&self, front: FrontEnd) -> String {
        let text = match self {
            Error::InvalidOption { option, message } => {
                format!("invalid option {}: {message}", front.name(option))
            }
            Error::Exists { path } => exists(path, front),
            Error::Encrypted { path, detail } => encrypted(path, detail, front),
            Error::AlreadyEncrypted { path } => already_encrypted(path, front),
            e => e.to_string(),
        };
        scrub(&text)
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

/// `text` with every remembered credential, every URL password and the value of every query
/// parameter that carries a credential (a presigned URL's signature and session token, a SAS
/// `sig`, an API key) replaced by `***`.
pub fn scrub(text: &str) -> String {
    let secrets = SECRETS.lock().clone();
    let text = secrets
        .iter()
        .fold(text.to_string(), |t, s| t.replace(s.as_str(), "***"));
    scrub_query_secrets(&scrub_url_passwords(&text))
}

/// Query parameters (compared without case) whose values are credentials: S3 and GCS presigned
/// URLs (SigV4 and V2), Azure SAS, CloudFront signed URLs, OAuth and API-key parameters. The
/// credential's id (`X-Amz-Credential`, `AWSAccessKeyId`) is scrubbed too: it names the account.
const SECRET_PARAMS: [&str; 17] = [
    "x-amz-signature",
    "x-amz-security-token",
    "x-amz-credential",
    "x-goog-signature",
    "x-goog-credential",
    "x-goog-security-token",
    "awsaccesskeyid",
    "signature",
    "sig",
    "policy",
    "token",
    "access_token",
    "id_token",
    "api_key",
    "apikey",
    "key",
    "client_secret",
];

/// `?X-Amz-Signature=abc&x=1` → `?X-Amz-Signature=***&x=1`, wherever a `?`, `&` or `;` starts a
/// parameter named in [`SECRET_PARAMS`]; the value ends at the next `&`, `#`, quote, bracket or
/// whitespace.
fn scrub_query_secrets(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find(['?', '&', ';']) {
        let (before, after) = rest.split_at(at + 1);
        out.push_str(before);
        rest = after;
        let Some(eq) = after.find('=') else { continue };
        let name = &after[..eq];
        if !SECRET_PARAMS.iter().any(|p| name.eq_ignore_ascii_case(p)) {
            continue;
        }
        let value = &after[eq + 1..];
        let end = value
            .find(|c: char| {
                matches!(
                    c,
                    '&' | '#' | ';' | '\'' | '"' | ')' | ']' | '>' | '<' | ','
                ) || c.is_whitespace()
            })
            .unwrap_or(value.len());
        out.push_str(name);
        out.push_str(if end == 0 { "=" } else { "=***" });
        rest = &value[end..];
    }
    out.push_str(rest);
    out
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
    fn query_credentials_are_scrubbed_wherever_they_appear() {
        let presigned = "GET 'https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256\
            &X-Amz-Credential=AKIAEXAMPLE%2F20261126&X-Amz-Security-Token=FwoGZXIvYXdz\
            &X-Amz-Signature=deadbeef' failed";
        assert_eq!(
            scrub(presigned),
            "GET 'https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4-HMAC-SHA256\
            &X-Amz-Credential=***&X-Amz-Security-Token=***&X-Amz-Signature=***' failed"
        );
        for (text, want) in [
            ("az://c/k?sv=2022&sig=abc%2Bdef", "az://c/k?sv=2022&sig=***"),
            (
                "x?SIG=a#frag and ?token=t, ok",
                "x?SIG=***#frag and ?token=***, ok",
            ),
            ("u?key=AIza123 (see)", "u?key=*** (see)"),
            ("u?keys=1&sig=", "u?keys=1&sig="),
            ("a & b ? c", "a & b ? c"),
            (
                "u?x=1&x-goog-signature=00ff\nnext",
                "u?x=1&x-goog-signature=***\nnext",
            ),
        ] {
            assert_eq!(scrub(text), want, "{text}");
        }
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
