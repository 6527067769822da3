//! The crate's one error type. Every fallible function returns [`Result`]; the Python bindings map
//! these variants to exceptions in exactly one place (`python/errors.rs`).

use std::io;

use crate::format::FormatError;

/// Everything that can go wrong while planning or running a load.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file is not a valid safetensors file (or the index file is malformed).
    #[error("{path}: invalid safetensors file: {source}")]
    Format {
        path: String,
        #[source]
        source: FormatError,
    },

    /// A file, object or directory does not exist.
    #[error("{path}: no such file or object")]
    NotFound { path: String },

    /// A directory holds no `*.safetensors` file (and no index): nothing to load. Raised as
    /// Python's `NotFoundError` with `filename` the directory.
    #[error("{path}: no .safetensors files in this directory (and no {index})", index = crate::source::INDEX_FILE)]
    NoShards { path: String },

    /// An I/O or network failure while reading. For object stores, `source.kind()` says what
    /// kind of failure it was (`NotFound` for a missing bucket, `PermissionDenied`, `TimedOut`,
    /// `ConnectionRefused`, ...).
    #[error("{path}: {source}")]
    Io {
        path: String,
        #[source]
        source: io::Error,
    },

    /// Host memory for buffers could not be mapped.
    #[error("host memory: cannot map {bytes} bytes: {source}")]
    Memory {
        bytes: usize,
        #[source]
        source: io::Error,
    },

    /// Requested tensor names that no file contains.
    #[error("tensors not found in {uri}: {}", quoted(.names))]
    MissingTensors { uri: String, names: Vec<String> },

    /// An option value that cannot be used (bad size string, zero concurrency, unknown device, ...).
    #[error("invalid option {option}: {message}")]
    InvalidOption { option: String, message: String },

    /// A URI scheme this build does not handle.
    #[error("{uri}: unsupported URI: {message}")]
    UnsupportedUri { uri: String, message: String },

    /// The load ended without an error before every planned tensor was delivered (a worker
    /// stopped early).
    #[error("load ended after {delivered} of {planned} tensors")]
    Incomplete { delivered: u64, planned: u64 },

    /// The load was closed (from another thread, or interrupted) before it delivered every
    /// tensor; what was delivered stays valid.
    #[error(
        "the stream was closed before it finished: {delivered} of {planned} tensors delivered"
    )]
    Closed { delivered: u64, planned: u64 },

    /// Work given up before it finished (an open whose caller was interrupted); nobody waits for
    /// its result.
    #[error("{what}: cancelled")]
    Cancelled { what: String },

    /// A stream used in a process forked after it was opened: its reads run on threads of the
    /// process that opened it, which the child does not have.
    #[error(
        "this stream was opened in process {opened_in}; a forked child cannot iterate it: \
         open it again in the child"
    )]
    Forked { opened_in: u32 },

    /// A bug in fastload, such as a worker task that panicked.
    #[error("internal error: {message}")]
    Internal { message: String },

    /// CUDA is unavailable (no driver, no such device) or a driver call failed.
    #[error("{message}")]
    Device { message: String },

    /// The caller-supplied allocator of destination memory failed (for Python: the exception it
    /// raised, re-raised as is).
    #[error("allocating destination memory failed: {source}")]
    Allocation {
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    pub(crate) fn format(path: impl Into<String>, source: FormatError) -> Self {
        Error::Format {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn option(option: impl Into<String>, message: impl Into<String>) -> Self {
        Error::InvalidOption {
            option: option.into(),
            message: message.into(),
        }
    }

    pub(crate) fn device(message: impl Into<String>) -> Self {
        Error::Device {
            message: message.into(),
        }
    }

    /// Wraps an `io::Error` for `path`, turning "not found" into [`Error::NotFound`].
    pub(crate) fn io(path: impl Into<String>, source: io::Error) -> Self {
        let path = path.into();
        if source.kind() == io::ErrorKind::NotFound {
            Error::NotFound { path }
        } else {
            Error::Io { path, source }
        }
    }
}

/// Names as the messages show them: quoted, escaped, comma-separated.
fn quoted(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}
