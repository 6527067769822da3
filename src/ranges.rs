//! Reads of chosen byte ranges of one source into one host buffer, in parallel blocks: what a
//! slice of a tensor needs (`fastload.safe_open(...).get_slice(name)[...]`), where a load reads
//! whole tensors through the pipeline.
//!
//! The caller says which ranges (file offsets) it needs; they land one after the other in the
//! buffer, in the order given. Ranges that touch in the file are read as one; every read is cut
//! into blocks of at most `block_size` bytes ([`crate::plan::blocks`]), `concurrency` in flight.
//! Nothing outside the ranges is read.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::memory::HostBuffer;
use crate::runtime::Abort;
use crate::source::reads::{CancelOnDrop, Reads};
use crate::source::{self, Source};

/// One read: `len` bytes at file offset `src` into the buffer at `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Read {
    pub src: u64,
    pub dst: u64,
    pub len: u64,
}

/// The reads that fill a buffer with `ranges` (`(file offset, len)`) one after the other: ranges
/// that follow each other in the file become one read, each read is cut at multiples of `block`
/// (empty ranges read nothing). Checks every range against `size`.
pub fn reads(ranges: &[(u64, u64)], size: u64, block: u64, name: &str) -> Result<Vec<Read>> {
    let mut merged: Vec<Read> = Vec::new();
    let mut dst = 0u64;
    for &(src, len) in ranges {
        if src.checked_add(len).is_none_or(|end| end > size) {
            return Err(Error::option(
                "ranges",
                format!("{name}: range of {len} bytes at {src} is outside the file ({size} bytes)"),
            ));
        }
        if len == 0 {
            continue;
        }
        match merged.last_mut() {
            Some(last) if last.src + last.len == src && last.dst + last.len == dst => {
                last.len += len;
            }
            _ => merged.push(Read { src, dst, len }),
        }
        dst += len;
    }
    Ok(merged
        .into_iter()
        .flat_map(|r| {
            crate::plan::blocks(r.src, r.len, block).map(move |(off, len)| Read {
                src: r.src + off,
                dst: r.dst + off,
                len,
            })
        })
        .collect())
}

/// Counters of one [`read`].
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Done {
    /// Bytes read from the source.
    pub bytes: u64,
    /// Reads issued (requests, for object stores).
    pub reads: u64,
}

/// Reads `ranges` of `source` into a new buffer of their total length, `concurrency` reads of at
/// most `block` bytes in flight. Call it from outside the runtime (it waits).
pub fn read(
    source: Arc<dyn Source>,
    ranges: &[(u64, u64)],
    block: u64,
    concurrency: usize,
) -> Result<(HostBuffer, Done)> {
    let total: u64 = ranges.iter().map(|r| r.1).sum();
    let plan = reads(ranges, source.size(), block, source.name())?;
    let buffer = Arc::new(HostBuffer::alloc(total as usize)?);
    let done = Done {
        bytes: plan.iter().map(|r| r.len).sum(),
        reads: plan.len() as u64,
    };
    if !plan.is_empty() {
        let filled = buffer.clone();
        crate::runtime::block_on("reading ranges", async move {
            fill(source, filled, plan, concurrency).await
        })?;
    }
    let buffer = Arc::try_unwrap(buffer).map_err(|_| Error::Internal {
        message: "a range read outlived its load".into(),
    })?;
    buffer.mark_populated();
    Ok((buffer, done))
}

/// Reads every byte of `source`, `concurrency` reads of at most `block` bytes in flight, and
/// drops them: what the source's decorators do with the bytes is the point (a verifying source
/// hashes them, a filling one writes its copy). Call it from outside the runtime (it waits).
pub fn read_whole(source: Arc<dyn Source>, block: u64, concurrency: usize) -> Result<Done> {
    let size = source.size();
    let blocks: Vec<(u64, u64)> = crate::plan::blocks(0, size, block).collect();
    let done = Done {
        bytes: size,
        reads: blocks.len() as u64,
    };
    let (name, on) = (source.name().to_string(), source.clone());
    let reads = blocks.into_iter().map(move |(at, len)| {
        let src = source.clone();
        async move {
            let mut bytes = vec![0u8; len as usize];
            src.read_into(at, &mut bytes).await
        }
    });
    crate::runtime::block_on(
        "reading a whole file",
        run_all(on, &name, concurrency, reads),
    )?;
    Ok(done)
}

/// `verify=True` for readers of parts of files (`safe_open`, whose slices and tensors read what
/// they need): every remote file whose store gives a digest (Hub files: sha256, git blob id) is
/// read whole once through its verifying source before anything else is read from it, so that
/// a mismatch fails here and what is served later is of a file that matched (later reads are
/// pinned to the version that was hashed). With a cache (`cache.fill` on), that read fills the
/// copy, and the file is read from the copy from then on. Local files and cached copies were
/// hashed when they were opened (`source::cache::wrap`).
pub fn verify_whole(
    shards: &mut [source::Shard],
    cache: &source::cache::CacheSettings,
    block: u64,
    concurrency: usize,
) -> Result<()> {
    for shard in shards {
        let identity = shard.source.cache_identity();
        let digest = identity.as_ref().and_then(|i| i.digest());
        let checkable = digest.is_some() || shard.source.stored_checksum().is_some();
        if !cache.verify || shard.source.local_path().is_some() || !checkable {
            continue;
        }
        read_whole(shard.source.clone(), block, concurrency)?;
        if let Some(copy) = identity.and_then(|i| source::cache::published_copy(&i, cache)) {
            shard.source = copy;
        }
    }
    Ok(())
}

/// Runs `plan`'s reads into `buffer` ([`run_all`]).
async fn fill(
    source: Arc<dyn Source>,
    buffer: Arc<HostBuffer>,
    plan: Vec<Read>,
    concurrency: usize,
) -> Result<()> {
    let (name, on) = (source.name().to_string(), source.clone());
    let reads = plan.into_iter().map(move |r| {
        let (src, buf) = (source.clone(), buffer.clone());
        async move {
            // SAFETY: the reads' destinations are disjoint (each range has its own place in the
            // buffer) and the buffer is handed out only after every read ended.
            #[allow(unsafe_code)]
            let dst = unsafe { buf.slice_mut(r.dst as usize, r.len as usize) };
            src.read_into(r.src, dst).await
        }
    });
    run_all(on, &name, concurrency, reads).await
}

/// Runs `reads` of `source`, at most `concurrency` at once, each a task of its own where the
/// source's reads belong ([`Reads`], as a load's driver starts its reads), and waits for every
/// one; the first error (in their order) ends the wait, and the reads still running are dropped
/// with it (each keeps what it writes into alive until then).
///
/// Not a use of the load's driver (`crate::pipeline::driver`, a layer up): it walks a plan's
/// segments under a memory budget and hands them to a consumer; these fill one buffer, waited for.
async fn run_all<F>(
    source: Arc<dyn Source>,
    name: &str,
    concurrency: usize,
    reads: impl IntoIterator<Item = F>,
) -> Result<()>
where
    F: std::future::Future<Output = Result<()>> + Send + 'static,
{
    let stop = CancelOnDrop(Arc::new(Abort::default()));
    let slots = Reads::new(concurrency, stop.0.clone());
    let mut tasks = Vec::new();
    for read in reads {
        let started = slots.start(source.as_ref(), read).await;
        tasks.push(started.ok_or_else(|| cancelled(name))?);
    }
    for task in tasks {
        let out = task
            .await
            .map(|out| out.unwrap_or_else(|| Err(cancelled(name))));
        source::joined(out, name)?;
    }
    Ok(())
}

/// Reads of a wait that ended before they did (they were dropped with it).
fn cancelled(name: &str) -> Error {
    Error::Cancelled {
        what: format!("reading {name}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::testing::Bytes;

    fn src(n: usize) -> Arc<dyn Source> {
        Arc::new(Bytes {
            name: "mem".into(),
            data: (0..n).map(|i| (i * 7 % 251) as u8).collect(),
        })
    }

    #[test]
    fn touching_ranges_merge_and_blocks_cut_at_multiples() {
        let r = reads(&[(10, 5), (15, 5), (30, 2), (0, 0)], 100, 16, "f").unwrap();
        assert_eq!(
            r,
            vec![
                Read {
                    src: 10,
                    dst: 0,
                    len: 6
                },
                Read {
                    src: 16,
                    dst: 6,
                    len: 4
                },
                Read {
                    src: 30,
                    dst: 10,
                    len: 2
                },
            ]
        );
    }

    #[test]
    fn out_of_file_range_is_an_option_error_naming_the_file() {
        let e = reads(&[(90, 11)], 100, 16, "f.safetensors").unwrap_err();
        assert!(matches!(e, Error::InvalidOption { .. }), "{e}");
        assert!(e.to_string().contains("f.safetensors"), "{e}");
        assert!(reads(&[(u64::MAX, 2)], 100, 16, "f").is_err());
    }

    #[test]
    fn read_lands_ranges_in_order_and_counts_only_them() {
        let s = src(1000);
        let ranges = [(900, 50), (3, 10), (13, 7), (500, 0), (999, 1)];
        let (buf, done) = read(s.clone(), &ranges, 8, 3).unwrap();
        let data: Vec<u8> = (0..1000).map(|i| (i * 7 % 251) as u8).collect();
        let mut want = Vec::new();
        for (o, l) in ranges {
            want.extend_from_slice(&data[o as usize..(o + l) as usize]);
        }
        assert_eq!(buf.as_slice(), &want[..]);
        assert_eq!(done.bytes, 68);
        // 900..950 in 8-byte-aligned blocks: 900..904, five of 8, 944..950; 3..20 merged:
        // 3..8, 8..16, 16..20; and 999..1000.
        assert_eq!(done.reads, 7 + 3 + 1);
    }

    #[test]
    fn nothing_to_read_is_an_empty_buffer() {
        let (buf, done) = read(src(10), &[], 8, 1).unwrap();
        assert!(buf.is_empty());
        assert_eq!(done, Done::default());
    }
}
