//! The two threads of a staged load behind its reads: the copy thread asks the allocator for a
//! segment's destinations when its first block arrives and enqueues one copy per tensor piece a
//! block holds, then a fence, on the load's lanes in turn (block k on lane k mod their number;
//! each lane is ordered after the consumer's stream, since any may copy a segment's blocks); the
//! completion thread waits for the fences in order, each on the lane that recorded it, returns
//! each staging buffer to the ring and hands a segment out after its last block.
//!
//! Lent blocks (`method="mmap"`: a file's pages page-locked in place) are given back by release
//! threads beside the completion thread: unregistering pages is the driver's work, per page, and
//! on the completion thread it would hold up every later fence. A block's ring slot goes with it,
//! so the pages lent at once stay within the ring's bound; the last segment is handed out only
//! after every release is done, so a finished load holds no lent pages.

use std::sync::atomic::Ordering;
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use tokio::sync::OwnedSemaphorePermit;

use super::{Block, Shared};
use crate::device::{Allocator, Destination, Fence, Staging};
use crate::error::{Error, Result};
use crate::pipeline::{add_since, Loaded, Memory};
use crate::plan;

/// Starts the copy and completion threads of a load; returns the copy thread's channel (they end
/// once it is closed and the blocks in it are through).
pub(super) fn spawn(
    shared: &Arc<Shared>,
    allocator: Box<dyn Allocator>,
) -> std_mpsc::Sender<Block> {
    let (copy_tx, copy_rx) = std_mpsc::channel::<Block>();
    let (done_tx, done_rx) = std_mpsc::channel::<Copied>();
    {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("fastload-copy".into())
            .spawn(move || copier(&shared, allocator, copy_rx, done_tx))
            .expect("spawning the copy thread");
    }
    {
        let shared = shared.clone();
        std::thread::Builder::new()
            .name("fastload-copy-done".into())
            .spawn(move || completer(&shared, done_rx, Releases::start(&shared)))
            .expect("spawning the copy completion thread");
    }
    copy_tx
}

/// A block whose copies were enqueued on lane `lane`, the fence after them, and the error that
/// stopped them.
struct Copied {
    lane: usize,
    fence: Fence,
    block: Block,
    failed: Option<Error>,
}

/// Threads that give lent blocks back (and their ring slots with them).
struct Releases {
    tx: Option<std_mpsc::Sender<(Staging, Option<OwnedSemaphorePermit>)>>,
    threads: Vec<JoinHandle<()>>,
}

/// Release threads per load: unregistering may run in parallel in the driver.
const RELEASE_THREADS: usize = 2;

impl Releases {
    /// Threads for a load that lends; none for one that reads into the ring.
    fn start(shared: &Arc<Shared>) -> Releases {
        if !shared.lending.load(Ordering::Relaxed) {
            return Releases {
                tx: None,
                threads: Vec::new(),
            };
        }
        let (tx, rx) = std_mpsc::channel::<(Staging, Option<OwnedSemaphorePermit>)>();
        let rx = Arc::new(Mutex::new(rx));
        let threads = (0..RELEASE_THREADS)
            .map(|_| {
                let (shared, rx) = (shared.clone(), rx.clone());
                std::thread::Builder::new()
                    .name("fastload-release".into())
                    .spawn(move || {
                        // The engine's context, for the driver calls of the release.
                        let entered = shared.engine().enter();
                        loop {
                            let next = rx.lock().unwrap_or_else(|e| e.into_inner()).recv();
                            let Ok((staging, slot)) = next else { break };
                            if entered.is_err() {
                                std::mem::forget(staging); // cannot be given back here
                            } else {
                                let releasing = Instant::now();
                                drop(staging);
                                add_since(&shared.feed.stats.unlend_ns, releasing);
                            }
                            drop(slot);
                        }
                    })
                    .expect("spawning a release thread")
            })
            .collect();
        Releases {
            tx: Some(tx),
            threads,
        }
    }

    /// Gives `staging` back on a release thread (here, where there is none).
    fn send(&self, staging: Staging, slot: Option<OwnedSemaphorePermit>) {
        match &self.tx {
            Some(tx) => {
                let _ = tx.send((staging, slot));
            }
            None => drop((staging, slot)),
        }
    }

    /// Waits until every block sent was given back.
    fn finish(&mut self) {
        self.tx = None;
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for Releases {
    fn drop(&mut self) {
        self.finish();
    }
}

/// The copy thread: destinations on a segment's first block, then one copy per tensor piece, on
/// the lanes in turn.
fn copier(
    shared: &Shared,
    mut allocator: Box<dyn Allocator>,
    rx: std_mpsc::Receiver<Block>,
    done: std_mpsc::Sender<Copied>,
) {
    if let Err(e) = shared.engine().enter() {
        shared.feed.fail(e);
        return;
    }
    let stats = &shared.feed.stats;
    let mut turn = 0usize;
    loop {
        let idle = Instant::now();
        let Ok(block) = rx.recv() else {
            break;
        };
        add_since(&stats.copy_idle_ns, idle);
        if shared.feed.cancelled() {
            continue;
        }
        let lane = turn % shared.lanes.len();
        turn = turn.wrapping_add(1);
        let copied = copy_block(shared, allocator.as_mut(), &block, lane);
        // A fence even after a failed copy: pieces already enqueued may still be reading the
        // staging buffer, which must not be reused before they finished.
        match shared.lanes[lane].record() {
            Ok(fence) => {
                let _ = done.send(Copied {
                    lane,
                    fence,
                    block,
                    failed: copied.err(),
                });
            }
            Err(e) => {
                // Cannot tell when the engine is done with this buffer: never reuse it.
                if let Some(staging) = block.staging {
                    std::mem::forget(staging);
                }
                shared.feed.fail(copied.err().unwrap_or(e));
            }
        }
    }
}

fn copy_block(
    shared: &Shared,
    allocator: &mut dyn Allocator,
    block: &Block,
    lane: usize,
) -> Result<()> {
    let seg = &shared.plan.segments[block.job.index];
    let mut guard = block
        .job
        .destinations
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if guard.is_none() {
        let allocating = Instant::now();
        let allocation = allocator.allocate(&seg.tensors);
        add_since(&shared.feed.stats.alloc_ns, allocating);
        let allocation = allocation?;
        if allocation.destinations.len() != seg.tensors.len() {
            return Err(Error::device(format!(
                "the allocator returned {} destinations for {} tensors",
                allocation.destinations.len(),
                seg.tensors.len()
            )));
        }
        if let Some(stream) = allocation.stream {
            // Any lane may copy the segment's later blocks.
            for lane in &shared.lanes {
                lane.order_after(stream)?;
            }
        }
        *guard = Some(allocation.destinations);
    }
    let destinations = guard.as_ref().expect("set above");
    let Some(staging) = &block.staging else {
        return Ok(());
    };
    let (lo, hi) = (block.off, block.off + block.len);
    let copying = Instant::now();
    let copied = copy_pieces(shared, lane, seg, destinations, staging, lo, hi);
    add_since(&shared.feed.stats.copy_ns, copying);
    copied
}

/// Enqueues the copies of the tensor pieces in `[lo, hi)` of a segment, read into `staging`.
fn copy_pieces(
    shared: &Shared,
    lane: usize,
    seg: &plan::Segment,
    destinations: &[Destination],
    staging: &Staging,
    lo: u64,
    hi: u64,
) -> Result<()> {
    // Tensors of a segment are contiguous and in order: find the first one this block touches.
    let first = seg.tensors.partition_point(|t| t.offset + t.len <= lo);
    for (t, d) in seg.tensors[first..].iter().zip(&destinations[first..]) {
        if t.offset >= hi {
            break;
        }
        let a = t.offset.max(lo);
        let b = (t.offset + t.len).min(hi);
        if b <= a {
            continue;
        }
        // SAFETY: `a - lo .. b - lo` lies inside the bytes read into `staging`, which the
        // completion thread keeps until the fence after these copies passed; the destination
        // range lies inside the tensor's destination, written by this block only.
        #[allow(unsafe_code)]
        unsafe {
            shared.lanes[lane].copy(
                d.addr + (a - t.offset),
                staging.as_ptr().add((a - lo) as usize),
                (b - a) as usize,
            )?;
        }
        shared
            .feed
            .stats
            .bytes_copied
            .fetch_add(b - a, Ordering::Relaxed);
    }
    Ok(())
}

/// The completion thread: fences in order; a segment is handed out after its last block.
fn completer(shared: &Shared, rx: std_mpsc::Receiver<Copied>, mut releases: Releases) {
    if let Err(e) = shared.engine().enter() {
        shared.feed.fail(e);
        // Without the engine, fences cannot be waited for: keep their buffers out of reuse.
        for Copied { block, .. } in rx {
            if let Some(staging) = block.staging {
                std::mem::forget(staging);
            }
        }
        return;
    }
    let mut delivered = 0;
    for Copied {
        lane,
        fence,
        block,
        failed,
    } in rx
    {
        let waiting = Instant::now();
        let waited = shared.lanes[lane].wait(fence);
        add_since(&shared.feed.stats.fence_wait_ns, waiting);
        let Block {
            job,
            staging,
            _slot,
            ..
        } = block;
        match (&waited, staging) {
            // The copies may still read the buffer: never reuse it (as the copier does when it
            // cannot record a fence).
            (Err(_), Some(staging)) => std::mem::forget(staging),
            (Ok(()), Some(staging)) if staging.lent_in().is_some() => releases.send(staging, _slot),
            (_, staging) => drop((staging, _slot)),
        }
        if let Some(e) = failed.or(waited.err()) {
            shared.feed.fail(e);
            continue;
        }
        if job.remaining.fetch_sub(1, Ordering::AcqRel) != 1 || shared.feed.cancelled() {
            continue;
        }
        let seg = &shared.plan.segments[job.index];
        let destinations = job
            .destinations
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default();
        let budget = job.budget.lock().unwrap_or_else(|e| e.into_inner()).take();
        let loaded = Loaded {
            memory: Memory::Placed(destinations),
            shard: seg.shard,
            tensors: seg.tensors.clone(),
        };
        delivered += 1;
        if delivered == shared.plan.segments.len() {
            releases.finish(); // a finished load holds no lent pages
        }
        shared.feed.deliver(loaded, budget);
    }
}
