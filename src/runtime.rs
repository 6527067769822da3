//! The process-wide tokio runtime: built lazily on first use, and again in a forked child (the
//! parent's worker threads do not exist there, and its lock may have been held when it forked).

use std::sync::Arc;

use tokio::runtime::Runtime;

use crate::per_process::PerProcess;

// In a child, the parent's runtime is left behind, never dropped: dropping it would wait for
// worker threads that are not in this process.
static RUNTIME: PerProcess<Option<Arc<Runtime>>> = PerProcess::new(|| None);

/// The runtime for this process.
pub fn get() -> Arc<Runtime> {
    let mut slot = RUNTIME.lock();
    if let Some(rt) = slot.as_ref() {
        return rt.clone();
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
    *slot = Some(rt.clone());
    rt
}
