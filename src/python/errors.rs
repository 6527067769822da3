//! The one place where Rust errors become Python exceptions. The exception classes live in
//! `fastload/_errors.py` so that they can inherit from both `FastloadError` and the matching
//! builtin (`ValueError`, `OSError`, `FileNotFoundError`, `KeyError`).

use pyo3::prelude::*;

use crate::Error;

fn class<'py>(py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    py.import("fastload._errors")?.getattr(name)
}

/// Converts an error to the matching `fastload` exception.
pub fn to_py(err: Error) -> PyErr {
    // An exception raised by Python code we called (a destination allocator) goes back as is.
    let err = match err {
        Error::Allocation { source } => match source.downcast::<PyErr>() {
            Ok(e) => return *e,
            Err(source) => Error::Allocation { source },
        },
        e => e,
    };
    Python::attach(|py| {
        let name = match &err {
            Error::Format { .. } => "FormatError",
            Error::NotFound { .. } => "NotFoundError",
            Error::Io { .. } | Error::Memory { .. } => "StorageError",
            Error::MissingTensors { .. } => "TensorNotFoundError",
            Error::InvalidOption { .. } | Error::UnsupportedUri { .. } => "ConfigError",
            _ => "FastloadError",
        };
        let message = err.to_string();
        match class(py, name) {
            Ok(cls) => match &err {
                // OSError subclasses take (errno, strerror, filename) so that `.filename` works.
                Error::NotFound { path } => {
                    match cls.call1((libc::ENOENT, message.clone(), path)) {
                        Ok(obj) => PyErr::from_value(obj),
                        Err(e) => e,
                    }
                }
                _ => match cls.call1((message,)) {
                    Ok(obj) => PyErr::from_value(obj),
                    Err(e) => e,
                },
            },
            Err(e) => e,
        }
    })
}
