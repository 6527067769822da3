//! Runs a [`Plan`]: reads in flight bounded by a concurrency limit, host buffers bounded by bytes
//! (`memory_limit`), each segment published to the consumer as soon as all its blocks landed, in
//! completion order. Dropping the [`Loader`] cancels what has not started and frees buffers.
//!
//! Every block is read through the shard's [`crate::source::Source`]; the pipeline never knows
//! whether a file or an object is behind it. Two ways to run a plan:
//! - into host memory (this file): each segment gets one `HostBuffer`, a mapping of the source
//!   where it can be mapped and `method` asks for it, else pooled memory its blocks are read into;
//!   the tensors are views of it;
//! - staged ([`staged`]): blocks are read into a ring of staging buffers and copied by a
//!   [`crate::device::Engine`] into destination memory (a GPU) while later blocks are read.
//!
//! Both publish through one `Feed` (the consumer's channel, the cancel flag, the counters).
//!
//! The way out ([`save`]): a writer's GPU tensors are copied to the host by the same engines,
//! block by block through page-locked staging, each block written while the next are copied.
//!
//! Memory fastload allocated for data the consumer has not been handed yet is bounded by
//! `memory_limit`, counted per segment with a semaphore (the budget): the driver acquires a
//! segment's share in plan order before its first read, and the consumer gives it back when it
//! asks for the next segment (so a consumer that keeps every tensor is never limited by it). For
//! host loads that memory is the segment's host buffer; for staged loads it is the destination
//! memory (a GPU's), allocated when a segment's first block lands. Taking the budget in plan order
//! keeps it deadlock-free: every segment holding some was fully started before the next asks.

pub mod save;
mod staged;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::device::{Destination, Target};
use crate::error::{Error, Result};
use crate::memory::{self, HostBuffer};
use crate::options::{LoadOptions, Method, Resolved};
use crate::plan::{self, Plan, TensorSlot};
use crate::runtime::Abort;
use crate::source;

/// A segment whose bytes have all landed.
pub struct Loaded {
    pub memory: Memory,
    pub shard: usize,
    pub tensors: Vec<TensorSlot>,
}

/// Where a [`Loaded`] segment's tensors are.
pub enum Memory {
    /// Views at each tensor's `offset` into one host buffer.
    Host(Arc<HostBuffer>),
    /// One destination per tensor (in `tensors` order), filled by a staged load.
    Placed(Vec<Destination>),
}

/// Counters of one load, readable while it runs.
#[derive(Debug, Default)]
pub struct Stats {
    /// Bytes read from storage (or faulted in from a file mapping).
    pub bytes_read: AtomicU64,
    /// Bytes handed to the consumer.
    pub bytes_delivered: AtomicU64,
    pub tensors_delivered: AtomicU64,
    /// Staged loads: bytes copied to destinations, and the most staging memory held at once.
    pub bytes_copied: AtomicU64,
    pub staging_peak: AtomicU64,
    /// Staged loads: page-locked staging memory this load had to allocate (what the buffers
    /// cached by earlier loads did not cover), and the wall-clock time during which some of it
    /// was being allocated (`cuMemHostAlloc`).
    pub pinned_bytes: AtomicU64,
    pub pinned_ns: AtomicU64,
    /// Bytes of mapped segments whose pages were all in the page cache already: mapped and
    /// left to fault in on first access, not populated (they count as read too).
    pub bytes_cached: AtomicU64,
    /// Where a staged load's time went, in nanoseconds (what `profile_load` reports): reads
    /// into staging buffers and their waits for a buffer (pinning one, or one coming back),
    /// added up over the reads in flight; the driver waiting for a ring slot (blocks waiting
    /// for their copies); the copy thread in the allocator, enqueueing copies, and idle
    /// (waiting for a read); the completion thread waiting for copies to finish.
    pub read_ns: AtomicU64,
    pub staging_wait_ns: AtomicU64,
    pub ring_wait_ns: AtomicU64,
    pub alloc_ns: AtomicU64,
    pub copy_ns: AtomicU64,
    pub copy_idle_ns: AtomicU64,
    pub fence_wait_ns: AtomicU64,
    /// Every load: the consumer waiting in [`Loader::next_segment`] for a segment.
    pub consumer_wait_ns: AtomicU64,
}

/// Adds the time since `since` to `counter` (nanoseconds).
pub(crate) fn add_since(counter: &AtomicU64, since: Instant) {
    counter.fetch_add(since.elapsed().as_nanos() as u64, Ordering::Relaxed);
}

enum Msg {
    Segment(Loaded, Option<OwnedSemaphorePermit>),
    Failed(Error),
}

/// A running load. Iterate with [`Loader::next_segment`] (blocking; call it outside the runtime).
pub struct Loader {
    /// `None` once finished: dropping the receiver drops what is queued, and producers' later
    /// segments with it.
    rx: Option<mpsc::Receiver<Msg>>,
    /// The plan, and through it the sources (files, object-store clients and their connection
    /// pools): held by the loader and its producers only, so a closed stream frees them even
    /// while its counters are still asked for.
    plan: Arc<Plan>,
    control: Arc<Control>,
    /// The budget of the segment handed out last, given back when the consumer asks for the next.
    held: Option<OwnedSemaphorePermit>,
}

/// The part of a running load that other threads may use while the consumer waits in
/// [`Loader::next_segment`]: the counters, the options, and [`Control::close`]. Nothing here
/// waits for the consumer.
pub struct Control {
    totals: Totals,
    stats: Arc<Stats>,
    cancel: Arc<Abort>,
    /// Set by [`Control::close`]: the consumer's next wait ends with [`Error::Closed`].
    closed: AtomicBool,
    /// Set when every planned segment was handed out.
    finished: AtomicBool,
    /// Semaphores producers wait on; closed on cancel so that none waits for ever.
    budgets: Vec<Arc<Semaphore>>,
    started: Instant,
    first: OnceLock<Duration>,
    /// The options in force, `method` as chosen (never `Auto`).
    config: Resolved,
    /// The copy engine of a staged load ("cuda:0", "host").
    engine: Option<String>,
}

/// What a load delivers in all, for its counters.
#[derive(Clone, Copy, Debug)]
pub struct Totals {
    pub total_bytes: u64,
    pub tensor_count: usize,
    pub files: usize,
}

impl Control {
    pub fn totals(&self) -> Totals {
        self.totals
    }

    pub fn stats(&self) -> &Stats {
        &self.stats
    }

    /// The read strategy in use.
    pub fn method(&self) -> Method {
        self.config.method
    }

    /// The options in force: the caller's, else `FASTLOAD_*` variables, else defaults.
    pub fn config(&self) -> &Resolved {
        &self.config
    }

    /// The engine a staged load copies with ("cuda:0", "host"); `None` for host-memory loads.
    pub fn engine(&self) -> Option<&str> {
        self.engine.as_deref()
    }

    /// Time from the start of reading (after headers were parsed) to the first segment handed out.
    pub fn first_segment_after(&self) -> Option<Duration> {
        self.first.get().copied()
    }

    /// Whether every planned segment was handed out.
    pub fn finished(&self) -> bool {
        self.finished.load(Ordering::SeqCst)
    }

    /// Whether [`Control::close`] was called before the load finished.
    pub fn closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }

    /// Stops the load from any thread without waiting for its consumer: nothing new starts, and
    /// a consumer waiting for a segment gets [`Error::Closed`] (unless everything was delivered).
    pub fn close(&self) {
        if !self.finished() {
            self.closed.store(true, Ordering::SeqCst);
        }
        self.stop();
    }

    fn stop(&self) {
        self.cancel.trigger();
        for budget in &self.budgets {
            budget.close();
        }
    }

    /// The error of a load closed before it finished.
    pub fn closed_error(&self) -> Error {
        Error::Closed {
            delivered: self.stats.tensors_delivered.load(Ordering::Relaxed),
            planned: self.totals.tensor_count as u64,
        }
    }
}

/// Resolves the URIs, validates every header, plans and starts reading into host memory.
pub fn open(uris: &[String], options: &LoadOptions) -> Result<Loader> {
    let (plan, resolved) = prepare(uris, options)?;
    Ok(Loader::start(plan, resolved))
}

/// Like [`open`], but tensors go to `target`'s destinations through its copy engine.
pub fn open_staged(uris: &[String], options: &LoadOptions, target: Target) -> Result<Loader> {
    let (plan, resolved) = prepare(uris, options)?;
    Ok(staged::start(plan, resolved, target))
}

/// Like [`open`] (with `target`, [`open_staged`]), over shards opened already: a `safe_open`
/// handle's, whose sources are pinned to the versions it saw when it opened (`remote`: some of
/// them are read over the network, for the defaults of the options).
pub fn open_opened(
    shards: Vec<source::Shard>,
    remote: bool,
    options: &LoadOptions,
    target: Option<Target>,
) -> Result<Loader> {
    let resolved = options.resolve(remote)?;
    let (plan, resolved) = plan_shards(shards, options, resolved)?;
    Ok(match target {
        None => Loader::start(plan, resolved),
        Some(target) => staged::start(plan, resolved, target),
    })
}

fn prepare(uris: &[String], options: &LoadOptions) -> Result<(Plan, Resolved)> {
    let resolved = options.resolve(crate::uri::any_remote(uris))?;
    let mut cache = crate::source::cache::CacheSettings::for_load(options)?;
    // A rank of a distributed load reads a share of each object: it reads copies, fills none.
    cache.fill &= options.parts.is_none();
    let decryption = source::decrypt::Decryption::for_load(options)?;
    let mut shards = source::open::open_all(uris, &options.storage_options, &cache, &decryption)?;
    if let Some(names) = options.names.as_deref().filter(|_| cache.verify) {
        // Some tensors of each file are read: `verify` checks the files that hold one whole
        // first (a whole load hashes every file while it streams).
        let wanted = |s: &source::Shard| s.header.tensors.iter().any(|t| names.contains(&t.name));
        for shard in shards.iter_mut().filter(|s| wanted(s)) {
            let (block, concurrency) = (resolved.block_size, resolved.concurrency);
            crate::ranges::verify_whole(std::slice::from_mut(shard), &cache, block, concurrency)?;
        }
    }
    plan_shards(shards, options, resolved)
}

fn plan_shards(
    shards: Vec<source::Shard>,
    options: &LoadOptions,
    resolved: Resolved,
) -> Result<(Plan, Resolved)> {
    let segment_size = plan::segment_size(resolved.memory_limit, resolved.block_size);
    let plan = match &options.parts {
        None => plan::build(shards, options.names.as_deref(), segment_size)?,
        Some(_) if options.names.is_some() => {
            return Err(Error::option("parts", "names and parts cannot be combined"))
        }
        Some(parts) => plan::build_parts(shards, parts, segment_size)?,
    };
    Ok((plan, resolved))
}

/// Permits are KiB so that a u32 acquire covers any segment.
/// The grid the reads of `seg` are cut on (its file's source: an encrypted file's segments).
fn grid(plan: &Plan, seg: &plan::Segment) -> Option<(u64, u64)> {
    plan.shards[seg.shard].source.grid()
}

fn kib(bytes: u64) -> u32 {
    bytes.div_ceil(1024).min(u32::MAX as u64) as u32
}

/// The producing side of a load, shared by both pipelines: the channel to the consumer, the
/// cancel flag and the counters.
struct Feed {
    tx: mpsc::Sender<Msg>,
    cancel: Arc<Abort>,
    stats: Arc<Stats>,
}

impl Feed {
    fn cancelled(&self) -> bool {
        self.cancel.is_triggered()
    }

    /// Ends the load with `err`: the first failure is reported, later ones are consequences.
    fn fail(&self, err: Error) {
        if !self.cancel.trigger() {
            let _ = self.tx.send(Msg::Failed(err));
        }
    }

    fn deliver(&self, loaded: Loaded, permit: Option<OwnedSemaphorePermit>) {
        let _ = self.tx.send(Msg::Segment(loaded, permit));
    }
}

/// Runs `work` that blocks (faulting pages in, page-locking memory) from a block's task, which
/// [`source::spawn_read`] put where `source`'s reads belong: directly on a blocking thread, and
/// on the blocking pool from an async task (where `block_in_place` would hand the worker off, a
/// cost measured at a few percent of an S3 load).
async fn beside_reads<T: Send + 'static>(
    source: &dyn source::Source,
    work: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    if source.reads_block() {
        work()
    } else {
        source::joined(tokio::task::spawn_blocking(work).await, source.name())
    }
}

/// One segment being read into one host buffer.
struct SegmentJob {
    plan: Arc<Plan>,
    index: usize,
    buffer: Arc<HostBuffer>,
    remaining: AtomicUsize,
    permit: Mutex<Option<OwnedSemaphorePermit>>,
    feed: Arc<Feed>,
}

impl SegmentJob {
    /// Fills `len` bytes at `off` of the buffer: faults a mapping's pages in (that is the read),
    /// or reads from the source into pooled memory.
    #[allow(unsafe_code)]
    async fn read_block(&self, off: u64, len: u64) -> Result<()> {
        let seg = &self.plan.segments[self.index];
        let shard = &self.plan.shards[seg.shard];
        let (o, l) = (off as usize, len as usize);
        if self.buffer.is_fresh() {
            // Faulting fresh pages in bulk is several times faster than one fault per page
            // while the read copies into them (and for a mapping it is the read itself).
            let (buffer, name) = (self.buffer.clone(), shard.name.clone());
            beside_reads(shard.source.as_ref(), move || buffer.populate(o, l, &name)).await?;
        }
        if self.buffer.is_mapped() {
            // The pages are the file's own: past the end of a file cut short meanwhile they read
            // as zeros, with no error. Checked before the segment can be handed out.
            shard.source.check_unchanged()?;
        }
        if !self.buffer.is_mapped() {
            // SAFETY: every block of this buffer goes to exactly one reader, and the buffer is
            // published only after the last reader finished.
            let dst = unsafe { self.buffer.slice_mut(o, l) };
            shard.source.read_into(seg.start + off, dst).await?;
        }
        self.feed.stats.bytes_read.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    fn block_finished(&self, result: Result<()>) {
        match result {
            Err(e) => self.feed.fail(e),
            Ok(()) => {
                if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
                    self.publish();
                }
            }
        }
    }

    fn publish(&self) {
        self.buffer.mark_populated();
        let seg = &self.plan.segments[self.index];
        let permit = self
            .permit
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .expect("segment published twice");
        let loaded = Loaded {
            memory: Memory::Host(self.buffer.clone()),
            shard: seg.shard,
            tensors: seg.tensors.clone(),
        };
        self.feed.deliver(loaded, Some(permit));
    }
}

struct Driver {
    plan: Arc<Plan>,
    /// The first segment to read (those before it were handed over by [`publish_cached`]).
    from: usize,
    opts: Resolved,
    budget: Arc<Semaphore>,
    budget_kib: u32,
    feed: Arc<Feed>,
}

impl Driver {
    async fn run(self) {
        let reads = Arc::new(Semaphore::new(self.opts.concurrency));
        for index in self.from..self.plan.segments.len() {
            let seg = &self.plan.segments[index];
            let need = kib(seg.len).clamp(1, self.budget_kib);
            let Ok(permit) = self.budget.clone().acquire_many_owned(need).await else {
                return;
            };
            if self.feed.cancelled() {
                return;
            }
            let source = &self.plan.shards[seg.shard].source;
            // Sources that cannot be mapped (object stores) are read into pooled buffers.
            let mapped = match self.opts.method {
                Method::Mmap => source.map(seg.start, seg.len as usize),
                _ => None,
            };
            let buffer = match mapped.unwrap_or_else(|| HostBuffer::alloc(seg.len as usize)) {
                Ok(b) => Arc::new(b),
                Err(e) => return self.feed.fail(e.memory_for(|| self.plan.describe(index))),
            };
            if buffer.is_mapped() && !buffer.is_fresh() {
                // Every page is in the page cache: nothing to read, no block tasks (in a warm
                // load they cost more than the rest of it). The file is checked now, as after
                // a read, and again at hand-out.
                if let Err(e) = source.check_unchanged() {
                    return self.feed.fail(e);
                }
                self.feed
                    .stats
                    .bytes_read
                    .fetch_add(seg.len, Ordering::Relaxed);
                self.feed
                    .stats
                    .bytes_cached
                    .fetch_add(seg.len, Ordering::Relaxed);
                let job = SegmentJob {
                    plan: self.plan.clone(),
                    index,
                    buffer,
                    remaining: AtomicUsize::new(0),
                    permit: Mutex::new(Some(permit)),
                    feed: self.feed.clone(),
                };
                job.publish();
                continue;
            }
            let blocks: Vec<(u64, u64)> = plan::blocks_on(
                seg.start,
                seg.len,
                self.opts.block_size,
                grid(&self.plan, seg),
            )
            .collect();
            let job = Arc::new(SegmentJob {
                plan: self.plan.clone(),
                index,
                buffer,
                remaining: AtomicUsize::new(blocks.len()),
                permit: Mutex::new(Some(permit)),
                feed: self.feed.clone(),
            });
            if blocks.is_empty() {
                job.publish();
                continue;
            }
            for (off, len) in blocks {
                let Ok(slot) = reads.clone().acquire_owned().await else {
                    return;
                };
                if self.feed.cancelled() {
                    return;
                }
                let task = {
                    let job = job.clone();
                    async move {
                        if job.feed.cancelled() {
                            return;
                        }
                        // Cancelled midway (a failure elsewhere, close, Ctrl-C): the request is
                        // dropped, not left to end at the storage timeout.
                        let result = tokio::select! {
                            result = job.read_block(off, len) => result,
                            () = job.feed.cancel.triggered() => return,
                        };
                        drop(slot);
                        job.block_finished(result);
                    }
                };
                source::spawn_read(source.as_ref(), task);
            }
        }
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

impl Loader {
    /// Starts reading `plan`: segments mapped from the page cache are handed over at once
    /// ([`publish_cached`]), the rest are read on the process runtime.
    pub fn start(plan: Plan, opts: Resolved) -> Loader {
        let (method, method_reason) = match opts.method {
            Method::Auto => auto_method(&plan),
            m => (m, opts.method_reason.clone()),
        };
        memory::set_pool_limit(opts.memory_limit);
        let budget_kib = kib(opts.memory_limit).min(Semaphore::MAX_PERMITS as u32);
        let budget = Arc::new(Semaphore::new(budget_kib as usize));
        let opts = Resolved {
            method,
            method_reason,
            ..opts
        };
        let (loader, feed) = Loader::new(plan, vec![budget.clone()], opts.clone(), None);
        let from = match opts.method {
            Method::Mmap => publish_cached(&loader.plan, &feed),
            _ => 0,
        };
        if from < loader.plan.segments.len() {
            let driver = Driver {
                plan: loader.plan.clone(),
                from,
                opts,
                budget,
                budget_kib,
                feed,
            };
            crate::runtime::get().spawn(driver.run());
        }
        // Else the feed goes here: the consumer's channel ends after the last segment.
        loader
    }

    /// A loader over `plan` and the feed its producers publish to. `budgets` are closed when the
    /// consumer goes away; `config` is what `stats()` reports; `engine` names a staged load's copy
    /// engine.
    fn new(
        plan: Plan,
        budgets: Vec<Arc<Semaphore>>,
        config: Resolved,
        engine: Option<String>,
    ) -> (Loader, Arc<Feed>) {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(Abort::default());
        let stats = Arc::new(Stats::default());
        let feed = Arc::new(Feed {
            tx,
            cancel: cancel.clone(),
            stats: stats.clone(),
        });
        let totals = Totals {
            total_bytes: plan.total_bytes,
            tensor_count: plan.tensor_count,
            files: plan.shards.len(),
        };
        let control = Arc::new(Control {
            totals,
            stats,
            cancel,
            closed: AtomicBool::new(false),
            finished: AtomicBool::new(false),
            budgets,
            started: Instant::now(),
            first: OnceLock::new(),
            config,
            engine,
        });
        let loader = Loader {
            rx: Some(rx),
            plan: Arc::new(plan),
            control,
            held: None,
        };
        (loader, feed)
    }

    /// The counters, options and close switch, shareable with other threads.
    pub fn control(&self) -> &Arc<Control> {
        &self.control
    }

    /// The engine a staged load copies with ("cuda:0", "host"); `None` for host-memory loads.
    pub fn engine(&self) -> Option<&str> {
        self.control.engine()
    }

    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    pub fn stats(&self) -> &Stats {
        &self.control.stats
    }

    /// The read strategy in use.
    pub fn method(&self) -> Method {
        self.control.method()
    }

    /// The options in force: the caller's, else `FASTLOAD_*` variables, else defaults.
    pub fn config(&self) -> &Resolved {
        self.control.config()
    }

    /// Time from the start of reading (after headers were parsed) to the first segment handed out.
    pub fn first_segment_after(&self) -> Option<Duration> {
        self.control.first_segment_after()
    }

    /// Blocks until the next segment is complete; `None` once everything was delivered.
    pub fn next_segment(&mut self) -> Option<Result<Loaded>> {
        loop {
            if let Some(next) = self.next_segment_within(Duration::from_millis(100)) {
                return next;
            }
        }
    }

    /// Like [`Loader::next_segment`], but waits at most `wait`: `None` when nothing came in that
    /// time (so that a caller can look at signals between waits), else what `next_segment` gives.
    pub fn next_segment_within(&mut self, wait: Duration) -> Option<Option<Result<Loaded>>> {
        // The segment handed out last is the consumer's now: its budget may go to the next.
        self.held = None;
        let Some(rx) = &self.rx else {
            return Some(None);
        };
        if self.control.closed() {
            self.finish();
            return Some(Some(Err(self.control.closed_error())));
        }
        let msg = match rx.try_recv() {
            Ok(msg) => Some(msg),
            Err(TryRecvError::Disconnected) => None,
            Err(TryRecvError::Empty) => {
                let waiting = Instant::now();
                let got = rx.recv_timeout(wait);
                add_since(&self.control.stats.consumer_wait_ns, waiting);
                match got {
                    Ok(msg) => Some(msg),
                    Err(RecvTimeoutError::Disconnected) => None,
                    Err(RecvTimeoutError::Timeout) => return None,
                }
            }
        };
        if self.control.closed() {
            self.finish();
            return Some(Some(Err(self.control.closed_error())));
        }
        Some(self.take(msg))
    }

    fn take(&mut self, msg: Option<Msg>) -> Option<Result<Loaded>> {
        let stats = &self.control.stats;
        match msg {
            Some(Msg::Segment(loaded, permit)) => {
                self.held = permit;
                // A mapping's pages are the file's own: checked again at hand-out, the last
                // moment before the consumer touches them (pages of a file cut short since its
                // blocks were read would read as zeros or fault).
                if let Memory::Host(buffer) = &loaded.memory {
                    if buffer.is_mapped() {
                        let source = &self.plan.shards[loaded.shard].source;
                        if let Err(e) = source.check_unchanged() {
                            self.finish();
                            return Some(Err(e));
                        }
                    }
                }
                self.control
                    .first
                    .get_or_init(|| self.control.started.elapsed());
                let bytes: u64 = loaded.tensors.iter().map(|t| t.len).sum();
                stats.bytes_delivered.fetch_add(bytes, Ordering::Relaxed);
                let n = loaded.tensors.len() as u64;
                let delivered = stats.tensors_delivered.fetch_add(n, Ordering::Relaxed) + n;
                if delivered as usize == self.plan.tensor_count {
                    self.control.finished.store(true, Ordering::SeqCst);
                }
                Some(Ok(loaded))
            }
            Some(Msg::Failed(e)) => {
                self.finish();
                Some(Err(e))
            }
            None => {
                let delivered = stats.tensors_delivered.load(Ordering::Relaxed);
                let cancelled = self.control.cancel.is_triggered();
                self.finish();
                if delivered as usize == self.plan.tensor_count {
                    self.control.finished.store(true, Ordering::SeqCst);
                } else if !cancelled {
                    return Some(Err(Error::Incomplete {
                        delivered,
                        planned: self.plan.tensor_count as u64,
                    }));
                }
                None
            }
        }
    }

    /// Stops reading: nothing new starts, buffers are freed as in-flight reads end.
    pub fn cancel(&mut self) {
        self.finish();
    }

    fn finish(&mut self) {
        self.held = None;
        self.control.stop();
        self.rx = None;
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        self.finish();
    }
}
