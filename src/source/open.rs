//! Opening: the one table of URI schemes, the only place that decides what a URI names, and
//! [`open_all`], which turns the user's URIs into opened shards (the local cache, a [`Source`]
//! decorator, applied here and nowhere else).
//!
//! Everything else asks this module what a URI is: [`kind`], [`is_remote`], [`any_remote`],
//! [`remote_schemes`] (Python's `SCHEMES` and `is_remote_uri`).

use std::sync::Arc;

use super::cache::{self, CacheSettings};
use super::tink::Decryption;
use super::{hub, local, object, peer, spawn_read, Shard, Source};
use crate::error::{Error, Result};

/// What a URI names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A file or directory on this machine: a plain path or `file://` (the local fast path).
    Local,
    /// An object (or prefix) in an object store, opened through `object_store` ([`object`]).
    ObjectStore,
    /// A file or folder of a Hugging Face Hub repo ([`hub`]).
    Hub,
    /// A checkpoint a `fastload serve` serves, with no origin behind it ([`peer`]).
    Peer,
}

/// Every scheme fastload reads, and what it names. A URI with a scheme not listed here is taken
/// as a local path, which fails naming the scheme.
pub const SCHEMES: &[(&str, Kind)] = &[
    ("file", Kind::Local),
    ("s3", Kind::ObjectStore),
    ("s3a", Kind::ObjectStore),
    ("gs", Kind::ObjectStore),
    ("az", Kind::ObjectStore),
    ("azure", Kind::ObjectStore),
    ("abfs", Kind::ObjectStore),
    ("abfss", Kind::ObjectStore),
    ("adl", Kind::ObjectStore),
    ("http", Kind::ObjectStore),
    ("https", Kind::ObjectStore),
    ("hf", Kind::Hub),
    ("peer", Kind::Peer),
];

/// What `uri` names, by its scheme (`scheme://`, any case); plain paths are local.
pub fn kind(uri: &str) -> Kind {
    uri.split_once("://")
        .and_then(|(scheme, _)| {
            SCHEMES
                .iter()
                .find(|(s, _)| s.eq_ignore_ascii_case(scheme))
                .map(|&(_, kind)| kind)
        })
        .unwrap_or(Kind::Local)
}

/// True when `uri` is read over the network (an object store or the Hub), not from this machine.
pub fn is_remote(uri: &str) -> bool {
    kind(uri) != Kind::Local
}

/// True when any URI is read over the network.
pub fn any_remote(uris: &[String]) -> bool {
    uris.iter().any(|u| is_remote(u))
}

/// The schemes read over the network, in table order (Python's `SCHEMES`).
pub fn remote_schemes() -> Vec<&'static str> {
    SCHEMES
        .iter()
        .filter(|(_, kind)| *kind != Kind::Local)
        .map(|&(scheme, _)| scheme)
        .collect()
}

/// An object-store URI opened as a store and key (for whole small objects read beside a load:
/// listings, config files); any other URI is [`Error::UnsupportedUri`].
pub fn object_store(uri: &str, storage_options: &[(String, String)]) -> Result<object::Remote> {
    if kind(uri) != Kind::ObjectStore {
        return Err(Error::UnsupportedUri {
            uri: object::redact_uri(uri),
            message: "not an object-store URL".into(),
        });
    }
    object::open(uri, storage_options)
}

/// Headers read at once when there are many shards.
const HEADER_CONCURRENCY: usize = 16;

/// Resolves the URIs (files, shard directories, index files, object-store prefixes, Hub repos)
/// and opens every file or object, in a stable order, reading headers concurrently.
/// `storage_options` configure object stores (see [`object::open`]) and the Hub's retries;
/// remote sources are cached locally as `cache` says ([`cache::wrap`]); files are read as
/// plaintext with `decryption`'s keyset, if any (the cache keeps their ciphertext).
pub fn open_all(
    uris: &[String],
    storage_options: &[(String, String)],
    cache: &CacheSettings,
    decryption: &Decryption,
) -> Result<Vec<Shard>> {
    if uris.is_empty() {
        return Err(Error::option("uri", "no file given"));
    }
    let mut sources: Vec<Arc<dyn Source>> = Vec::new();
    let mut local_uris = Vec::new();
    // Local URIs are resolved together so that a file named twice is loaded once; the order of
    // the user's URIs is kept across kinds.
    for uri in uris {
        if uri.trim().is_empty() {
            return Err(Error::option(
                "uri",
                format!("{uri:?} is empty: name a file, a directory or a URI"),
            ));
        }
        match kind(uri) {
            Kind::Hub => {
                sources.extend(local::open(&std::mem::take(&mut local_uris))?);
                // The index file, read whole while opening, is kept as the cache keeps shards.
                let keep = |identity: &_, bytes: &[u8]| cache::put_whole(identity, bytes, cache);
                sources.extend(hub::open(uri, storage_options, &keep)?);
            }
            Kind::ObjectStore => {
                sources.extend(local::open(&std::mem::take(&mut local_uris))?);
                sources.extend(object::open_sources(uri, storage_options, cache.verify)?);
            }
            Kind::Peer => {
                sources.extend(local::open(&std::mem::take(&mut local_uris))?);
                sources.extend(peer::open_uri(uri, &cache.peers, storage_options)?);
            }
            Kind::Local => local_uris.push(uri.clone()),
        }
    }
    sources.extend(local::open(&local_uris)?);
    let sources = peer::wrap(sources, &cache.peers, storage_options)?;
    read_headers(cache::wrap(sources, cache), decryption)
}

/// Local files whose headers are read on the calling thread, one after the other: up to this
/// many, a thread pool (and the runtime, on a process's first load) costs more than the reads.
const INLINE_HEADERS: usize = 8;

/// Every source's header, in order, [`HEADER_CONCURRENCY`] at a time; a few local files' on the
/// calling thread (a warm load of one file then starts no thread at all).
fn read_headers(sources: Vec<Arc<dyn Source>>, decryption: &Decryption) -> Result<Vec<Shard>> {
    use futures_util::stream::{StreamExt, TryStreamExt};
    use futures_util::FutureExt;

    let inline = !decryption.enabled()
        && sources.len() <= INLINE_HEADERS
        && sources.iter().all(|s| s.local_path().is_some())
        && tokio::runtime::Handle::try_current().is_err();
    if inline {
        // A local file's read completes in its first poll (a pread outside any runtime); a
        // source that would wait is read on the runtime instead.
        return sources
            .into_iter()
            .map(
                |source| match decryption.open_shard(source.clone()).now_or_never() {
                    Some(shard) => shard,
                    None => {
                        crate::runtime::block_on("reading headers", decryption.open_shard(source))
                    }
                },
            )
            .collect();
    }

    let decryption = decryption.clone();
    crate::runtime::block_on("reading headers", async move {
        futures_util::stream::iter(sources)
            // A task each, so that blocking reads (files) run side by side.
            .map(|source| {
                let name = source.name().to_string();
                let decryption = decryption.clone();
                let opening = {
                    let source = source.clone();
                    async move { decryption.open_shard(source).await }
                };
                let task = spawn_read(source.as_ref(), opening);
                // Dropped unfinished (an error elsewhere, an interrupted open): its read stops.
                let guard = AbortOnDrop(task.abort_handle());
                async move {
                    let out = super::joined(task.await, &name);
                    drop(guard);
                    out
                }
            })
            .buffered(HEADER_CONCURRENCY)
            .try_collect()
            .await
    })
}

/// Aborts a spawned task when dropped (a no-op once it finished): a `JoinHandle` dropped alone
/// would leave the task running.
struct AbortOnDrop(tokio::task::AbortHandle);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recognises_schemes() {
        for uri in [
            "s3://b/k",
            "S3://b/k",
            "s3a://b/k",
            "gs://b/k",
            "az://c/k",
            "abfs://c/k",
            "abfss://c@a.dfs.core.windows.net/k",
            "http://h/x",
            "https://h/x",
        ] {
            assert_eq!(kind(uri), Kind::ObjectStore, "{uri}");
            assert!(is_remote(uri), "{uri}");
        }
        for uri in ["hf://org/repo", "HF://org/repo@main/sub"] {
            assert_eq!(kind(uri), Kind::Hub, "{uri}");
            assert!(is_remote(uri), "{uri}");
        }
        for uri in [
            "/tmp/x",
            "x.safetensors",
            "file:///tmp/x",
            "memory:///x",
            "ftp://h/x",
            "",
        ] {
            assert_eq!(kind(uri), Kind::Local, "{uri}");
            assert!(!is_remote(uri), "{uri}");
        }
        assert!(any_remote(&["/x".into(), "hf://o/r".into()]));
        assert!(!any_remote(&["/x".into(), "file:///y".into()]));
        assert_eq!(
            remote_schemes(),
            [
                "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https", "hf",
                "peer"
            ]
        );
    }

    #[test]
    fn object_store_takes_only_object_store_uris() {
        for uri in ["hf://org/repo", "file:///tmp/x", "ftp://h/x", "/tmp/x"] {
            let err = object_store(uri, &[]).unwrap_err();
            assert!(
                matches!(err, Error::UnsupportedUri { ref message, .. } if message == "not an object-store URL"),
                "{uri}: {err}"
            );
        }
    }
}
