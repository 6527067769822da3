//! The process-wide tokio runtime: built lazily on first use and rebuilt in a forked child (the
//! parent's worker threads do not exist there).

use std::sync::{Arc, Mutex};

use tokio::runtime::Runtime;

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
