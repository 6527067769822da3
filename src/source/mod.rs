//! Where bytes come from. A [`Source`] is one safetensors file or object: its size, and reads of
//! a byte range into a caller's buffer (plus a mapping of the range, where the source can). The
//! pipeline reads every block through this trait without knowing what is behind it.
//!
//! Every byte source lives here:
//! - [`open`]: the one table of URI schemes, the only place that decides what a URI names, and
//!   [`open::open_all`], which turns URIs into opened shards;
//! - [`local`]: files on this machine (plain paths, `file://`, directories of shards, index
//!   files), read with positioned reads and mapped for zero-copy loads ([`fs`]: which
//!   filesystem a path is on);
//! - [`object`]: objects behind `object_store` (s3://, gs://, az://, http(s)://) in stores
//!   [`crate::store`] builds: listing, ranged reads, and the objects as sources;
//! - [`hub`]: files of a Hugging Face Hub repo (hf://): its API client, the Hugging Face cache's
//!   layout, and the files as sources;
//! - [`remote`]: the one resumable ranged read both remote kinds read through (resumption, the
//!   stall rule, version pinning, give-up messages); they supply only the request;
//! - [`cache`]: the local cache of remote objects, a decorator over other sources that only
//!   [`open`] applies;
//! - [`tink`]: files encrypted with Tink's streaming AEAD, read as their plaintext (a
//!   decorator [`open`] applies over the others when a keyset is given);
//! - [`peer`]: serves (`fastload serve`) that hold the same pinned objects, read in place of
//!   the origin until they fail (a decorator [`open`] applies when `peers=` is given);
//! - [`identity`]: who a remote object is ([`CacheIdentity`], [`identity::HubLocation`]), the
//!   plain data that remote sources, the Hub and the cache share.
//!
//! A new kind of source is a new implementation of [`Source`] plus a row in [`open::SCHEMES`]
//! and one arm in [`open::open_all`].

use std::fmt;
use std::path::Path;
use std::sync::Arc;

use futures_util::future::BoxFuture;

use crate::error::{Error, Result};
use crate::format::{self, Header};
use crate::memory::HostBuffer;
use crate::source::identity::CacheIdentity;

pub(crate) mod cache;
pub mod decrypt;
pub(crate) mod fs;
pub(crate) mod hub;
pub(crate) mod identity;
pub(crate) mod local;
pub mod object;
pub mod open;
pub mod peer;
pub mod reads;
pub(crate) mod remote;

/// What one more request costs a reader of chosen ranges, in bytes it could read instead
/// (`crate::regions`: a gap between two runs is read when that is cheaper than another request).
/// An object store's request: its round trip, shared by the reads in flight (about 20 ms x
/// 1.5 GB/s / 64).
pub const REMOTE_READ_COST: u64 = 512 * 1024;
/// A file's read: a task and a `pread`.
pub const LOCAL_READ_COST: u64 = 16 * 1024;
/// A mapped file: no request at all, a region is a view of its span's pages (one span).
pub const MAPPED_READ_COST: u64 = 1 << 62;

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

    /// [`Source::read_into`] for a header's bytes ([`open_shard`]). Files read them without the
    /// kernel's read-ahead: its window would leave pages of tensor data cached, some marked to
    /// start the next window when read, so that a load reading around the page cache
    /// (`method="direct"`) would copy a block of them out of the cache and, by that read, have
    /// the kernel cache the blocks after it too.
    fn read_head<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        self.read_into(offset, dst)
    }

    /// Whether a read holds its thread until the bytes are in (files: `pread`), rather than
    /// waiting on I/O asynchronously (the network). Callers with many reads run such sources'
    /// reads on the runtime's blocking threads ([`spawn_read`]): `block_in_place` on an async
    /// worker costs a hand-off of the worker each time, measurable at 8 MiB blocks.
    fn reads_block(&self) -> bool {
        false
    }

    /// What one more request to this source costs, in bytes ([`REMOTE_READ_COST`] unless the
    /// source says otherwise: files, and decorators, which cost what their inner source costs).
    fn read_cost(&self) -> u64 {
        REMOTE_READ_COST
    }

    /// Where reads of this source are best cut: `Some((unit, shift))` when its bytes come in
    /// units that are fetched and checked whole (an encrypted file's segments, starting at
    /// offsets `k * unit - shift`), so that two reads cut inside one unit would each fetch it.
    /// `None`: anywhere ([`crate::plan::blocks_on`] cuts on this grid).
    fn grid(&self) -> Option<(u64, u64)> {
        None
    }

    /// A private mapping of `len` bytes at `offset`, whose pages are faulted in later with
    /// `HostBuffer::populate`; `None` when this source cannot be mapped (then it is read).
    fn map(&self, _offset: u64, _len: usize) -> Option<Result<HostBuffer>> {
        None
    }

    /// Reads `dst.len()` bytes at `offset` around the page cache (`O_DIRECT`), straight into
    /// `dst`: `offset`, `dst.len()` and `dst`'s address are multiples of [`direct_align`]. What
    /// it read ([`DirectRead::Read`], fewer bytes only at the end of the file), or why the range
    /// is better read with [`Source::read_into`]: its pages are in the page cache, or this source
    /// has no such read (not a local file, a filesystem that refuses `O_DIRECT`). Blocks its
    /// thread, as file reads do ([`Source::reads_block`]).
    fn read_direct(&self, _offset: u64, _dst: &mut [u8]) -> Result<DirectRead> {
        Ok(DirectRead::Refused(
            "not a local file (only a file's reads can go around the page cache)".into(),
        ))
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

    /// Who this object is, for the local cache ([`cache`]): remote sources that can be
    /// cached return their URI, size and ETag (or sha256); local files return `None`.
    fn cache_identity(&self) -> Option<CacheIdentity> {
        None
    }

    /// The canonical identity string of this object's content (peer protocol v1,
    /// [`identity::canonical_identity`]): its sha256 where known, else the validators every read
    /// is pinned to; `None` for local files. A peer's copy stands in for it only under the same
    /// string (source/peer.rs).
    fn content_identity(&self) -> Option<String> {
        let id = self.cache_identity()?;
        let (sha, etag) = (id.sha256.as_deref(), id.etag.as_deref());
        Some(identity::canonical_identity(sha, etag, None, id.size))
    }

    /// The whole object's checksum as its store keeps it (object stores, when asked for with
    /// `verify=True`); `verify=True` checks every byte read against it.
    fn stored_checksum(&self) -> Option<identity::StoredChecksum> {
        None
    }

    /// The version this source reads, as far as it tells versions apart (remote objects: the
    /// validators every read is pinned to; Hub files: their digest; local files: size and
    /// modification time); `None` when it knows none. Ranks of a tensor-parallel group that
    /// read one URI compare it before they exchange its bytes (python/fastload/_exchange.py).
    fn version(&self) -> Option<String> {
        let id = self.cache_identity()?;
        let blob = id.hub.as_ref().map(|h| h.blob_id.as_str());
        Some(format!(
            "size {} etag {:?} sha256 {:?} blob {blob:?}",
            id.size, id.etag, id.sha256
        ))
    }
}

/// What [`Source::read_direct`] did.
#[derive(Debug)]
pub enum DirectRead {
    /// Read around the page cache: this many bytes.
    Read(usize),
    /// The range's pages are all in the page cache: a copy from there beats the disk.
    Cached,
    /// This source cannot read around the page cache, and why.
    Refused(String),
}

/// What reads around the page cache align their offsets, lengths and buffers to: the page size,
/// a multiple of every storage device's logical block size that Linux runs on (512 or 4096).
pub fn direct_align() -> usize {
    crate::memory::page_size()
}

/// The aligned span around `len` bytes at `at`, for [`Source::read_direct`]: its start, where
/// the bytes begin in it (`lead`, under one [`direct_align`]), and its length (at most `len`
/// plus two aligned units).
pub fn direct_span(at: u64, len: u64) -> (u64, usize, usize) {
    let align = direct_align() as u64;
    let start = at / align * align;
    let end = (at + len).div_ceil(align) * align;
    (start, (at - start) as usize, (end - start) as usize)
}

/// The error of a read of `len` bytes at `at` that came back short, the file ending at `end`: it
/// was cut short while loading (a `pread`, or a read around the page cache).
pub fn short_read(name: &str, at: u64, len: u64, end: u64) -> Error {
    Error::Io {
        path: name.to_string(),
        source: std::io::Error::new(
            std::io::ErrorKind::UnexpectedEof,
            format!(
                "file ended at byte {end} while reading {len} bytes at offset {at} (was it \
                 truncated while loading?)"
            ),
        ),
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
    source.read_head(0, &mut probe).await?;
    let n = format::header_len(&probe, size).map_err(|e| Error::format(&name, e))?;
    let end = (format::PREFIX_LEN + n) as usize;
    if end > probe.len() {
        let have = probe.len();
        probe.resize(end, 0);
        source.read_head(have as u64, &mut probe[have..]).await?;
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
