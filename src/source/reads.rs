//! Reads in flight, bounded and cancellable: how every loop that reads blocks from a source
//! starts them (a load's driver, `crate::pipeline`'s; range reads and whole-file reads,
//! `crate::ranges`). Each read is a task of its own where its source's reads belong
//! ([`super::spawn_read`]), at most `concurrency` at once, and a read cancelled midway is dropped
//! with its request rather than left to end at the storage timeout.

use std::future::Future;
use std::sync::Arc;

use tokio::sync::Semaphore;
use tokio::task::JoinHandle;

use super::{spawn_read, Source};
use crate::runtime::Abort;

/// Starts reads, at most `concurrency` in flight, until `cancel` is triggered.
pub struct Reads {
    slots: Arc<Semaphore>,
    cancel: Arc<Abort>,
}

impl Reads {
    /// At most `concurrency` reads at once (at least one); once `cancel` is triggered none
    /// starts, and those in flight are dropped.
    pub fn new(concurrency: usize, cancel: Arc<Abort>) -> Reads {
        Reads {
            slots: Arc::new(Semaphore::new(concurrency.max(1))),
            cancel,
        }
    }

    /// Waits for a free slot, then spawns `read` where `source`'s reads belong; the slot is free
    /// again when `read` ends. `None` when the reads were cancelled before it started (start
    /// nothing more); the task gives `None` when they were cancelled before it ended.
    pub async fn start<F>(
        &self,
        source: &dyn Source,
        read: F,
    ) -> Option<JoinHandle<Option<F::Output>>>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let slot = self.slots.clone().acquire_owned().await.ok()?;
        if self.cancel.is_triggered() {
            return None;
        }
        let cancel = self.cancel.clone();
        Some(spawn_read(source, async move {
            if cancel.is_triggered() {
                return None;
            }
            let out = tokio::select! {
                out = read => out,
                () = cancel.triggered() => return None,
            };
            drop(slot);
            Some(out)
        }))
    }
}

/// Triggers its switch when dropped: reads started for a wait that ends early (an error in
/// another read, an interrupted [`crate::runtime::block_on`]) are dropped with it, so that none
/// keeps writing into a buffer nobody waits for.
pub struct CancelOnDrop(pub Arc<Abort>);

impl Drop for CancelOnDrop {
    fn drop(&mut self) {
        self.0.trigger();
    }
}
