//! Object-store clients, which both directions build: a URI and storage options to a store
//! (s3://, gs://, az://, http(s)://) over the `object_store` crate, for reading
//! ([`crate::source::object`]) and writing ([`crate::sink`]) alike; it imports neither. Building
//! a store flows one way: config.rs (URI, options, dispatch) → one builder per cloud (s3.rs with
//! the shared AWS files in aws_profile.rs and the AWS CLI's credential chain in
//! aws_credentials.rs; gcs.rs; azure.rs) → keys.rs (client defaults, environment and option-key
//! helpers), with errors.rs beside them all. checksums.rs asks stores for the checksums they keep
//! and signs uploads that carry one; clients.rs holds the HTTP clients (connection pools) every
//! remote open of a process shares; descriptors.rs says descriptors running out as such;
//! retry.rs holds the [`RetrySettings`] that object_store's request retries are built from and
//! that reads resume by.
//!
//! Errors (errors.rs): a missing object is [`crate::Error::NotFound`]; everything else is [`crate::Error::Io`]
//! whose `io::ErrorKind`, read from the error's types, says what failed (`NotFound` for a missing
//! bucket, `PermissionDenied`, `TimedOut`, `ConnectionRefused`, ...), with a message that names the
//! URI and has configured secrets and server-echoed request details scrubbed out.

use std::sync::Arc;

use object_store::path::Path;
use object_store::ObjectStore;

/// Test assertion: the object_store builder `b` (S3, GCS or Azure) holds `want` for `key`.
#[cfg(test)]
macro_rules! assert_value {
    ($b:expr, $key:expr, $want:expr) => {{
        let key = $key;
        assert_eq!($b.get_config_value(&key).as_deref(), Some($want), "{key:?}");
    }};
}

mod aws_credentials;
mod aws_profile;
mod azure;
pub(crate) mod checksums;
pub(crate) mod clients;
mod config;
pub(crate) mod descriptors;
mod errors;
mod gcs;
mod keys;
mod retry;
mod s3;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_cloud;

pub use checksums::{stored_checksum, StoredChecksum};
pub use config::{install_crypto, open, open_with_env, split_retry_options};
pub use errors::{io_error, redact_uri, storage_error};
pub use retry::{Decision, ResumeState, RetrySettings};

/// An opened object-store URI: the store, the key or prefix inside it, and the URI for messages.
#[derive(Debug, Clone)]
pub struct Remote {
    pub store: Arc<dyn ObjectStore>,
    /// The object key, or the prefix when the URI names a "directory".
    pub path: Path,
    /// The user's URI without credentials, query or fragment: use it in messages.
    pub uri: String,
    /// The URI ended with `/` or named a bucket root, so it can only be a prefix.
    pub is_prefix: bool,
    /// How reads of this store retry and resume (object_store's own retries were built from it).
    pub retry: RetrySettings,
    /// The same store's low-level multipart API (S3 and GCS, whose uploads take the object's
    /// metadata when they are created; `None` for other stores): several processes upload parts
    /// of one object ([`crate::copy`]'s split files).
    pub multipart: Option<Multipart>,
}

/// A store's [`object_store::multipart::MultipartStore`] (shown as its kind in `Debug`).
#[derive(Clone)]
pub struct Multipart(pub Arc<dyn object_store::multipart::MultipartStore>);

impl std::fmt::Debug for Multipart {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("MultipartStore")
    }
}

impl Remote {
    /// The URI of an object of this store, for messages (`s3://bucket/prefix/name`).
    pub fn uri_of(&self, path: &Path) -> String {
        if path == &self.path {
            return self.uri.clone();
        }
        let uri = self.uri.trim_end_matches('/');
        let own = self.path.as_ref();
        match uri.strip_suffix(own) {
            Some(base) if own.is_empty() => format!("{base}/{path}"),
            Some(base) => format!("{base}{path}"),
            None => {
                let rel = path.as_ref().strip_prefix(own).unwrap_or(path.as_ref());
                format!("{uri}/{}", rel.trim_start_matches('/'))
            }
        }
    }
}
