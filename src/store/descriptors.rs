//! File descriptors running out, said as such. A process at its descriptor limit fails in ways
//! that name something else: rustls' platform verifier, unable to open the system's CA files,
//! says "No CA certificates were loaded from the system"; a connect fails with "tcp open error".
//! [`exhausted`] tells these apart (the error's chain, else a probe of the process) and
//! [`error`] says "too many open files (descriptor limit N)".

use std::io;

use crate::error::Error;

/// The soft limit on this process's open descriptors (`RLIMIT_NOFILE`), if it has one. A system
/// call, not /proc/self/limits: a process out of descriptors cannot open that file.
#[allow(unsafe_code)]
pub fn limit() -> Option<libc::rlim_t> {
    let mut rl = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct passed; it has no other effect.
    let ok = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut rl) } == 0;
    (ok && rl.rlim_cur != libc::RLIM_INFINITY).then_some(rl.rlim_cur)
}

fn is_exhaustion(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// True when `e`, or an error in its source chain, is EMFILE or ENFILE. An `io::Error` that
/// wraps another is looked into too (its `source()` skips the wrapped error).
pub fn in_chain(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(io) = err.downcast_ref::<io::Error>() {
            if is_exhaustion(io) || io.get_ref().is_some_and(|inner| in_chain(inner)) {
                return true;
            }
        }
        next = err.source();
    }
    false
}

/// True when this process cannot open one more descriptor now.
pub fn exhausted_now() -> bool {
    std::fs::File::open("/dev/null").is_err_and(|e| is_exhaustion(&e))
}

/// True when `e` came from descriptors running out: it says so in its chain, or (a library
/// that dropped the cause, as the CA loading does) the process is out of them now.
pub fn exhausted(e: &(dyn std::error::Error + 'static)) -> bool {
    in_chain(e) || exhausted_now()
}

/// The error for `path` when descriptors ran out. What the library said is left out: it names
/// a consequence (missing CA certificates), not the cause.
pub fn error(path: &str) -> Error {
    let limit = limit().map_or("none".to_string(), |n| n.to_string());
    Error::Io {
        path: path.to_string(),
        source: io::Error::other(format!(
            "too many open files (descriptor limit {limit}): close some, or raise the limit \
             (ulimit -n)"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_exhaustion_from_other_failures() {
        let emfile = io::Error::from_raw_os_error(libc::EMFILE);
        assert!(in_chain(&emfile));
        let wrapped = io::Error::other(io::Error::from_raw_os_error(libc::ENFILE));
        assert!(in_chain(&wrapped));
        assert!(!in_chain(&io::Error::from_raw_os_error(libc::ENOENT)));
        assert!(!exhausted_now());
        let text = error("http://h/x").to_string();
        assert!(
            text.starts_with("http://h/x: too many open files (descriptor limit "),
            "{text}"
        );
    }
}
