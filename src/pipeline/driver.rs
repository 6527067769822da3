//! The one loop that reads a plan, whichever memory its blocks land in: segments in plan order,
//! each first taking its share of the memory budget, then cut into blocks ([`plan::blocks_on`]),
//! each block read as a task of its own ([`Reads`]: `concurrency` in flight, dropped midway when
//! the load is cancelled). What a block is read into, and what follows once it landed, is the
//! [`Landing`]'s: a segment's host buffer ([`super::host`]), or a staging ring whose blocks a copy
//! engine moves on into destination memory, a GPU's ([`super::staged`]).

use std::future::Future;
use std::sync::Arc;

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::Feed;
use crate::error::Result;
use crate::plan::{self, Plan};
use crate::source::reads::Reads;

/// Memory for segments not yet handed to the consumer, `memory_limit` in all (see the module docs
/// of [`super`]): permits are KiB, so that one acquire of a `u32` covers any segment.
pub(super) struct Budget {
    semaphore: Arc<Semaphore>,
    kib: u32,
}

impl Budget {
    pub(super) fn new(memory_limit: u64) -> Budget {
        let kib = kib(memory_limit).min(Semaphore::MAX_PERMITS as u32);
        Budget {
            semaphore: Arc::new(Semaphore::new(kib as usize)),
            kib,
        }
    }

    /// The semaphore, for the loader to close when the consumer goes away.
    pub(super) fn semaphore(&self) -> Arc<Semaphore> {
        self.semaphore.clone()
    }

    /// The share of a segment of `len` bytes; `None` once closed. A segment larger than the whole
    /// budget waits until it has the budget to itself.
    async fn take(&self, len: u64) -> Option<OwnedSemaphorePermit> {
        let need = kib(len).clamp(1, self.kib);
        self.semaphore.clone().acquire_many_owned(need).await.ok()
    }
}

fn kib(bytes: u64) -> u32 {
    bytes.div_ceil(1024).min(u32::MAX as u64) as u32
}

/// Where the blocks of a load land, and what happens to them there.
pub(super) trait Landing: Send + Sync + 'static {
    /// A segment being read: what its blocks share.
    type Job: Send + Sync + 'static;
    /// What a block holds from before its read until it landed (a staged block's ring slot).
    type Hold: Send + 'static;
    /// What a block's read gives.
    type Read: Send + 'static;

    /// Segment `index`, holding its share of the budget, is to be read in `blocks` blocks: its
    /// job, or `None` when it needs no read (it was handed on already: its pages are all cached,
    /// or it has no bytes). An error ends the load.
    fn begin(
        &self,
        index: usize,
        budget: OwnedSemaphorePermit,
        blocks: usize,
    ) -> Result<Option<Arc<Self::Job>>>;

    /// Waits for what a block needs before its read besides a read slot; `None` once the load
    /// was cancelled.
    fn hold(&self) -> impl Future<Output = Option<Self::Hold>> + Send;

    /// Reads the `len` bytes at `off` of `job`'s segment.
    fn read(
        &self,
        job: &Self::Job,
        off: u64,
        len: u64,
    ) -> impl Future<Output = Result<Self::Read>> + Send;

    /// What follows a block's read (not called for a read the load's cancel dropped).
    fn landed(
        &self,
        job: Arc<Self::Job>,
        off: u64,
        len: u64,
        read: Result<Self::Read>,
        hold: Self::Hold,
    );
}

/// Reads `plan`'s segments from `from` on into `landing`, blocks of at most `block` bytes.
pub(super) struct Driver<L> {
    pub(super) plan: Arc<Plan>,
    pub(super) from: usize,
    pub(super) block: u64,
    pub(super) concurrency: usize,
    pub(super) budget: Budget,
    pub(super) feed: Arc<Feed>,
    pub(super) landing: Arc<L>,
}

impl<L: Landing> Driver<L> {
    /// Runs on the process runtime until every block was started, or the load was cancelled.
    pub(super) async fn run(self) {
        let reads = Reads::new(self.concurrency, self.feed.cancel.clone());
        for index in self.from..self.plan.segments.len() {
            if self.segment(index, &reads).await.is_none() {
                return;
            }
        }
    }

    /// Starts the reads of segment `index`; `None` when the load ended (start nothing more).
    async fn segment(&self, index: usize, reads: &Reads) -> Option<()> {
        let seg = &self.plan.segments[index];
        let budget = self.budget.take(seg.len).await?;
        if self.feed.cancelled() {
            return None;
        }
        let grid = self.plan.shards[seg.shard].source.grid();
        let blocks: Vec<(u64, u64)> =
            plan::blocks_on(seg.start, seg.len, self.block, grid).collect();
        let job = match self.landing.begin(index, budget, blocks.len()) {
            Ok(Some(job)) => job,
            Ok(None) => return Some(()),
            Err(e) => {
                self.feed.fail(e);
                return None;
            }
        };
        let source = self.plan.shards[seg.shard].source.as_ref();
        for (off, len) in blocks {
            let hold = self.landing.hold().await?;
            let (landing, job) = (self.landing.clone(), job.clone());
            let task = async move {
                let read = landing.read(&job, off, len).await;
                landing.landed(job, off, len, read, hold);
            };
            reads.start(source, task).await?;
        }
        Some(())
    }
}
