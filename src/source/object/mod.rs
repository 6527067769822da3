//! Object storage (s3://, gs://, az://, http(s)://) over the `object_store` crate. Building a store
//! flows one way: config.rs (URI, options, dispatch) → one builder per cloud (s3.rs with the shared
//! AWS files in aws_profile.rs and the AWS CLI's credential chain in aws_credentials.rs; gcs.rs;
//! azure.rs) → keys.rs (client defaults, environment and option-key helpers), with errors.rs beside
//! them all. Then shard discovery under a prefix (list.rs, index file first), and ranged reads
//! streamed straight into a caller's buffer (read.rs: each request of [`crate::source::remote`]'s
//! one resumable read, pinned to one version of the object), resuming cut-off bodies as one
//! [`RetrySettings`] allows (source/remote/retry.rs; object_store's request retries are built from
//! the same settings). source.rs makes each listed object a [`crate::source::Source`]
//! ([`RemoteObject`], [`open_sources`]); small.rs fetches a small file kept beside a checkpoint
//! unless the store says it is unchanged ([`read_small_unless`]).
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
mod checksums;
mod config;
mod errors;
mod gcs;
mod keys;
mod list;
mod read;
mod s3;
mod small;
mod source;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_cloud;
#[cfg(test)]
mod tests_pin;

pub use crate::source::remote::{Decision, ResumeState, RetrySettings};
pub use checksums::stored_checksum;
pub use config::{install_crypto, open, open_with_env, split_retry_options};
pub use errors::{io_error, redact_uri, storage_error};
pub use list::{head, list_folder, list_safetensors, list_tree, read_small, resolve, Found};
pub use read::{read_pinned, read_range_into};
pub use small::{read_small_unless, Small};
pub use source::{open_sources, RemoteObject};

/// HEAD requests in flight when sizes cannot be listed.
const HEAD_CONCURRENCY: usize = 16;

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
