//! Process-wide state that a forked child gets afresh.
//!
//! `fork` copies memory but only the calling thread: a lock that another thread held at that
//! moment stays locked in the child for ever, and threads a value owns (a tokio runtime's
//! workers) do not exist there. Python programs fork beside loading threads (multiprocessing's
//! default start method on Linux, data-loader workers), so every process-wide lock of the crate
//! lives in a [`PerProcess`]: the value is keyed on the process id, and a child's first use
//! builds a new one behind a new lock. The parent's value is left untouched in the child, never
//! dropped (dropping could wait on threads that are gone, or on the lock itself): what it holds
//! (cached buffers, a runtime) is leaked there, once per fork.
//!
//! A pid check rather than a `pthread_atfork` handler: it needs no lock taken around every fork
//! of the process (a fork from any library would wait for our locks), and it also covers
//! `clone`-based forks that run no handlers.

#![allow(unsafe_code)]

use std::marker::PhantomData;
use std::sync::atomic::{AtomicPtr, Ordering};
use std::sync::{Mutex, MutexGuard};

/// A `Mutex<T>` per process, built by `init` on first use in each process.
pub struct PerProcess<T> {
    slot: AtomicPtr<Slot<T>>,
    init: fn() -> T,
    // Send/Sync as a Mutex<T> is (the AtomicPtr alone would be Sync for any T).
    _value: PhantomData<Mutex<T>>,
}

struct Slot<T> {
    pid: u32,
    value: Mutex<T>,
}

impl<T> PerProcess<T> {
    pub const fn new(init: fn() -> T) -> Self {
        PerProcess {
            slot: AtomicPtr::new(std::ptr::null_mut()),
            init,
            _value: PhantomData,
        }
    }

    /// This process's value, locked (a poisoned lock is taken over: the values kept here stay
    /// consistent between statements).
    pub fn lock(&'static self) -> MutexGuard<'static, T> {
        self.slot().value.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn slot(&'static self) -> &'static Slot<T> {
        let pid = std::process::id();
        loop {
            let current = self.slot.load(Ordering::Acquire);
            // SAFETY: a non-null pointer here came from Box::into_raw below and is never freed
            // (slots are leaked on purpose, see the module docs), so it is valid for 'static.
            if let Some(slot) = unsafe { current.as_ref() } {
                if slot.pid == pid {
                    return slot;
                }
            }
            let fresh = Box::into_raw(Box::new(Slot {
                pid,
                value: Mutex::new((self.init)()),
            }));
            if let Err(_raced) =
                self.slot
                    .compare_exchange(current, fresh, Ordering::AcqRel, Ordering::Acquire)
            {
                // Another thread of this process installed its slot first: use that one.
                // SAFETY: `fresh` came from Box::into_raw above and was never shared.
                drop(unsafe { Box::from_raw(fresh) });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    static COUNTER: PerProcess<Vec<u32>> = PerProcess::new(Vec::new);

    #[test]
    fn one_value_per_process() {
        COUNTER.lock().push(1);
        COUNTER.lock().push(2);
        assert_eq!(*COUNTER.lock(), vec![1, 2]);
    }

    #[test]
    fn a_forked_child_gets_a_fresh_value_even_with_the_parents_lock_held() {
        static HELD: PerProcess<u32> = PerProcess::new(|| 7);
        let mut guard = HELD.lock();
        *guard = 8;
        // SAFETY: the child only touches HELD and exits with _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // The parent's lock is held by a thread that is not in this process.
            let ok = *HELD.lock() == 7;
            // SAFETY: _exit has no preconditions.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        assert!(pid > 0, "fork failed");
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0);
        assert_eq!(*guard, 8);
        drop(guard);
    }
}
