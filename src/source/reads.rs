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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::testing::Bytes;
    use futures_util::FutureExt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn a_read_waits_for_a_slot_and_cancel_drops_the_reads_in_flight() {
        crate::runtime::get().block_on(async {
            let source: Arc<dyn Source> = Arc::new(Bytes {
                name: "mem".into(),
                data: vec![0; 16],
            });
            let src = source.as_ref();
            let cancel = Arc::new(Abort::default());
            let reads = Reads::new(2, cancel.clone());
            // Reads that end once the gate lets them through, one per permit.
            let (gate, ended) = (Arc::new(Semaphore::new(0)), Arc::new(AtomicUsize::new(0)));
            let read = || {
                let (gate, ended) = (gate.clone(), ended.clone());
                async move {
                    gate.acquire().await.expect("open").forget();
                    ended.fetch_add(1, Ordering::SeqCst);
                }
            };
            let first = reads.start(src, read()).await.expect("a free slot");
            let second = reads.start(src, read()).await.expect("a free slot");
            // Both slots are taken until a read ends: a third waits.
            assert!(reads.start(src, read()).now_or_never().is_none());
            gate.add_permits(1);
            let third = reads
                .start(src, read())
                .await
                .expect("the slot of the read that ended");
            cancel.trigger();
            // Each task ends: the gated ones dropped by the cancel (never left waiting).
            let mut outs = Vec::new();
            for task in [first, second, third] {
                let out = tokio::time::timeout(std::time::Duration::from_secs(30), task).await;
                outs.push(out.expect("a cancelled read ends").unwrap());
            }
            outs.sort();
            assert_eq!(outs, vec![None, None, Some(())]);
            assert_eq!(ended.load(Ordering::SeqCst), 1);
            // Cancelled: nothing starts any more.
            assert!(reads.start(src, read()).await.is_none());
        });
    }
}
