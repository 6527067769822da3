//! Waiting without losing Ctrl-C. Python runs a signal's handler (KeyboardInterrupt for SIGINT)
//! only when the main thread comes back to the interpreter, so a native wait of a minute (a silent
//! server) would hold Ctrl-C for a minute. Every blocking call of the module therefore waits in
//! [`SLICE`]s with the GIL released and runs the handlers between them.

use std::sync::mpsc::{sync_channel, Receiver, RecvTimeoutError, SyncSender};
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
    off_thread_serving(py, what, Duration::ZERO, no_questions, |_: Ask<(), ()>| {
        work()
    })
}

/// The `serve` of work that asks nothing.
fn no_questions(_: Python<'_>, _: ()) -> PyResult<()> {
    Ok(())
}

/// How work run by [`off_thread_serving`] asks the calling thread something: blocks until the
/// calling thread answered, or `None` once it stopped waiting (the work is done with, Ctrl-C).
pub type Ask<Q, A> = Arc<dyn Fn(Q) -> Option<A> + Send + Sync>;

/// [`off_thread`], except that on Ctrl-C `work` gets up to `grace` to wind down before the
/// KeyboardInterrupt is raised: its cleanup (a copy's multipart uploads aborted) is done by the
/// time the caller sees the exception, rather than cut off by the interpreter's exit. A second
/// Ctrl-C raises at once.
///
/// And for work that needs Python run for it: `work` gets an [`Ask`], and each question it asks
/// is answered by `serve` on the calling thread (GIL held) while that thread waits. So the
/// work's Python calls run on the thread that called in, never on a thread of ours: a
/// torch.distributed collective, say, runs where the caller's other collectives, its CUDA device
/// and its signal handling are, and none is left in flight on a thread of ours when the call
/// returns or the interpreter exits. `serve` returning an error (a Ctrl-C met while it ran Python) ends the wait as a
/// Ctrl-C does; questions asked while winding down, or after, get `None`. Where a question went
/// unanswered so (or `serve` raised, or `work` had asked something and did not end within
/// `grace`), the raised exception carries [`UNANSWERED`]` = True`: the work's peers, which asked
/// the same questions of their own callers (a collective), may be waiting on one this caller
/// never ran, so the caller must not run another collective of theirs.
pub fn off_thread_serving<T, Q, A>(
    py: Python<'_>,
    what: &str,
    grace: Duration,
    mut serve: impl FnMut(Python<'_>, Q) -> PyResult<A>,
    work: impl FnOnce(Ask<Q, A>) -> T + Send + 'static,
) -> PyResult<T>
where
    T: Send + 'static,
    Q: Send + 'static,
    A: Send + 'static,
{
    let (tx, rx) = sync_channel::<Message<T, Q, A>>(1);
    let asks = tx.clone();
    let ask: Ask<Q, A> = Arc::new(move |question| {
        let (reply, answer) = sync_channel(1);
        asks.send(Message::Ask(question, reply)).ok()?;
        answer.recv().ok()
    });
    let abort = Arc::new(Abort::default());
    let installed = abort.clone();
    spawn(what, move || {
        installed.install();
        let out = work(ask);
        let _ = tx.send(Message::Done(out));
    })?;
    let mut rx = rx;
    let mut asked = false;
    loop {
        let (interrupt, cut) = match recv(py, &mut rx) {
            Ok(Some(Message::Done(out))) => return Ok(out),
            Ok(Some(Message::Ask(question, reply))) => match serve(py, question) {
                Ok(answer) => {
                    asked = true;
                    let _ = reply.send(answer);
                    continue;
                }
                Err(e) => (e, true),
            },
            Ok(None) => return Err(panicked(what)),
            Err(e) => (e, false),
        };
        let _ = abort.trigger();
        let ended = !grace.is_zero() && wind_down(py, rx, grace);
        if cut || (asked && !ended) {
            let _ = interrupt.value(py).setattr(UNANSWERED, true);
        }
        return Err(interrupt);
    }
}

/// The attribute [`off_thread_serving`] sets on the exception it raises when a question of the
/// work went unanswered.
pub const UNANSWERED: &str = "_fastload_unanswered";

/// Starts `work` on a thread of its own, named `fastload-{what}`.
pub fn spawn(what: &str, work: impl FnOnce() + Send + 'static) -> crate::Result<()> {
    std::thread::Builder::new()
        .name(format!("fastload-{what}"))
        .spawn(work)
        .map(drop)
        .map_err(|e| crate::Error::Internal {
            message: format!("{what}: cannot start a thread: {e}"),
        })
}

/// The next message from `rx`, waited for with the GIL released in [`SLICE`]s and the signal
/// handlers run between them: `None` once the sender is gone without sending (its thread
/// panicked), `Err` what a handler raised (KeyboardInterrupt).
pub fn recv<M: Send>(py: Python<'_>, rx: &mut Receiver<M>) -> PyResult<Option<M>> {
    loop {
        // A unique borrow goes into the wait (a shared one would need the receiver to be Sync).
        let rx = &mut *rx;
        match super::gil::detach(py, move || rx.recv_timeout(SLICE)) {
            Ok(message) => return Ok(Some(message)),
            Err(RecvTimeoutError::Timeout) => py.check_signals()?,
            Err(RecvTimeoutError::Disconnected) => return Ok(None),
        }
    }
}

/// The error of a wait whose worker thread ended without an answer.
pub fn panicked(what: &str) -> PyErr {
    crate::Error::Internal {
        message: format!("{what}: the worker thread panicked"),
    }
    .into()
}

/// What the worker thread sends the waiting one: a question, or its result.
enum Message<T, Q, A> {
    Ask(Q, SyncSender<A>),
    Done(T),
}

/// Waits (GIL released, in slices) until the worker behind `rx` is done, `grace` is over, or
/// another signal's handler raises. Questions asked meanwhile are not answered (their [`Ask`]
/// returns `None`). `true`: the worker ended, having asked nothing meanwhile.
fn wind_down<T: Send, Q: Send, A: Send>(
    py: Python<'_>,
    mut rx: Receiver<Message<T, Q, A>>,
    grace: Duration,
) -> bool {
    let until = std::time::Instant::now() + grace;
    let mut dropped = false;
    while std::time::Instant::now() < until {
        let (waited, back) = super::gil::detach(py, move || (rx.recv_timeout(SLICE), rx));
        rx = back;
        match waited {
            // The reply dropped: the question gets `None`.
            Ok(Message::Ask(..)) => dropped = true,
            Ok(Message::Done(_)) => return !dropped,
            Err(RecvTimeoutError::Timeout) if py.check_signals().is_ok() => {}
            _ => return false,
        }
    }
    false
}
