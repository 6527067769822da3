//! Taking the GIL back without dying in Rust frames at interpreter exit.
//!
//! Python 3.13 and older end a thread that takes the GIL after finalisation began (a daemon thread
//! coming back from a wait) with `pthread_exit`. That forced unwind runs through the frames on the
//! thread's stack, and a Rust frame that catches unwinding (pyo3's trampolines, `catch_unwind`,
//! an `extern "C"` boundary) turns it into an abort: `FATAL: exception not rethrown`, exit 134, in
//! a program whose main module returned normally. CPython 3.14 parks such threads instead; this
//! module does the same on every version, for every place where a thread of ours takes the GIL:
//! [`detach`] (a wait with the GIL released, then taking it back) and [`attach`] (a thread of ours
//! calling Python).
//!
//! The gate: [`close`] runs from `atexit` (registered when the module is imported), after
//! non-daemon threads were joined and before CPython marks itself finalising. It closes the gate
//! and, with the GIL released, waits until no thread is between its look at the gate and holding
//! the GIL again (`CROSSING`); from then on a thread that would take the GIL parks for ever
//! instead (the process is ending; nothing waits for it). The thread running the exit itself is
//! exempt: it finalises, and may call into us while doing so (a stream dropped at exit).

use std::cell::Cell;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering::SeqCst};
use std::time::Duration;

use pyo3::prelude::*;

/// The process whose interpreter is exiting (0: none). A pid rather than a flag, so that a child
/// forked by then is not affected.
static CLOSED_IN: AtomicU32 = AtomicU32::new(0);

/// Threads between the gate and holding the GIL: pid in the high half, count in the low half (a
/// child forked while a thread of its parent was crossing starts again from zero).
static CROSSING: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The thread that runs the exit (and so finalises): it never parks.
    static EXITING: Cell<bool> = const { Cell::new(false) };
}

/// `py.detach(work)`, except that a thread which would take the GIL back once the interpreter
/// began to exit parks for ever instead (see the module docs).
pub fn detach<T: Send, F: Send + FnOnce() -> T>(py: Python<'_>, work: F) -> T {
    let (out, crossing) = py.detach(move || {
        let out = work();
        (out, Crossing::enter())
    });
    drop(crossing); // the GIL is held again
    out
}

/// `Python::attach(f)` for a thread that does not hold the GIL (a thread of ours calling Python);
/// parks for ever instead once the interpreter began to exit. The gate stays open until `f` has
/// returned, so that Python code `f` runs (which may let the GIL go and take it back) never meets
/// a finalising interpreter.
pub fn attach<T>(f: impl for<'py> FnOnce(Python<'py>) -> T) -> T {
    let crossing = Crossing::enter();
    let out = Python::attach(f);
    drop(crossing);
    out
}

/// Closes the gate: registered with `atexit` when the module is imported.
#[pyfunction]
pub fn close(py: Python<'_>) {
    EXITING.with(|e| e.set(true));
    let pid = std::process::id();
    CLOSED_IN.store(pid, SeqCst);
    // With the GIL released, so that threads already past the gate get it and move on.
    py.detach(|| {
        while crossing(CROSSING.load(SeqCst), pid) > 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// Counted in [`CROSSING`] while it lives (unless the thread is exempt).
struct Crossing {
    counted: bool,
}

impl Crossing {
    fn enter() -> Crossing {
        if EXITING.with(Cell::get) {
            return Crossing { counted: false };
        }
        let pid = std::process::id();
        // Counted first, then the gate looked at (both SeqCst): either `close` sees this thread
        // crossing and waits for it, or this thread sees the gate closed and parks.
        add(pid, 1);
        if CLOSED_IN.load(SeqCst) == pid {
            add(pid, -1);
            loop {
                std::thread::park();
            }
        }
        Crossing { counted: true }
    }
}

impl Drop for Crossing {
    fn drop(&mut self) {
        if self.counted {
            add(std::process::id(), -1);
        }
    }
}

/// Threads of process `pid` counted in `word`.
fn crossing(word: u64, pid: u32) -> u64 {
    if (word >> 32) as u32 == pid {
        word & 0xffff_ffff
    } else {
        0
    }
}

fn add(pid: u32, delta: i64) {
    let _ = CROSSING.fetch_update(SeqCst, SeqCst, |word| {
        let count = crossing(word, pid) as i64 + delta;
        Some((u64::from(pid) << 32) | count.max(0) as u64)
    });
}
