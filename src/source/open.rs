//! Opening: [`open_all`] turns the user's URIs into opened shards, each by what the one table of
//! schemes ([`crate::uri`]) says it names (the local cache, a [`Source`] decorator, applied here
//! and nowhere else).

use std::sync::Arc;

use super::cache::{self, CacheSettings};
use super::decrypt::Decryption;
use super::{hub, local, object, peer, spawn_read, Shard, Source};
use crate::error::{Error, Result};
use crate::uri::{kind, Kind};

/// An object-store URI opened as a store and key (for whole small objects read beside a load:
/// listings, config files); any other URI is [`Error::UnsupportedUri`].
pub fn object_store(
    uri: &str,
    storage_options: &[(String, String)],
) -> Result<crate::store::Remote> {
    if kind(uri) != Kind::ObjectStore {
        return Err(Error::UnsupportedUri {
            uri: crate::store::redact_uri(uri),
            message: "not an object-store URL".into(),
        });
    }
    crate::store::open(uri, storage_options)
}

/// Headers read at once when there are many shards.
const HEADER_CONCURRENCY: usize = 16;

/// Resolves the URIs (files, shard directories, index files, object-store prefixes, Hub repos)
/// and opens every file or object, in a stable order, reading headers concurrently.
/// `storage_options` configure object stores (see [`crate::store::open`]) and the Hub's retries;
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
    // The peers' manifests are fetched while the origins are listed and pinned.
    let asked = peer::ask(&cache.peers, uris, storage_options)?;
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
    let sources = peer::wrap(sources, asked)?;
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
