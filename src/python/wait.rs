//! Waiting without losing Ctrl-C. Python runs a signal's handler (KeyboardInterrupt for SIGINT)
//! only when the main thread comes back to the interpreter, so a native wait of a minute (a silent
//! server) would hold Ctrl-C for a minute. Every blocking call of the module therefore waits in
//! [`SLICE`]s with the GIL released and runs the handlers between them.

use std::sync::mpsc::{sync_channel, RecvTimeoutError};
use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;

use crate::runtime::Abort;

/// How long a wait runs before Python's signal handlers get their turn: well inside the 0.2 s a
/// user notices, and rare enough to cost nothing.
pub const SLICE: Duration = Duration::from_millis(50);

/// Runs `work` on a thread of its own and waits for it in slices (GIL released), checking for
/// signals between them. On Ctrl-C the handler's exception (KeyboardInterrupt) is raised at once
/// and `work` is abandoned: the runtime waits it is in end ([`crate::runtime::Abort`]), which
/// drops their requests, and whatever it still returns is dropped (a loader it opened is
/// cancelled then).
pub fn off_thread<T: Send + 'static>(
    py: Python<'_>,
    what: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    wait_for(py, what, Duration::ZERO, work)
}

/// [`off_thread`], except that on Ctrl-C `work` gets up to `grace` to wind down before the
/// KeyboardInterrupt is raised: its cleanup (a copy's multipart uploads aborted) is done by the
/// time the caller sees the exception, rather than cut off by the interpreter's exit. A second
/// Ctrl-C raises at once.
pub fn off_thread_cleaning_up<T: Send + 'static>(
    py: Python<'_>,
    what: &str,
    grace: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    wait_for(py, what, grace, work)
}

fn wait_for<T: Send + 'static>(
    py: Python<'_>,
    what: &str,
    grace: Duration,
    work: impl FnOnce() -> T + Send + 'static,
) -> PyResult<T> {
    let (tx, rx) = sync_channel(1);
    let abort = Arc::new(Abort::default());
    let installed = abort.clone();
    std::thread::Builder::new()
        .name(format!("fastload-{what}"))
        .spawn(move || {
            installed.install();
            let _ = tx.send(work());
        })
        .map_err(|e| crate::Error::Internal {
            message: format!("{what}: cannot start a thread: {e}"),
        })?;
    let mut rx = rx;
    loop {
        // The receiver travels into the wait and back (it cannot be shared across threads).
        let (waited, back) = super::gil::detach(py, move || (rx.recv_timeout(SLICE), rx));
        rx = back;
        match waited {
            Ok(out) => return Ok(out),
            Err(RecvTimeoutError::Timeout) => {
                if let Err(interrupt) = py.check_signals() {
                    let _ = abort.trigger();
                    if !grace.is_zero() {
                        wind_down(py, rx, grace);
                    }
                    return Err(interrupt);
                }
            }
            Err(RecvTimeoutError::Disconnected) => {
                return Err(crate::Error::Internal {
                    message: format!("{what}: the worker thread panicked"),
                }
                .into())
            }
        }
    }
}

/// Waits (GIL released, in slices) until the worker behind `rx` is done, `grace` is over, or
/// another signal's handler raises.
fn wind_down<T: Send>(py: Python<'_>, mut rx: std::sync::mpsc::Receiver<T>, grace: Duration) {
    let until = std::time::Instant::now() + grace;
    while std::time::Instant::now() < until {
        let (waited, back) = super::gil::detach(py, move || (rx.recv_timeout(SLICE), rx));
        rx = back;
        if !matches!(waited, Err(RecvTimeoutError::Timeout)) || py.check_signals().is_err() {
            return;
        }
    }
}
