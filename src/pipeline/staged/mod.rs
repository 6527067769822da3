//! Staged loads: storage → ring of staging buffers → copy engine → destination memory.
//!
//! Three stages run side by side, so reading block k+1.. overlaps copying block k:
//! - the load's [driver](super::driver), with this ring as its landing, walks the plan's segments
//!   in order; each first takes its share of the destination budget (`memory_limit`, see below),
//!   then each of its blocks takes a ring slot (see [`ring_slots`]: that is what bounds host
//!   memory whatever the model size) and a read permit (`concurrency`), then reads into a
//!   staging buffer;
//! - the copy thread takes blocks as their reads finish, asks the allocator for a segment's
//!   destinations when its first block arrives, enqueues one copy per tensor piece the block
//!   holds (a tensor larger than a block is copied in pieces) and records a fence, on the
//!   load's copy queues in turn (`copy_streams`: the engine and its [`Engine::lane`]s);
//! - the completion thread waits for fences in order, returns each staging buffer to the ring,
//!   and hands a segment's tensors to the consumer once its last block's fence passed.
//!
//! Destination memory (the GPU's) allocated for segments the consumer has not been handed stays
//! within `memory_limit` too, whatever the consumer's pace: without that bound a consumer slower
//! than the reads (per-tensor work, a distributed round) would pile the checkpoint up on the
//! device beside the parameters it is copied into. `memory_limit` rather than a device limit of
//! its own: it already means "bytes fastload holds for you that you have not received", one knob
//! is easier to size than two, and a GPU load's host side (the page-locked ring) and device side
//! are different memories, each held within it. The budget is taken by the driver, in plan order,
//! before a segment's first read, and given back when the consumer asks for the next segment:
//! the copy and completion threads never wait for it, so blocks that complete out of order can
//! never wait behind a segment that cannot start.

mod copy;
mod lend;
#[cfg(test)]
mod tests;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::direct::Direct;
use super::driver::{Budget, Driver, Landing};
use super::{add_since, Feed, Loader};
use crate::device::{Destination, Engine, Staging, Target};
use crate::error::Result;
use crate::options::{Method, Resolved};
use crate::plan::Plan;
use crate::source::Shard;

/// What a block's pages may span beyond its bytes (its start inside a page, and its end rounded
/// up to a whole page): a lent block's pages, a direct read's aligned span.
fn span_spare() -> u64 {
    2 * crate::memory::page_size() as u64
}

/// The block size of a staged load: [`Resolved::staged_block_size`], shrunk so the ring has at
/// least two slots of a block and `spare` bytes.
fn block_for(opts: &Resolved, spare: u64) -> u64 {
    let half = (opts.memory_limit / 2).saturating_sub(spare) / 4096 * 4096;
    opts.staged_block_size.min(half).max(4096)
}

/// Slots of the staging ring for buffers of `slot` bytes: one per read in flight (`concurrency`)
/// and as many again for blocks waiting for their copies, within `memory_limit` (at least two).
///
/// Not `memory_limit / slot`: a GPU's staging buffers are page-locked, which the first load of a
/// process pays for at a few GB/s (`cuMemHostAlloc`, one allocation at a time in the driver), and
/// a ring grows to whatever the reads got ahead of the copies. A 1 GiB ring (the default limit)
/// cost about 0.4 s on an H100 machine, more than the rest of a warm 2 GiB load, while copies
/// drain a buffer in a fraction of the time a read takes to fill one: more slots than reads in
/// flight only let reads run further ahead of a stalled copy thread. Device memory of segments
/// not yet handed over is bounded by its own budget, not by this ring.
fn ring_slots(memory_limit: u64, slot: u64, concurrency: usize) -> usize {
    let wanted = 2 * concurrency as u64;
    (memory_limit / slot)
        .min(wanted)
        .clamp(2, Semaphore::MAX_PERMITS as u64) as usize
}

struct Shared {
    plan: Arc<Plan>,
    /// The copy queues (`copy_streams`): the target's engine (the first, which also stages and
    /// lends: [`Shared::engine`]) and its further [`Engine::lane`]s; block k is copied on lane k
    /// mod their number.
    lanes: Vec<Arc<dyn Engine>>,
    feed: Arc<Feed>,
    pinning: Mutex<Pinning>,
    /// `method="mmap"`: blocks are the files' mapped pages lent to the engine
    /// ([`Engine::lend`]) rather than read into staging buffers, until a block cannot be.
    lending: AtomicBool,
    /// `method="direct"`: blocks not in the page cache are read around it ([`direct`]), until a
    /// source cannot be.
    direct: AtomicBool,
}

/// When this load was allocating page-locked staging memory: the intervals of the allocations
/// that had to pin (merged where they overlap, as reads waiting for the driver's lock do), so that
/// `pinned_ns` is wall-clock time the load spent pinning, not the waits added up.
#[derive(Default)]
struct Pinning {
    /// Disjoint, sorted by start.
    spans: Vec<(Instant, Instant)>,
}

impl Pinning {
    /// Adds `[start, end)`; returns the total length of the union so far.
    fn add(&mut self, start: Instant, end: Instant) -> Duration {
        let at = self.spans.partition_point(|s| s.0 < start);
        self.spans.insert(at, (start, end));
        let mut merged: Vec<(Instant, Instant)> = Vec::with_capacity(self.spans.len());
        for &(a, b) in &self.spans {
            match merged.last_mut() {
                Some(last) if a <= last.1 => last.1 = last.1.max(b),
                _ => merged.push((a, b)),
            }
        }
        self.spans = merged;
        self.spans.iter().map(|&(a, b)| b - a).sum()
    }
}

/// One segment in flight.
struct Job {
    index: usize,
    /// Blocks not yet through the completion thread.
    remaining: AtomicUsize,
    /// Set by the copy thread when the first block arrives.
    destinations: Mutex<Option<Vec<Destination>>>,
    /// The segment's share of the destination budget, handed to the consumer with it.
    budget: Mutex<Option<OwnedSemaphorePermit>>,
}

/// A block that was read: `len` bytes at `off` within its segment, in `staging`.
struct Block {
    job: Arc<Job>,
    off: u64,
    len: u64,
    staging: Option<Staging>,
    _slot: Option<OwnedSemaphorePermit>,
}

/// What `method="direct"` does in a staged load, as `stats()["method_reason"]` says it.
const DIRECT: &str = "blocks not in the page cache are read around it (O_DIRECT) into page-locked \
                      staging buffers, cached blocks copied out of it";

/// What `method="mmap"` does in a staged load, as `stats()["method_reason"]` says it.
const LENDING: &str = "the device copies the files' mapped pages where they are, page-locked in \
                       place (no copy out of the page cache)";

pub(super) fn start(plan: Plan, opts: Resolved, target: Target) -> Result<Loader> {
    let Target { engine, allocator } = target;
    let mut lanes = vec![engine.clone()];
    for _ in 1..opts.copy_streams {
        lanes.push(engine.lane()?);
    }
    let lending = opts.method == Method::Mmap;
    let direct = opts.method == Method::Direct;
    let spare = if lending || direct { span_spare() } else { 0 };
    let block = block_for(&opts, spare);
    // A direct read's buffer takes the aligned span around its block.
    let buffer = block + if direct { spare } else { 0 };
    // The ring counts what a staging buffer really takes, so the limit holds for any block size;
    // a lent block's pages span more than its bytes.
    let slot = (engine.staging_size(buffer as usize) as u64).max(block + spare);
    let slots = ring_slots(opts.memory_limit, slot, opts.concurrency);
    engine.keep_staging(slots as u64 * slot);
    crate::memory::set_pool_limit(opts.memory_limit);
    let ring = Ring {
        semaphore: Arc::new(Semaphore::new(slots)),
        slots,
        block,
        buffer,
    };
    let budget = Budget::new(opts.memory_limit);
    let target_name = engine.name();
    // What runs: staging buffers read whole blocks of `block` bytes, or the blocks' pages lent.
    let (method, method_reason) = if lending {
        (Method::Mmap, format!("{}: {LENDING}", opts.method_reason))
    } else if direct {
        (Method::Direct, format!("{}: {DIRECT}", opts.method_reason))
    } else {
        let why = "staged loads read into page-locked staging buffers";
        (Method::Read, why.to_string())
    };
    let config = Resolved {
        method,
        method_reason,
        block_size: block,
        ..opts
    };
    let concurrency = config.concurrency;
    let budgets = vec![ring.semaphore.clone(), budget.semaphore()];
    let (loader, feed) = Loader::new(plan, budgets, config, Some(target_name));
    let shared = Arc::new(Shared {
        plan: loader.plan.clone(),
        lanes,
        feed: feed.clone(),
        pinning: Mutex::new(Pinning::default()),
        lending: AtomicBool::new(lending),
        direct: AtomicBool::new(direct),
    });
    let copy_tx = copy::spawn(&shared, allocator);
    let driver = Driver {
        plan: loader.plan.clone(),
        from: 0,
        block,
        concurrency,
        budget,
        feed,
        landing: Arc::new(Staged {
            shared,
            ring,
            copy_tx,
        }),
    };
    crate::runtime::get().spawn(driver.run());
    Ok(loader)
}

/// The staging ring: `slots` buffers for blocks of `block` bytes, each `buffer` bytes (a direct
/// read's buffer takes the aligned span around its block).
struct Ring {
    semaphore: Arc<Semaphore>,
    slots: usize,
    block: u64,
    buffer: u64,
}

/// The driver's landing in a staged load: blocks are read into staging buffers of the ring and
/// sent to the copy thread. Held by the driver and its reads only: once they all ended, the copy
/// thread's channel closes and the copy threads end.
struct Staged {
    shared: Arc<Shared>,
    ring: Ring,
    copy_tx: std_mpsc::Sender<Block>,
}

impl Landing for Staged {
    type Job = Job;
    type Hold = OwnedSemaphorePermit;
    type Read = Staging;

    fn begin(
        &self,
        index: usize,
        budget: OwnedSemaphorePermit,
        blocks: usize,
    ) -> Result<Option<Arc<Job>>> {
        let job = Arc::new(Job {
            index,
            remaining: AtomicUsize::new(blocks.max(1)),
            destinations: Mutex::new(None),
            budget: Mutex::new(Some(budget)),
        });
        if blocks == 0 {
            // Only empty tensors: they still need destinations, and are published in order.
            let _ = self.copy_tx.send(Block {
                job,
                off: 0,
                len: 0,
                staging: None,
                _slot: None,
            });
            return Ok(None);
        }
        Ok(Some(job))
    }

    /// A slot of the ring.
    async fn hold(&self) -> Option<OwnedSemaphorePermit> {
        let waiting = Instant::now();
        let slot = self.ring.semaphore.clone().acquire_owned().await.ok()?;
        let stats = &self.shared.feed.stats;
        add_since(&stats.ring_wait_ns, waiting);
        let held = (self.ring.slots - self.ring.semaphore.available_permits()) as u64;
        stats
            .staging_peak
            .fetch_max(held * self.ring.block, Ordering::Relaxed);
        Some(slot)
    }

    /// Reads one block into a staging buffer from the engine (or lends the engine its pages).
    async fn read(&self, job: &Job, off: u64, len: u64) -> Result<Staging> {
        let shared = &self.shared;
        let seg = &shared.plan.segments[job.index];
        let shard = &shared.plan.shards[seg.shard];
        if shared.lending.load(Ordering::Relaxed) {
            if let Some(lent) = lend::block(shared, shard, seg.start + off, len).await? {
                return Ok(lent);
            }
        }
        // Page-locking new memory can take long: off the runtime's workers.
        let (engine, block) = (shared.engine().clone(), self.ring.buffer as usize);
        let waiting = Instant::now();
        let mut staging =
            super::beside_reads(shard.source.as_ref(), move || engine.staging(block)).await?;
        add_since(&shared.feed.stats.staging_wait_ns, waiting);
        if let Some(took) = staging.pinned_in() {
            shared.pinned(took, staging.len());
        }
        if shared.read_direct(shard, seg.start + off, len, &mut staging)? {
            return Ok(staging);
        }
        let reading = Instant::now();
        shard
            .source
            .read_into(seg.start + off, staging.slice_mut(len as usize))
            .await?;
        add_since(&shared.feed.stats.read_ns, reading);
        Ok(staging)
    }

    fn landed(
        &self,
        job: Arc<Job>,
        off: u64,
        len: u64,
        read: Result<Staging>,
        slot: OwnedSemaphorePermit,
    ) {
        let feed = &self.shared.feed;
        match read {
            Ok(staging) => {
                feed.stats.bytes_read.fetch_add(len, Ordering::Relaxed);
                let _ = self.copy_tx.send(Block {
                    job,
                    off,
                    len,
                    staging: Some(staging),
                    _slot: Some(slot),
                });
            }
            Err(e) => feed.fail(e),
        }
    }
}

impl Shared {
    /// The target's engine: it stages and lends, and is the first copy lane.
    fn engine(&self) -> &Arc<dyn Engine> {
        &self.lanes[0]
    }

    /// `method="direct"`: reads the `len` bytes at `at` of `shard` around the page cache into
    /// `staging` ([`super::direct`]), which then starts where they do; `false` when they are to
    /// be read as `method="read"` reads them.
    fn read_direct(&self, shard: &Shard, at: u64, len: u64, staging: &mut Staging) -> Result<bool> {
        let direct = Direct {
            on: &self.direct,
            stats: &self.feed.stats,
        };
        if !self.direct.load(Ordering::Relaxed) {
            return Ok(false);
        }
        let (_, lead, span) = crate::source::direct_span(at, len);
        let aligned = staging.as_ptr() as usize % crate::source::direct_align() == 0;
        if !aligned || span > staging.len() {
            let why = format!(
                "its staging buffer ({} bytes at {:p}) cannot take the aligned span of {span} \
                 bytes",
                staging.len(),
                staging.as_ptr()
            );
            direct.stop(&shard.name, &why);
            return Ok(false);
        }
        let read = direct.read(shard, at, len, staging.slice_mut(span))?;
        if read {
            staging.start_at(lead);
        }
        Ok(read)
    }

    /// Counts a staging buffer of `len` bytes that took `took` to page-lock, just now.
    fn pinned(&self, took: Duration, len: usize) {
        let end = Instant::now();
        let total = self
            .pinning
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(end - took, end);
        let stats = &self.feed.stats;
        stats.pinned_bytes.fetch_add(len as u64, Ordering::Relaxed);
        stats
            .pinned_ns
            .fetch_max(total.as_nanos() as u64, Ordering::Relaxed);
    }
}
