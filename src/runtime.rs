//! The process-wide tokio runtime: built lazily on first use, and again in a forked child (the
//! parent's worker threads do not exist there, and its lock may have been held when it forked).

use std::cell::RefCell;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use tokio::runtime::Runtime;
use tokio::sync::Notify;

use crate::error::{Error, Result};
use crate::per_process::PerProcess;

// In a child, the parent's runtime is left behind, never dropped: dropping it would wait for
// worker threads that are not in this process.
static RUNTIME: PerProcess<Option<Arc<Runtime>>> = PerProcess::new(|| None);

/// The runtime for this process.
///
/// # Panics
/// When it cannot be started (no descriptor or thread left): [`try_get`] says why instead.
pub fn get() -> Arc<Runtime> {
    try_get().unwrap_or_else(|e| panic!("{e}"))
}

/// The runtime for this process, or why it could not be started (the error of its epoll or
/// eventfd descriptor, or of its threads: "Too many open files" at the descriptor limit).
pub fn try_get() -> Result<Arc<Runtime>> {
    let mut slot = RUNTIME.lock();
    if let Some(rt) = slot.as_ref() {
        return Ok(rt.clone());
    }
    let rt = Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(1024)
            .thread_name("fastload")
            .enable_all()
            .build()
            .map_err(|source| Error::Io {
                path: "starting fastload's runtime".into(),
                source,
            })?,
    );
    *slot = Some(rt.clone());
    Ok(rt)
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

    /// The switch installed on the calling thread, if any: to install it on threads that work
    /// for this one (a copy's files in flight).
    pub fn installed() -> Option<Arc<Abort>> {
        ABORT.with(|a| a.borrow().clone())
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
    let runtime = try_get()?;
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
