//! The process-wide tokio runtime: built lazily on first use and rebuilt in a forked child (the
//! parent's worker threads do not exist there).

use std::cell::RefCell;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::runtime::Runtime;
use tokio::sync::Notify;

use crate::error::{Error, Result};

static RUNTIME: Mutex<Option<(u32, Arc<Runtime>)>> = Mutex::new(None);

/// The runtime for this process.
pub fn get() -> Arc<Runtime> {
    let pid = std::process::id();
    let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((owner, rt)) = slot.as_ref() {
        if *owner == pid {
            return rt.clone();
        }
    }
    if let Some((_, stale)) = slot.take() {
        // Inherited across fork: its threads are gone, so dropping it could wait forever.
        std::mem::forget(stale);
    }
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(1024)
            .thread_name("fastload")
            .enable_all()
            .build()
            .expect("failed to start the fastload tokio runtime"),
    );
    *slot = Some((pid, rt.clone()));
    rt
}

/// A one-way switch that async work can wait on: it ends the waits of [`block_on`] on the threads
/// it was [`Abort::install`]ed on (their futures are dropped, which cancels the requests in them:
/// an open interrupted by Ctrl-C), and a load's reads in flight when it is cancelled.
#[derive(Default)]
pub struct Abort {
    set: AtomicBool,
    notify: Notify,
}

thread_local! {
    static ABORT: RefCell<Option<Arc<Abort>>> = const { RefCell::new(None) };
}

impl Abort {
    /// Makes `block_on` on the calling thread end when `self` is triggered.
    pub fn install(self: &Arc<Abort>) {
        ABORT.with(|a| *a.borrow_mut() = Some(self.clone()));
    }

    /// Sets the switch; returns whether it was set already.
    pub fn trigger(&self) -> bool {
        let was = self.set.swap(true, Ordering::SeqCst);
        self.notify.notify_waiters();
        was
    }

    pub fn is_triggered(&self) -> bool {
        self.set.load(Ordering::SeqCst)
    }

    /// Completes once the switch is set.
    pub async fn triggered(&self) {
        loop {
            // Registered before the check, so a trigger in between is not missed.
            let notified = self.notify.notified();
            if self.set.load(Ordering::SeqCst) {
                return;
            }
            notified.await;
        }
    }
}

/// Runs `fut` to completion on the process runtime, from a thread outside it; `what` names the
/// work in the error when an installed [`Abort`] ends it first ([`Error::Cancelled`]).
pub fn block_on<T>(what: &str, fut: impl Future<Output = Result<T>>) -> Result<T> {
    let abort = ABORT.with(|a| a.borrow().clone());
    let runtime = get();
    match abort {
        None => runtime.block_on(fut),
        Some(abort) => runtime.block_on(async {
            tokio::select! {
                out = fut => out,
                () = abort.triggered() => Err(Error::Cancelled { what: what.to_string() }),
            }
        }),
    }
}
