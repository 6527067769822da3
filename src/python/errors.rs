//! The one place where Rust errors become Python exceptions: `impl From<Error> for PyErr`, so
//! every binding returns `crate::Result` through `?`. The exception classes live in
//! `fastload/_errors.py` so that they can inherit from both `FastloadError` and the matching
//! builtin (`ValueError`, `OSError`, `FileNotFoundError`, `KeyError`); what a caller may want to
//! act on travels as attributes (`ConfigError.option`, `TensorNotFoundError.names`,
//! `FormatError.path`, `filename` on `NotFoundError`), never only inside the message. The message
//! and every attribute are scrubbed of known credentials (`crate::error::scrub`).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::scrub;
use crate::format::FormatError;
use crate::options::FrontEnd;
use crate::Error;

impl From<Error> for PyErr {
    fn from(err: Error) -> PyErr {
        match err {
            // An exception raised by Python code we called (a destination allocator) goes back
            // as is.
            Error::Allocation { source } => match source.downcast::<PyErr>() {
                Ok(e) => *e,
                Err(source) => Python::attach(|py| exception(py, &Error::Allocation { source })),
            },
            e => Python::attach(|py| exception(py, &e)),
        }
    }
}

/// The exception for an error that stays where it is (a stream's failure, raised again to every
/// later caller): what `From<Error>` gives, a Python exception from an allocator included.
pub fn raised(py: Python<'_>, err: &Error) -> PyErr {
    if let Error::Allocation { source } = err {
        if let Some(e) = source.downcast_ref::<PyErr>() {
            return e.clone_ref(py);
        }
    }
    exception(py, err)
}

fn exception(py: Python<'_>, err: &Error) -> PyErr {
    build(py, err).unwrap_or_else(|e| e)
}

fn build(py: Python<'_>, err: &Error) -> PyResult<PyErr> {
    // Arguments are named as Python names them (`overwrite=True`, `keyset=`).
    let message = err.message_for(FrontEnd::Python);
    let attrs = PyDict::new(py);
    let name = match err {
        // A name that leaves the model's folder: the checkpoint cannot be used as given, the same
        // refusal whether it comes from an index (here) or from an integration's small files.
        Error::Format {
            source: FormatError::IndexEntryOutside { .. } | FormatError::IndexInvalidPath { .. },
            ..
        }
        | Error::NameOutside { .. } => {
            attrs.set_item("option", "uri")?;
            "ConfigError"
        }
        Error::Format { path, .. } => {
            attrs.set_item("path", scrub(path))?;
            "FormatError"
        }
        Error::Decryption { path, segment, .. } => {
            attrs.set_item("path", scrub(path))?;
            attrs.set_item("segment", segment)?;
            "FormatError"
        }
        Error::NotFound { path } | Error::NoShards { path } | Error::Missing { path, .. } => {
            // OSError subclasses take (errno, strerror, filename) so that `.filename` works.
            let cls = py.import("fastload._errors")?.getattr("NotFoundError")?;
            return Ok(PyErr::from_value(cls.call1((
                libc::ENOENT,
                message,
                scrub(path),
            ))?));
        }
        Error::Exists { path } => {
            let cls = py
                .import("fastload._errors")?
                .getattr("DestinationExistsError")?;
            return Ok(PyErr::from_value(cls.call1((
                libc::EEXIST,
                message,
                scrub(path),
            ))?));
        }
        Error::InvalidTensors { .. } => {
            attrs.set_item("option", "tensors")?;
            "ConfigError"
        }
        Error::Io { .. } | Error::Memory { .. } => "StorageError",
        Error::MissingTensors { uri, names } => {
            attrs.set_item("names", names)?;
            attrs.set_item("uri", scrub(uri))?;
            "TensorNotFoundError"
        }
        Error::InvalidOption { option, .. } => {
            attrs.set_item("option", FrontEnd::Python.name(option))?;
            "ConfigError"
        }
        Error::AlreadyEncrypted { .. } => {
            attrs.set_item("option", FrontEnd::Python.name("encrypt"))?;
            "ConfigError"
        }
        Error::Encrypted { path, .. } => {
            attrs.set_item("path", scrub(path))?;
            attrs.set_item("segment", None::<u64>)?;
            "FormatError"
        }
        Error::Closed { .. } => "StreamClosedError",
        Error::UnsupportedUri { .. } => {
            attrs.set_item("option", "uri")?;
            "ConfigError"
        }
        _ => "FastloadError",
    };
    let cls = py.import("fastload._errors")?.getattr(name)?;
    Ok(PyErr::from_value(cls.call((message,), Some(&attrs))?))
}
