//! Loads into host memory, a destination of the [driver](super::driver): each segment gets one
//! `HostBuffer`, a mapping of the source where it can be mapped and `method` asks for it, else
//! pooled memory its blocks are read into; the tensors are views of it. Segments whose pages are
//! all in the page cache are handed over before the driver starts ([`publish_cached`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use tokio::sync::OwnedSemaphorePermit;

use super::direct::Direct;
use super::driver::{Budget, Driver, Landing};
use super::{beside_reads, Feed, Loaded, Loader, Memory};
use crate::error::Result;
use crate::memory::{self, HostBuffer};
use crate::options::{Method, Resolved};
use crate::plan::Plan;
use crate::source;

impl Loader {
    /// Starts reading `plan`: segments mapped from the page cache are handed over at once
    /// ([`publish_cached`]), the rest are read on the process runtime.
    pub fn start(plan: Plan, opts: Resolved) -> Loader {
        let (method, method_reason) = match opts.method {
            Method::Auto => auto_method(&plan),
            // Blocks cut off the page grid would share pages that two reads both write.
            Method::Direct if opts.block_size % source::direct_align() as u64 != 0 => (
                Method::Read,
                format!(
                    "{}, but block_size={} is not whole pages, which reads around the page \
                     cache need: read into pooled buffers",
                    opts.method_reason, opts.block_size
                ),
            ),
            Method::Direct => (Method::Direct, format!("{}: {DIRECT}", opts.method_reason)),
            m => (m, opts.method_reason.clone()),
        };
        memory::set_pool_limit(opts.memory_limit);
        let budget = Budget::new(opts.memory_limit);
        let opts = Resolved {
            method,
            method_reason,
            ..opts
        };
        let (loader, feed) = Loader::new(plan, vec![budget.semaphore()], opts.clone(), None);
        let from = match opts.method {
            Method::Mmap => publish_cached(&loader.plan, &feed),
            _ => 0,
        };
        if from < loader.plan.segments.len() {
            let host = Host {
                plan: loader.plan.clone(),
                method: opts.method,
                direct: AtomicBool::new(opts.method == Method::Direct),
                feed: feed.clone(),
            };
            let driver = Driver {
                plan: loader.plan.clone(),
                from,
                block: opts.block_size,
                concurrency: opts.concurrency,
                budget,
                feed,
                landing: Arc::new(host),
            };
            crate::runtime::get().spawn(driver.run());
        }
        // Else the feed goes here: the consumer's channel ends after the last segment.
        loader
    }
}

/// What `method="direct"` does in a load to host memory, as `stats()["method_reason"]` says it.
const DIRECT: &str = "blocks not in the page cache are read around it (O_DIRECT) into pooled \
                      buffers, cached blocks copied out of it";

/// Segments read into host buffers.
struct Host {
    plan: Arc<Plan>,
    method: Method,
    /// `method="direct"`: blocks not in the page cache are read around it, until a source
    /// cannot be ([`Host::read_direct`]).
    direct: AtomicBool,
    feed: Arc<Feed>,
}

/// One segment being read into one host buffer.
struct SegmentJob {
    index: usize,
    buffer: Arc<HostBuffer>,
    remaining: AtomicUsize,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
}

impl Landing for Host {
    type Job = SegmentJob;
    type Hold = ();
    type Read = ();

    fn begin(
        &self,
        index: usize,
        budget: OwnedSemaphorePermit,
        blocks: usize,
    ) -> Result<Option<Arc<SegmentJob>>> {
        let seg = &self.plan.segments[index];
        let source = &self.plan.shards[seg.shard].source;
        // Sources that cannot be mapped (object stores) are read into pooled buffers.
        let mapped = match self.method {
            Method::Mmap => source.map(seg.start, seg.len as usize),
            _ => None,
        };
        // A direct read fills whole pages: the buffer sits in its allocation as the segment sits
        // in the file's pages.
        let lead = match self.method {
            Method::Direct => (seg.start % source::direct_align() as u64) as usize,
            _ => 0,
        };
        let buffer = mapped
            .unwrap_or_else(|| HostBuffer::alloc_at(lead, seg.len as usize))
            .map_err(|e| e.memory_for(|| self.plan.describe(index)))?;
        let cached = buffer.is_mapped() && !buffer.is_fresh();
        let job = SegmentJob {
            index,
            buffer: Arc::new(buffer),
            remaining: AtomicUsize::new(blocks),
            permit: Mutex::new(Some(budget)),
        };
        if cached {
            // Every page is in the page cache: nothing to read, no block tasks (in a warm load
            // they cost more than the rest of it). The file is checked now, as after a read,
            // and again at hand-out.
            source.check_unchanged()?;
            let stats = &self.feed.stats;
            stats.bytes_read.fetch_add(seg.len, Ordering::Relaxed);
            stats.bytes_cached.fetch_add(seg.len, Ordering::Relaxed);
        }
        if cached || blocks == 0 {
            self.publish(&job);
            return Ok(None);
        }
        Ok(Some(Arc::new(job)))
    }

    async fn hold(&self) -> Option<()> {
        Some(())
    }

    /// Fills `len` bytes at `off` of the buffer: faults a mapping's pages in (that is the read),
    /// or reads from the source into pooled memory.
    #[allow(unsafe_code)]
    async fn read(&self, job: &SegmentJob, off: u64, len: u64) -> Result<()> {
        let seg = &self.plan.segments[job.index];
        let shard = &self.plan.shards[seg.shard];
        let (o, l) = (off as usize, len as usize);
        if job.buffer.is_fresh() {
            // Faulting fresh pages in bulk is several times faster than one fault per page
            // while the read copies into them (and for a mapping it is the read itself).
            let (buffer, name) = (job.buffer.clone(), shard.name.clone());
            beside_reads(shard.source.as_ref(), move || buffer.populate(o, l, &name)).await?;
        }
        if job.buffer.is_mapped() {
            // The pages are the file's own: past the end of a file cut short meanwhile they read
            // as zeros, with no error. Checked before the segment can be handed out.
            shard.source.check_unchanged()?;
        }
        if !job.buffer.is_mapped() && !self.read_direct(job, off, len)? {
            // SAFETY: every block of this buffer goes to exactly one reader, and the buffer is
            // published only after the last reader finished.
            let dst = unsafe { job.buffer.slice_mut(o, l) };
            shard.source.read_into(seg.start + off, dst).await?;
        }
        self.feed.stats.bytes_read.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    fn landed(&self, job: Arc<SegmentJob>, _off: u64, _len: u64, read: Result<()>, _hold: ()) {
        match read {
            Err(e) => self.feed.fail(e),
            Ok(()) => {
                if job.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.publish(&job);
                }
            }
        }
    }
}

impl Host {
    /// `method="direct"`: reads the `len` bytes at `off` of the segment around the page cache
    /// into the allocation around its buffer ([`super::direct`]); `false` when they are to be
    /// read as `method="read"` reads them. Blocks are cut on whole pages of the file (block_size
    /// is), so the spans of two blocks never share a page; only a segment's first and last
    /// block reach past its bytes, into its buffer's lead and tail room.
    #[allow(unsafe_code)]
    fn read_direct(&self, job: &SegmentJob, off: u64, len: u64) -> Result<bool> {
        if !self.direct.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let seg = &self.plan.segments[job.index];
        let shard = &self.plan.shards[seg.shard];
        let direct = Direct {
            on: &self.direct,
            stats: &self.feed.stats,
        };
        if shard.source.grid().is_some() {
            // Cut on its encryption's segments, not on whole pages: two spans could share one.
            let why = "an encrypted file is read in whole segments and decrypted";
            direct.stop(&shard.name, why);
            return Ok(false);
        }
        let (start, _, span) = source::direct_span(seg.start + off, len);
        let page = source::direct_align() as u64;
        // SAFETY: this block's span: its own pages (see above), inside the allocation.
        let dst = unsafe {
            job.buffer
                .span_mut((start - seg.start / page * page) as usize, span)
        };
        direct.read(shard, seg.start + off, len, dst)
    }

    fn publish(&self, job: &SegmentJob) {
        job.buffer.mark_populated();
        let seg = &self.plan.segments[job.index];
        let permit = job
            .permit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("segment published twice");
        let loaded = Loaded {
            memory: Memory::Host(job.buffer.clone()),
            shard: seg.shard,
            tensors: seg.tensors.clone(),
        };
        self.feed.deliver(loaded, Some(permit));
    }
}

/// Hands the leading segments of `plan` whose pages are all in the page cache to the consumer, on
/// the calling thread; returns the index of the first segment it left to the [`Driver`] (one
/// with pages to read, or one that cannot be mapped: the driver maps it again and reports any
/// error). A warm load of local files is then a few system calls per segment: no runtime, no
/// task, no thread (on a process's first load, starting those cost more than the rest of it).
/// Each segment stays a mapping of its own, unmapped once its tensors are freed, so that a
/// consumer that drops tensors as it goes holds no more of the file than before.
///
/// Such segments take no share of the memory budget: their pages are the page cache's, mapped
/// lazily, not memory the loader allocated or reads into (nor a read the budget would pace).
/// The file is checked again when each segment is handed out ([`Loader::next_segment`]), as
/// for every mapped segment.
fn publish_cached(plan: &Plan, feed: &Feed) -> usize {
    for (index, seg) in plan.segments.iter().enumerate() {
        let source = &plan.shards[seg.shard].source;
        // `map` reopens the file and checks it is the one whose header was read.
        let buffer = match source.map(seg.start, seg.len as usize) {
            Some(Ok(buffer)) if buffer.is_mapped() && !buffer.is_fresh() => buffer,
            _ => return index,
        };
        feed.stats.bytes_read.fetch_add(seg.len, Ordering::Relaxed);
        feed.stats
            .bytes_cached
            .fetch_add(seg.len, Ordering::Relaxed);
        let loaded = Loaded {
            memory: Memory::Host(Arc::new(buffer)),
            shard: seg.shard,
            tensors: seg.tensors.clone(),
        };
        feed.deliver(loaded, None);
    }
    plan.segments.len()
}

/// What `method="auto"` does for a load into host memory, and why. Local files are mapped:
/// mapping page-cache pages costs no copy and no zeroing of fresh memory, and the benchmark
/// (benches/run.py) shows it ahead cold and warm. Everything else is read in blocks into pooled
/// buffers: objects cannot be mapped, and on network and FUSE filesystems a page fault is a small
/// synchronous round trip (see `source::fs`). Encrypted files are read too: their bytes are
/// decrypted, never mapped.
fn auto_method(plan: &Plan) -> (Method, String) {
    for shard in &plan.shards {
        if shard.source.grid().is_some() {
            return (
                Method::Read,
                format!(
                    "{} is encrypted: read in blocks of whole segments and decrypted (it \
                     cannot be mapped)",
                    shard.name
                ),
            );
        }
        let Some(path) = shard.source.local_path() else {
            return (
                Method::Read,
                format!(
                    "{} is not a local file: read into pooled buffers",
                    shard.name
                ),
            );
        };
        if let Some(fs) = source::fs::remote_filesystem(path) {
            return (
                Method::Read,
                format!(
                    "{} is on {fs}, where each page fault of a mapping is a round trip: read in \
                     blocks instead",
                    shard.name
                ),
            );
        }
    }
    (
        Method::Mmap,
        "local filesystem: mapped, no copy".to_string(),
    )
}
