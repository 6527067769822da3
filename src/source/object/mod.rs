//! Reading object storage (s3://, gs://, az://, http(s)://) over the `object_store` crate, from
//! stores that [`crate::store`] builds (URI, options, credentials, errors). Shard discovery under
//! a prefix (list.rs, index file first), and ranged reads streamed straight into a caller's buffer
//! (read.rs: each request of [`crate::source::remote`]'s one resumable read, pinned to one version
//! of the object), resuming cut-off bodies as one [`RetrySettings`] allows (store/retry.rs;
//! object_store's request retries are built from the same settings). source.rs makes each listed
//! object a [`crate::source::Source`] ([`RemoteObject`], [`open_sources`]); small.rs fetches a
//! small file kept beside a checkpoint unless the store says it is unchanged
//! ([`read_small_unless`]).

mod list;
mod read;
mod small;
mod source;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_pin;

pub use list::{head, list_folder, list_safetensors, list_tree, resolve, Found};
pub use read::{read_pinned, read_range_into};
pub use small::{read_small_unless, Small};
pub use source::{open_sources, RemoteObject};

/// HEAD requests in flight when sizes cannot be listed.
const HEAD_CONCURRENCY: usize = 16;
