//! Staged loads: storage → ring of staging buffers → copy engine → destination memory.
//!
//! Three stages run side by side, so reading block k+1.. overlaps copying block k:
//! - the driver (a task on the runtime) walks the plan's segments in order; each first takes its
//!   share of the destination budget (`memory_limit`, see below), then each of its blocks takes a
//!   ring slot (the ring has `memory_limit / block` slots, which is what bounds host memory
//!   whatever the model size) and a read permit (`concurrency`), then reads into a staging buffer;
//! - the copy thread takes blocks as their reads finish, asks the allocator for a segment's
//!   destinations when its first block arrives, enqueues one copy per tensor piece the block
//!   holds (a tensor larger than a block is copied in pieces) and records a fence;
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

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc as std_mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::{add_since, Feed, Loaded, Loader, Memory};
use crate::device::{Allocator, Destination, Engine, Fence, Staging, Target};
use crate::error::{Error, Result};
use crate::options::{Method, Resolved};
use crate::plan::{self, Plan};
use crate::source;

/// The block size of a staged load: [`Resolved::staged_block_size`], shrunk so the ring has at
/// least two slots.
fn block_for(opts: &Resolved) -> u64 {
    let half = (opts.memory_limit / 2) / 4096 * 4096;
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
    engine: Arc<dyn Engine>,
    feed: Arc<Feed>,
    pinning: Mutex<Pinning>,
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

pub(super) fn start(plan: Plan, opts: Resolved, target: Target) -> Loader {
    let Target { engine, allocator } = target;
    let block = block_for(&opts);
    // The ring counts what a staging buffer really takes, so the limit holds for any block size.
    let slot = (engine.staging_size(block as usize) as u64).max(block);
    let slots = ring_slots(opts.memory_limit, slot, opts.concurrency);
    engine.keep_staging(slots as u64 * slot);
    crate::memory::set_pool_limit(opts.memory_limit);
    let ring = Arc::new(Semaphore::new(slots));
    let budget_kib = super::kib(opts.memory_limit).min(Semaphore::MAX_PERMITS as u32);
    let budget = Budget {
        semaphore: Arc::new(Semaphore::new(budget_kib as usize)),
        kib: budget_kib,
    };
    let target_name = engine.name();
    // What runs: staging buffers read whole blocks of `block` bytes.
    let config = Resolved {
        method: Method::Read,
        method_reason: "staged loads read into page-locked staging buffers".into(),
        block_size: block,
        ..opts
    };
    let concurrency = config.concurrency;
    let budgets = vec![ring.clone(), budget.semaphore.clone()];
    let (loader, feed) = Loader::new(plan, budgets, config, Some(target_name));
    let shared = Arc::new(Shared {
        plan: loader.plan.clone(),
        engine,
        feed,
        pinning: Mutex::new(Pinning::default()),
    });
    let (copy_tx, copy_rx) = std_mpsc::channel::<Block>();
    let (done_tx, done_rx) = std_mpsc::channel::<(Fence, Block, Option<Error>)>();
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
            .spawn(move || completer(&shared, done_rx))
            .expect("spawning the copy completion thread");
    }
    let ring = Ring {
        semaphore: ring,
        slots,
        block,
    };
    crate::runtime::get().spawn(drive(shared, budget, ring, concurrency, copy_tx));
    loader
}

/// Destination memory of segments not yet handed to the consumer, in KiB.
struct Budget {
    semaphore: Arc<Semaphore>,
    kib: u32,
}

/// The staging ring: `slots` buffers of `block` bytes.
struct Ring {
    semaphore: Arc<Semaphore>,
    slots: usize,
    block: u64,
}

async fn drive(
    shared: Arc<Shared>,
    budget: Budget,
    ring: Ring,
    concurrency: usize,
    copy_tx: std_mpsc::Sender<Block>,
) {
    let Ring {
        semaphore: ring,
        slots,
        block,
    } = ring;
    let reads = Arc::new(Semaphore::new(concurrency));
    let plan = shared.plan.clone();
    for (index, seg) in plan.segments.iter().enumerate() {
        // A segment larger than the whole budget waits until it has the budget to itself.
        let need = super::kib(seg.len).clamp(1, budget.kib);
        let Ok(permit) = budget.semaphore.clone().acquire_many_owned(need).await else {
            return;
        };
        if shared.feed.cancelled() {
            return;
        }
        let grid = super::grid(&plan, seg);
        let blocks: Vec<(u64, u64)> = plan::blocks_on(seg.start, seg.len, block, grid).collect();
        let job = Arc::new(Job {
            index,
            remaining: AtomicUsize::new(blocks.len().max(1)),
            destinations: Mutex::new(None),
            budget: Mutex::new(Some(permit)),
        });
        if blocks.is_empty() {
            // Only empty tensors: they still need destinations, and are published in order.
            let _ = copy_tx.send(Block {
                job,
                off: 0,
                len: 0,
                staging: None,
                _slot: None,
            });
            continue;
        }
        for (off, len) in blocks {
            let waiting = Instant::now();
            let Ok(slot) = ring.clone().acquire_owned().await else {
                return;
            };
            add_since(&shared.feed.stats.ring_wait_ns, waiting);
            let held = (slots - ring.available_permits()) as u64 * block;
            shared
                .feed
                .stats
                .staging_peak
                .fetch_max(held, Ordering::Relaxed);
            let Ok(read) = reads.clone().acquire_owned().await else {
                return;
            };
            if shared.feed.cancelled() {
                return;
            }
            let (shared, job, copy_tx) = (shared.clone(), job.clone(), copy_tx.clone());
            let task = async move {
                if shared.feed.cancelled() {
                    return;
                }
                // Cancelled midway: the request is dropped, the staging buffer goes back.
                let staging = tokio::select! {
                    staging = read_block(&shared, job.index, off, len, block) => staging,
                    () = shared.feed.cancel.triggered() => return,
                };
                drop(read);
                match staging {
                    Ok(staging) => {
                        shared
                            .feed
                            .stats
                            .bytes_read
                            .fetch_add(len, Ordering::Relaxed);
                        let _ = copy_tx.send(Block {
                            job,
                            off,
                            len,
                            staging: Some(staging),
                            _slot: Some(slot),
                        });
                    }
                    Err(e) => shared.feed.fail(e),
                }
            };
            source::spawn_read(plan.shards[seg.shard].source.as_ref(), task);
        }
    }
}

/// Reads one block into a staging buffer from the engine.
async fn read_block(
    shared: &Arc<Shared>,
    index: usize,
    off: u64,
    len: u64,
    block: u64,
) -> Result<Staging> {
    let seg = &shared.plan.segments[index];
    let shard = &shared.plan.shards[seg.shard];
    // Page-locking new memory can take long: off the runtime's workers.
    let engine = shared.engine.clone();
    let waiting = Instant::now();
    let mut staging = super::beside_reads(shard.source.as_ref(), move || {
        engine.staging(block as usize)
    })
    .await?;
    add_since(&shared.feed.stats.staging_wait_ns, waiting);
    if let Some(took) = staging.pinned_in() {
        let end = Instant::now();
        let total = shared
            .pinning
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .add(end - took, end);
        let stats = &shared.feed.stats;
        stats
            .pinned_bytes
            .fetch_add(staging.len() as u64, Ordering::Relaxed);
        stats
            .pinned_ns
            .fetch_max(total.as_nanos() as u64, Ordering::Relaxed);
    }
    let reading = Instant::now();
    shard
        .source
        .read_into(seg.start + off, staging.slice_mut(len as usize))
        .await?;
    add_since(&shared.feed.stats.read_ns, reading);
    Ok(staging)
}

/// The copy thread: destinations on a segment's first block, then one copy per tensor piece.
fn copier(
    shared: &Shared,
    mut allocator: Box<dyn Allocator>,
    rx: std_mpsc::Receiver<Block>,
    done: std_mpsc::Sender<(Fence, Block, Option<Error>)>,
) {
    if let Err(e) = shared.engine.enter() {
        shared.feed.fail(e);
        return;
    }
    let stats = &shared.feed.stats;
    loop {
        let idle = Instant::now();
        let Ok(block) = rx.recv() else {
            break;
        };
        add_since(&stats.copy_idle_ns, idle);
        if shared.feed.cancelled() {
            continue;
        }
        let copied = copy_block(shared, allocator.as_mut(), &block);
        // A fence even after a failed copy: pieces already enqueued may still be reading the
        // staging buffer, which must not be reused before they finished.
        match shared.engine.record() {
            Ok(fence) => {
                let _ = done.send((fence, block, copied.err()));
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

fn copy_block(shared: &Shared, allocator: &mut dyn Allocator, block: &Block) -> Result<()> {
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
            shared.engine.order_after(stream)?;
        }
        *guard = Some(allocation.destinations);
    }
    let destinations = guard.as_ref().expect("set above");
    let Some(staging) = &block.staging else {
        return Ok(());
    };
    let (lo, hi) = (block.off, block.off + block.len);
    let copying = Instant::now();
    let copied = copy_pieces(shared, seg, destinations, staging, lo, hi);
    add_since(&shared.feed.stats.copy_ns, copying);
    copied
}

/// Enqueues the copies of the tensor pieces in `[lo, hi)` of a segment, read into `staging`.
fn copy_pieces(
    shared: &Shared,
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
            shared.engine.copy(
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
fn completer(shared: &Shared, rx: std_mpsc::Receiver<(Fence, Block, Option<Error>)>) {
    if let Err(e) = shared.engine.enter() {
        shared.feed.fail(e);
        // Without the engine, fences cannot be waited for: keep their buffers out of reuse.
        for (_, block, _) in rx {
            if let Some(staging) = block.staging {
                std::mem::forget(staging);
            }
        }
        return;
    }
    for (fence, block, failed) in rx {
        let waiting = Instant::now();
        let waited = shared.engine.wait(fence);
        add_since(&shared.feed.stats.fence_wait_ns, waiting);
        let Block { job, staging, .. } = block; // drops the ring slot
        match (&waited, staging) {
            // The copies may still read the buffer: never reuse it (as the copier does when it
            // cannot record a fence).
            (Err(_), Some(staging)) => std::mem::forget(staging),
            (_, staging) => drop(staging),
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
        shared.feed.deliver(loaded, budget);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::{host_bytes, Allocation, HostAllocator, HostEngine};
    use crate::options::LoadOptions;
    use crate::plan::TensorSlot;
    use std::io::Write;
    use std::sync::atomic::AtomicU64;

    /// A checkpoint of `sizes` U8 tensors whose bytes are a function of their position.
    fn checkpoint(sizes: &[usize]) -> (tempfile::NamedTempFile, Vec<u8>) {
        let mut header = serde_json::Map::new();
        let mut at = 0usize;
        for (i, &n) in sizes.iter().enumerate() {
            header.insert(
                format!("t{i:03}"),
                serde_json::json!({"dtype": "U8", "shape": [n], "data_offsets": [at, at + n]}),
            );
            at += n;
        }
        let json = serde_json::to_vec(&header).unwrap();
        let data: Vec<u8> = (0..at).map(|i| (i * 7 % 251) as u8).collect();
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(&(json.len() as u64).to_le_bytes()).unwrap();
        f.write_all(&json).unwrap();
        f.write_all(&data).unwrap();
        (f, data)
    }

    type Named = Vec<(String, Vec<u8>)>;

    /// A staged load of `file` through `engine`, into memory from `allocator`.
    fn open(
        file: &tempfile::NamedTempFile,
        opts: &LoadOptions,
        engine: Arc<dyn Engine>,
        allocator: Box<dyn Allocator>,
    ) -> Loader {
        let uris = vec![file.path().to_string_lossy().into_owned()];
        super::super::open_staged(&uris, opts, Target { engine, allocator }).expect("open")
    }

    /// A staged load of `file` into host memory from `allocator`.
    fn open_host(
        file: &tempfile::NamedTempFile,
        opts: &LoadOptions,
        allocator: Box<dyn Allocator>,
    ) -> Loader {
        open(file, opts, Arc::new(HostEngine::new()), allocator)
    }

    fn run(
        sizes: &[usize],
        opts: LoadOptions,
        engine: Arc<dyn Engine>,
        allocator: Box<dyn Allocator>,
    ) -> (Named, Vec<u8>, Loader) {
        let (file, data) = checkpoint(sizes);
        let mut loader = open(&file, &opts, engine, allocator);
        let mut out = Vec::new();
        while let Some(seg) = loader.next_segment() {
            let seg = seg.expect("segment");
            let Memory::Placed(dest) = seg.memory else {
                panic!("staged load returned host memory");
            };
            for (t, d) in seg.tensors.iter().zip(&dest) {
                out.push((t.name.clone(), host_bytes(d).unwrap().to_vec()));
            }
        }
        out.sort();
        (out, data, loader)
    }

    fn expected(sizes: &[usize], data: &[u8]) -> Named {
        let mut at = 0;
        sizes
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                at += n;
                (format!("t{i:03}"), data[at - n..at].to_vec())
            })
            .collect()
    }

    fn opts(block: u64, limit: u64) -> LoadOptions {
        LoadOptions {
            block_size: Some(block),
            memory_limit: Some(limit),
            concurrency: Some(4),
            ..Default::default()
        }
    }

    #[test]
    fn copies_every_tensor_bitwise_with_pieces_and_empties() {
        // Tensors smaller than, equal to and many times a block; empty ones in between.
        let sizes = [3, 0, 4096, 70_000, 0, 1, 1 << 20, 5000, 12_345, 0];
        let (got, data, loader) = run(
            &sizes,
            opts(16 << 10, 1 << 20),
            Arc::new(HostEngine::new()),
            Box::new(HostAllocator),
        );
        assert_eq!(got, expected(&sizes, &data));
        let total: u64 = sizes.iter().map(|&n| n as u64).sum();
        assert_eq!(loader.stats().bytes_copied.load(Ordering::Relaxed), total);
        assert_eq!(loader.engine(), Some("host"));
    }

    /// A host engine whose copies are slow, so that reads run ahead of them.
    struct SlowEngine {
        inner: HostEngine,
        in_flight: AtomicUsize,
        max_in_flight: AtomicUsize,
    }

    impl Engine for SlowEngine {
        fn name(&self) -> String {
            "slow".into()
        }
        fn staging(&self, len: usize) -> Result<Staging> {
            self.inner.staging(len)
        }
        #[allow(unsafe_code)]
        unsafe fn copy(&self, dst: u64, src: *const u8, len: usize) -> Result<()> {
            self.inner.copy(dst, src, len)
        }
        fn record(&self) -> Result<Fence> {
            let n = self.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
            self.max_in_flight.fetch_max(n, Ordering::SeqCst);
            self.inner.record()
        }
        fn wait(&self, fence: Fence) -> Result<()> {
            std::thread::sleep(std::time::Duration::from_millis(2));
            self.in_flight.fetch_sub(1, Ordering::SeqCst);
            self.inner.wait(fence)
        }
    }

    #[test]
    fn reads_run_ahead_of_copies_within_the_ring() {
        let engine = Arc::new(SlowEngine {
            inner: HostEngine::new(),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let sizes = [3 << 20, 100, 2 << 20];
        let (block, limit) = (128u64 << 10, 1u64 << 20);
        let (got, data, loader) = run(
            &sizes,
            opts(block, limit),
            engine.clone(),
            Box::new(HostAllocator),
        );
        assert_eq!(got, expected(&sizes, &data));
        // Host memory: never more than the ring, whatever the tensor sizes (5 MiB here).
        let peak = loader.stats().staging_peak.load(Ordering::Relaxed);
        assert!(peak <= limit, "staging peak {peak} over the {limit} limit");
        // Overlap: several blocks were waiting on copies while later ones were read.
        let most = engine.max_in_flight.load(Ordering::SeqCst);
        assert!(
            most >= 2,
            "copies never overlapped reads (max in flight {most})"
        );
        assert!(most as u64 <= limit / block);
    }

    #[test]
    fn the_ring_is_sized_by_concurrency_not_by_the_memory_limit() {
        // A copy thread held up by a slow first allocation while 2 reads at a time run ahead:
        // the ring holds 2 x 2 blocks, whatever the limit lets it (64 MiB: 1024 blocks here).
        struct SlowFirst(bool);
        impl Allocator for SlowFirst {
            fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
                if !std::mem::replace(&mut self.0, true) {
                    std::thread::sleep(std::time::Duration::from_millis(300));
                }
                HostAllocator.allocate(tensors)
            }
        }
        let sizes = [256usize << 10; 16];
        let block = 64u64 << 10;
        let o = LoadOptions {
            block_size: Some(block),
            memory_limit: Some(64 << 20),
            concurrency: Some(2),
            ..Default::default()
        };
        let (got, data, loader) = run(
            &sizes,
            o,
            Arc::new(HostEngine::new()),
            Box::new(SlowFirst(false)),
        );
        assert_eq!(got, expected(&sizes, &data));
        let peak = loader.stats().staging_peak.load(Ordering::Relaxed);
        assert!(
            peak <= 4 * block,
            "staging peak {peak} over 2 x concurrency blocks"
        );
        assert_eq!(ring_slots(64 << 20, block, 2), 4);
        assert_eq!(ring_slots(1 << 20, 512 << 10, 16), 2);
        assert_eq!(ring_slots(1 << 30, 8 << 20, 16), 32);
    }

    #[test]
    fn phases_say_where_the_time_went() {
        // An allocator that takes 50 ms per segment and a copy engine whose every fence wait
        // takes 2 ms: the load's phases count at least that much in each (and the consumer,
        // which waits for every segment, waited too).
        struct Slow;
        impl Allocator for Slow {
            fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
                std::thread::sleep(Duration::from_millis(50));
                HostAllocator.allocate(tensors)
            }
        }
        let engine = Arc::new(SlowEngine {
            inner: HostEngine::new(),
            in_flight: AtomicUsize::new(0),
            max_in_flight: AtomicUsize::new(0),
        });
        let sizes = [1usize << 20, 1 << 20];
        let (got, data, loader) = run(&sizes, opts(256 << 10, 4 << 20), engine, Box::new(Slow));
        assert_eq!(got, expected(&sizes, &data));
        let stats = loader.stats();
        let ms = |c: &AtomicU64| c.load(Ordering::Relaxed) / 1_000_000;
        assert!(ms(&stats.alloc_ns) >= 50, "alloc {}", ms(&stats.alloc_ns));
        // Eight blocks, each waited for at least 2 ms.
        assert!(
            ms(&stats.fence_wait_ns) >= 16,
            "fence {}",
            ms(&stats.fence_wait_ns)
        );
        assert!(ms(&stats.consumer_wait_ns) >= 50);
        assert!(stats.read_ns.load(Ordering::Relaxed) > 0);
        assert!(stats.staging_wait_ns.load(Ordering::Relaxed) > 0);
        assert!(stats.copy_idle_ns.load(Ordering::Relaxed) > 0);
        assert!(stats.copy_ns.load(Ordering::Relaxed) > 0);
    }

    struct FailingAllocator {
        after: usize,
    }

    impl Allocator for FailingAllocator {
        fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
            if self.after == 0 {
                return Err(Error::device("out of device memory (test)"));
            }
            self.after -= 1;
            HostAllocator.allocate(tensors)
        }
    }

    #[test]
    fn allocator_failure_ends_the_load_with_its_error() {
        let (file, _) = checkpoint(&[1 << 20, 1 << 20, 1 << 20]);
        let mut loader = open_host(
            &file,
            &opts(64 << 10, 1 << 20),
            Box::new(FailingAllocator { after: 1 }),
        );
        let mut failed = None;
        while let Some(seg) = loader.next_segment() {
            if let Err(e) = seg {
                failed = Some(e.to_string());
            }
        }
        assert_eq!(failed.as_deref(), Some("out of device memory (test)"));
    }

    /// Host destinations that count the bytes alive (allocated and not yet dropped).
    struct Counting {
        live: Arc<AtomicUsize>,
        peak: Arc<AtomicUsize>,
    }

    struct Counted {
        _buffer: crate::memory::HostBuffer,
        len: usize,
        live: Arc<AtomicUsize>,
    }

    impl Drop for Counted {
        fn drop(&mut self) {
            self.live.fetch_sub(self.len, Ordering::SeqCst);
        }
    }

    impl Allocator for Counting {
        fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
            let mut destinations = Vec::new();
            for t in tensors {
                let len = t.len as usize;
                let buffer = crate::memory::HostBuffer::alloc_populated(len, "test")?;
                let now = self.live.fetch_add(len, Ordering::SeqCst) + len;
                self.peak.fetch_max(now, Ordering::SeqCst);
                destinations.push(Destination {
                    addr: buffer.as_ptr() as u64,
                    owner: Box::new(Counted {
                        _buffer: buffer,
                        len,
                        live: self.live.clone(),
                    }),
                });
            }
            Ok(Allocation {
                destinations,
                stream: None,
            })
        }
    }

    #[test]
    fn destinations_of_undelivered_segments_stay_within_the_memory_limit() {
        // 32 tensors of 256 KiB, a 1 MiB limit (segments of 256 KiB), and a consumer much
        // slower than the reads that drops each segment: destination memory never holds more
        // than the limit. Before the budget, the whole 8 MiB piled up.
        let sizes = [256usize << 10; 32];
        let (file, data) = checkpoint(&sizes);
        let (live, peak) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
        let limit = 1u64 << 20;
        let mut loader = open_host(
            &file,
            &opts(64 << 10, limit),
            Box::new(Counting {
                live: live.clone(),
                peak: peak.clone(),
            }),
        );
        let mut got = Vec::new();
        while let Some(seg) = loader.next_segment() {
            let seg = seg.unwrap();
            std::thread::sleep(std::time::Duration::from_millis(5));
            let Memory::Placed(dest) = seg.memory else {
                panic!()
            };
            for (t, d) in seg.tensors.iter().zip(&dest) {
                let Some(c) = d.owner.downcast_ref::<Counted>() else {
                    panic!()
                };
                got.push((t.name.clone(), c._buffer.as_slice().to_vec()));
            }
        }
        got.sort();
        assert_eq!(got, expected(&sizes, &data));
        let peak = peak.load(Ordering::SeqCst) as u64;
        assert!(
            peak <= limit,
            "destination peak {peak} over the {limit} limit"
        );
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_consumer_that_keeps_every_segment_is_not_limited() {
        let sizes = [256usize << 10; 16];
        let (file, _) = checkpoint(&sizes);
        let mut loader = open_host(&file, &opts(64 << 10, 1 << 20), Box::new(HostAllocator));
        let kept: Vec<Loaded> = std::iter::from_fn(|| loader.next_segment())
            .map(|s| s.unwrap())
            .collect();
        assert_eq!(kept.iter().map(|s| s.tensors.len()).sum::<usize>(), 16);
    }

    #[test]
    fn close_from_another_thread_ends_a_waiting_consumer() {
        // An allocator that never returns until released: the consumer waits in next_segment.
        struct Gate(Arc<std::sync::Barrier>);
        impl Allocator for Gate {
            fn allocate(&mut self, tensors: &[TensorSlot]) -> Result<Allocation> {
                self.0.wait();
                HostAllocator.allocate(tensors)
            }
        }
        let (file, _) = checkpoint(&[4096, 4096]);
        let gate = Arc::new(std::sync::Barrier::new(2));
        let mut loader = open_host(&file, &opts(4096, 1 << 20), Box::new(Gate(gate.clone())));
        let control = loader.control().clone();
        let closer = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            control.close();
        });
        let got = loader.next_segment();
        closer.join().unwrap();
        assert!(
            matches!(
                got,
                Some(Err(Error::Closed {
                    delivered: 0,
                    planned: 2
                }))
            ),
            "{:?}",
            got.map(|r| r.map(|_| ()))
        );
        assert!(loader.next_segment().is_none());
        gate.wait(); // lets the copy thread end
    }

    #[test]
    fn dropping_the_loader_midway_returns_the_ring() {
        let (file, _) = checkpoint(&[4 << 20, 4 << 20]);
        let mut loader = open_host(&file, &opts(256 << 10, 1 << 20), Box::new(HostAllocator));
        let first = loader.next_segment().unwrap().unwrap();
        assert_eq!(first.tensors.len(), 1);
        drop(loader);
        // Nothing hangs and the copy threads end; the first tensor stays readable.
        let Memory::Placed(d) = first.memory else {
            panic!()
        };
        assert_eq!(host_bytes(&d[0]).unwrap().len(), 4 << 20);
    }
}
