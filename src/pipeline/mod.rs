//! Runs a [`Plan`]: reads in flight bounded by a concurrency limit, host buffers bounded by bytes
//! (`memory_limit`), each segment published to the consumer as soon as all its blocks landed, in
//! completion order. Dropping the [`Loader`] cancels what has not started and frees buffers.
//!
//! Every block is read through the shard's [`crate::source::Source`]; the pipeline never knows
//! whether a file or an object is behind it. One [`driver`] walks the plan and reads its blocks,
//! into one of two landings:
//! - host memory ([`host`]): each segment gets one `HostBuffer`, a mapping of the source where it
//!   can be mapped and `method` asks for it, else pooled memory its blocks are read into; the
//!   tensors are views of it;
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

mod direct;
mod driver;
mod host;
pub mod save;
mod staged;

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::device::{Destination, Target};
use crate::error::{Error, Result};
use crate::memory::HostBuffer;
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
    /// Staged loads with `method="mmap"`: bytes the engine copied from the files' mapped pages
    /// where they are ([`crate::device::Engine::lend`]), and why the load stopped lending them
    /// and read the rest into staging buffers, if it did.
    pub lent_bytes: AtomicU64,
    pub lend_refused: std::sync::OnceLock<String>,
    /// Loads with `method="direct"`: bytes read around the page cache (`O_DIRECT`) into staging
    /// or pooled buffers, and why the load stopped doing so and read the rest through the page
    /// cache, if it did.
    pub direct_bytes: AtomicU64,
    pub direct_refused: std::sync::OnceLock<String>,
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
    /// Mapping blocks' pages and lending them to the engine (page-locking them in place), added
    /// up over the reads in flight.
    pub lend_ns: AtomicU64,
    /// Giving lent blocks back (unregistering their pages), on the release threads.
    pub unlend_ns: AtomicU64,
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
    staged::start(plan, resolved, target)
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
    match target {
        None => Ok(Loader::start(plan, resolved)),
        Some(target) => staged::start(plan, resolved, target),
    }
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

impl Loader {
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
