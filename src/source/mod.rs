//! Where bytes come from. A [`Source`] is one safetensors file or object: its size, and reads of
//! a byte range into a caller's buffer (plus a mapping of the range, where the source can). The
//! pipeline reads every block through this trait without knowing what is behind it.
//!
//! Two implementations today:
//! - [`local`]: files on this machine (plain paths, `file://`, directories of shards, index
//!   files), read with positioned reads and mapped for zero-copy loads;
//! - [`object`]: objects behind `object_store` (s3://, gs://, az://, http(s)://), read with ranged
//!   GETs that resume cut-off bodies; errors classified and retried by `crate::object`;
//! - [`hub`]: files of a Hugging Face Hub repo (hf://), through `crate::hub`'s API client.
//!
//! A new kind of source (a hub, a cache that writes remote blocks to disk as they land) is a new
//! implementation of [`Source`] plus one arm in [`open_all`], which turns URIs into sources.

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::cache::{CacheIdentity, CacheSettings};
use crate::error::{Error, Result};
use crate::format::{self, Header};
use crate::memory::HostBuffer;

pub mod fs;
pub mod hub;
pub mod local;
pub mod object;

pub use local::{index_shard_names, INDEX_FILE};

/// One file or object that tensors are read from.
pub trait Source: Send + Sync + fmt::Debug {
    /// The path or URI as the user would recognise it; errors name it.
    fn name(&self) -> &str;

    /// Size in bytes, as seen when the source was opened.
    fn size(&self) -> u64;

    /// Reads exactly `dst.len()` bytes at `offset` into `dst`, retrying what the source can retry.
    ///
    /// Polled on the process runtime. Sources whose reads block a thread (files) wrap them in
    /// `tokio::task::block_in_place`, so the future is safe to poll anywhere and `dst` needs no
    /// `'static` owner; see [`Source::reads_block`].
    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>>;

    /// Whether a read holds its thread until the bytes are in (files: `pread`), rather than
    /// waiting on I/O asynchronously (the network). Callers with many reads run such sources'
    /// reads on the runtime's blocking threads ([`spawn_read`]): `block_in_place` on an async
    /// worker costs a hand-off of the worker each time, measurable at 8 MiB blocks.
    fn reads_block(&self) -> bool {
        false
    }

    /// A private mapping of `len` bytes at `offset`, whose pages are faulted in later with
    /// [`HostBuffer::populate`]; `None` when this source cannot be mapped (then it is read).
    fn map(&self, _offset: u64, _len: usize) -> Option<Result<HostBuffer>> {
        None
    }

    /// Checks that the source still holds the bytes it had when its header was read. Called
    /// after a mapping's pages were faulted in: a file cut short meanwhile reads as zeros (or
    /// faults) past its new end, with no error from the mapping itself.
    fn check_unchanged(&self) -> Result<()> {
        Ok(())
    }

    /// The file's path, for sources on this machine (the benchmark evicts them from the page
    /// cache for cold runs).
    fn local_path(&self) -> Option<&Path> {
        None
    }

    /// Who this object is, for the local cache ([`crate::cache`]): remote sources that can be
    /// cached return their URI, size and ETag (or sha256); local files return `None`.
    fn cache_identity(&self) -> Option<CacheIdentity> {
        None
    }
}

/// One safetensors file or object, opened, with its validated header.
#[derive(Debug, Clone)]
pub struct Shard {
    /// The name used in messages (the path or URI as the user would recognise it).
    pub name: String,
    pub size: u64,
    pub header: Header,
    pub source: Arc<dyn Source>,
}

impl Shard {
    /// The local path, for files on this machine.
    pub fn local_path(&self) -> Option<&Path> {
        self.source.local_path()
    }
}

/// First bytes fetched for a header: one read covers the headers of typical shards (a round trip
/// per shard is what costs on object stores), a second one only headers over 256 KiB.
const HEADER_PROBE: u64 = 256 * 1024;

/// Reads and validates the header of `source`. Never reads (or allocates) more than 8 bytes plus
/// a header length that was checked against the size and the format's cap.
pub async fn open_shard(source: Arc<dyn Source>) -> Result<Shard> {
    let size = source.size();
    let name = source.name().to_string();
    let mut probe = vec![0u8; size.min(HEADER_PROBE) as usize];
    source.read_into(0, &mut probe).await?;
    let n = format::header_len(&probe, size).map_err(|e| Error::format(&name, e))?;
    let end = (format::PREFIX_LEN + n) as usize;
    if end > probe.len() {
        let have = probe.len();
        probe.resize(end, 0);
        source.read_into(have as u64, &mut probe[have..]).await?;
    }
    let header = format::parse_header(&probe[format::PREFIX_LEN as usize..end], size)
        .map_err(|e| Error::format(&name, e))?;
    Ok(Shard {
        name,
        size,
        header,
        source,
    })
}

/// True when any URI names an object in an object store (not a local file).
pub fn any_remote(uris: &[String]) -> bool {
    uris.iter().any(|u| crate::object::is_remote(u))
}

/// Headers read at once when there are many shards.
const HEADER_CONCURRENCY: usize = 16;

/// Resolves the URIs (files, shard directories, index files, object-store prefixes) and opens
/// every file or object, in a stable order, reading headers concurrently. `storage_options`
/// configure object stores (see [`crate::object::open`]); remote sources are cached locally as
/// `cache` says ([`crate::cache::wrap`]).
pub fn open_all(
    uris: &[String],
    storage_options: &[(String, String)],
    cache: &CacheSettings,
) -> Result<Vec<Shard>> {
    if uris.is_empty() {
        return Err(Error::option("uri", "no file given"));
    }
    let mut sources: Vec<Arc<dyn Source>> = Vec::new();
    let mut local_uris = Vec::new();
    // Local URIs are resolved together so that a file named twice is loaded once; the order of
    // the user's URIs is kept across kinds.
    for uri in uris {
        if crate::hub::is_hub(uri) {
            sources.extend(local::open(&std::mem::take(&mut local_uris))?);
            sources.extend(hub::open(uri, storage_options, cache)?);
        } else if crate::object::is_remote(uri) {
            sources.extend(local::open(&std::mem::take(&mut local_uris))?);
            sources.extend(object::open(uri, storage_options)?);
        } else {
            local_uris.push(uri.clone());
        }
    }
    sources.extend(local::open(&local_uris)?);
    read_headers(crate::cache::wrap(sources, cache))
}

/// Local files whose headers are read on the calling thread, one after the other: up to this
/// many, a thread pool (and the runtime, on a process's first load) costs more than the reads.
const INLINE_HEADERS: usize = 8;

/// Every source's header, in order, [`HEADER_CONCURRENCY`] at a time; a few local files' on the
/// calling thread (a warm load of one file then starts no thread at all).
fn read_headers(sources: Vec<Arc<dyn Source>>) -> Result<Vec<Shard>> {
    use futures_util::stream::{StreamExt, TryStreamExt};
    use futures_util::FutureExt;

    let inline = sources.len() <= INLINE_HEADERS
        && sources.iter().all(|s| s.local_path().is_some())
        && tokio::runtime::Handle::try_current().is_err();
    if inline {
        // A local file's read completes in its first poll (a pread outside any runtime); a
        // source that would wait is read on the runtime instead.
        return sources
            .into_iter()
            .map(|source| match open_shard(source.clone()).now_or_never() {
                Some(shard) => shard,
                None => crate::runtime::block_on("reading headers", open_shard(source)),
            })
            .collect();
    }
    crate::runtime::block_on("reading headers", async move {
        futures_util::stream::iter(sources)
            // A task each, so that blocking reads (files) run side by side.
            .map(|source| {
                let name = source.name().to_string();
                let task = spawn_read(source.as_ref(), open_shard(source.clone()));
                // Dropped unfinished (an error elsewhere, an interrupted open): its read stops.
                let guard = AbortOnDrop(task.abort_handle());
                async move {
                    let out = joined(task.await, &name);
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

/// Spawns `task`, which reads from `source`, on the process runtime where the source's reads
/// belong: on a blocking thread for sources whose reads block, as an async task otherwise.
/// Call it from the runtime.
pub fn spawn_read<F>(source: &dyn Source, task: F) -> tokio::task::JoinHandle<F::Output>
where
    F: std::future::Future + Send + 'static,
    F::Output: Send + 'static,
{
    if source.reads_block() {
        let runtime = tokio::runtime::Handle::current();
        tokio::task::spawn_blocking(move || runtime.block_on(task))
    } else {
        tokio::spawn(task)
    }
}

/// The result of a task on the runtime: a task that panicked becomes [`Error::Internal`] naming
/// what it was working on.
pub(crate) fn joined<T>(
    result: std::result::Result<Result<T>, tokio::task::JoinError>,
    name: &str,
) -> Result<T> {
    result.map_err(|e| Error::Internal {
        message: format!("{name}: a worker task failed: {e}"),
    })?
}

#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// An in-memory source, for tests of code that takes shards.
    #[derive(Debug)]
    pub struct Bytes {
        pub name: String,
        pub data: Vec<u8>,
    }

    impl Source for Bytes {
        fn name(&self) -> &str {
            &self.name
        }
        fn size(&self) -> u64 {
            self.data.len() as u64
        }
        fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
            Box::pin(async move {
                let at = offset as usize;
                dst.copy_from_slice(&self.data[at..at + dst.len()]);
                Ok(())
            })
        }
    }
}
