//! The private native module `fastload._fastload`. Python values become owned Rust values first;
//! every wait runs with the GIL released.

use pyo3::prelude::*;

mod dlpack;
mod errors;
mod stream;

use crate::options::{LoadOptions, Method, Size};

/// Parses a size given as an int or a string like "64MiB".
fn size_arg(option: &str, value: Option<&Bound<'_, PyAny>>) -> PyResult<Option<u64>> {
    let Some(v) = value else { return Ok(None) };
    if v.is_none() {
        return Ok(None);
    }
    if let Ok(n) = v.extract::<i128>() {
        return u64::try_from(n).map(Some).map_err(|_| {
            errors::to_py(crate::Error::option(
                option,
                format!("{n} is not a byte count"),
            ))
        });
    }
    if let Ok(s) = v.extract::<String>() {
        return s
            .parse::<Size>()
            .map(|s| Some(s.0))
            .map_err(|e| errors::to_py(crate::Error::option(option, e)));
    }
    Err(errors::to_py(crate::Error::option(
        option,
        format!(
            "expected an int or a string like \"64MiB\", got {}",
            v.get_type().name()?
        ),
    )))
}

#[allow(clippy::too_many_arguments)]
pub(crate) fn options(
    concurrency: Option<&Bound<'_, PyAny>>,
    block_size: Option<&Bound<'_, PyAny>>,
    memory_limit: Option<&Bound<'_, PyAny>>,
    names: Option<Vec<String>>,
    method: Option<&str>,
) -> PyResult<LoadOptions> {
    let concurrency = match concurrency {
        Some(c) if !c.is_none() => {
            let n: i64 = c.extract().map_err(|_| {
                errors::to_py(crate::Error::option(
                    "concurrency",
                    "expected a positive int",
                ))
            })?;
            if n <= 0 {
                return Err(errors::to_py(crate::Error::option(
                    "concurrency",
                    format!("{n} is not a positive int"),
                )));
            }
            Some(n as usize)
        }
        _ => None,
    };
    let method = match method {
        Some(m) => m
            .parse::<Method>()
            .map_err(|e| errors::to_py(crate::Error::option("method", e)))?,
        None => Method::Auto,
    };
    Ok(LoadOptions {
        concurrency,
        block_size: size_arg("block_size", block_size)?,
        memory_limit: size_arg("memory_limit", memory_limit)?,
        names,
        method,
        ..Default::default()
    })
}

/// Object-store settings from a dict; values are converted with `str()` (so `True` and numbers
/// work), keys must be strings.
pub(crate) fn storage_options(
    value: Option<&Bound<'_, pyo3::types::PyDict>>,
) -> PyResult<Vec<(String, String)>> {
    let Some(d) = value else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(d.len());
    for (k, v) in d.iter() {
        let key: String = k.extract().map_err(|_| {
            errors::to_py(crate::Error::option(
                "storage_options",
                "keys must be strings",
            ))
        })?;
        let value = if let Ok(b) = v.extract::<bool>() {
            b.to_string()
        } else {
            v.str()?.to_string()
        };
        out.push((key, value));
    }
    Ok(out)
}

/// Parses a byte size ("64MiB", "1.5GB", "4096").
#[pyfunction]
fn parse_size(value: &str) -> PyResult<u64> {
    value
        .parse::<Size>()
        .map(|s| s.0)
        .map_err(|e| errors::to_py(crate::Error::option("size", e)))
}

/// Runs the `fastload` command line with `argv` (program name first); returns the exit code.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> i32 {
    py.detach(|| crate::cli::run(argv))
}

/// The number of CUDA devices; raises `FastloadError` when no driver can be loaded. Loads and
/// initialises the driver on first use, never at import.
#[pyfunction]
fn cuda_device_count(py: Python<'_>) -> PyResult<usize> {
    #[cfg(feature = "cuda")]
    {
        py.detach(crate::device::cuda::device_count)
            .map_err(errors::to_py)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        Err(errors::to_py(crate::Error::Device {
            message: "CUDA support was not built in".into(),
        }))
    }
}

/// `{"host": bytes, "pinned": bytes}`, the shape both memory functions return.
fn by_kind(c: crate::device::CachedMemory) -> std::collections::HashMap<&'static str, u64> {
    [("host", c.host), ("pinned", c.pinned)].into()
}

/// Host memory kept by fastload for the next load, in bytes: {"host": ..., "pinned": ...}.
#[pyfunction]
fn cached_memory() -> std::collections::HashMap<&'static str, u64> {
    by_kind(crate::device::cached_memory())
}

/// Gives the host memory kept for the next load back; returns the bytes given back, as
/// `cached_memory`.
#[pyfunction]
fn release_memory(py: Python<'_>) -> std::collections::HashMap<&'static str, u64> {
    by_kind(py.detach(crate::device::release_cached_memory))
}

#[pymodule]
fn _fastload(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", crate::VERSION)?;
    m.add_class::<stream::Stream>()?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(stream::inspect, m)?)?;
    m.add_function(wrap_pyfunction!(cached_memory, m)?)?;
    m.add_function(wrap_pyfunction!(release_memory, m)?)?;
    Ok(())
}
