//! `_fastload.Stream`: the pipeline as a Python iterator of completed segments.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::{dlpack, errors, options};
use crate::pipeline::{self, Loader};
use crate::plan::Part;

/// A running load. Each `next()` waits (GIL released) for the next completed segment and returns
/// a list of `(name, dtype, shape, capsule)`; a capsule holds the tensor as the native DLPack dtype
/// or, for dtypes DLPack/torch cannot carry, as flat bytes. With `parts` (byte ranges
/// `(name, begin, end)` within tensors) only those ranges are read, and each comes back as
/// `(name, "U8", (len,), capsule, begin)`.
#[pyclass(module = "fastload._fastload")]
pub struct Stream {
    loader: Mutex<Option<Loader>>,
}

#[pymethods]
impl Stream {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (uris, *, concurrency=None, block_size=None, memory_limit=None, names=None, method=None, storage_options=None, parts=None))]
    fn new(
        py: Python<'_>,
        uris: Vec<String>,
        concurrency: Option<&Bound<'_, PyAny>>,
        block_size: Option<&Bound<'_, PyAny>>,
        memory_limit: Option<&Bound<'_, PyAny>>,
        names: Option<Vec<String>>,
        method: Option<String>,
        storage_options: Option<&Bound<'_, PyDict>>,
        parts: Option<Vec<Part>>,
    ) -> PyResult<Self> {
        let mut opts = options(
            concurrency,
            block_size,
            memory_limit,
            names,
            method.as_deref(),
        )?;
        opts.storage_options = super::storage_options(storage_options)?;
        opts.parts = parts;
        let loader = py
            .detach(|| pipeline::open(&uris, &opts))
            .map_err(errors::to_py)?;
        Ok(Stream {
            loader: Mutex::new(Some(loader)),
        })
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyList>>> {
        let next = py.detach(|| {
            let mut guard = self.loader.lock().unwrap_or_else(|e| e.into_inner());
            guard.as_mut().and_then(|l| l.next_segment())
        });
        let loaded = match next {
            None => return Ok(None),
            Some(Err(e)) => return Err(errors::to_py(e)),
            Some(Ok(loaded)) => loaded,
        };
        let items = PyList::empty(py);
        for t in &loaded.tensors {
            let cap = dlpack::capsule(py, &loaded.buffer, t.offset, t.len, t.dtype, &t.shape)?;
            let shape = PyTuple::new(py, &t.shape)?;
            let mut fields = vec![
                t.name.as_str().into_pyobject(py)?.into_any(),
                t.dtype.as_str().into_pyobject(py)?.into_any(),
                shape.into_any(),
                cap.into_bound(py),
            ];
            if let Some(begin) = t.piece {
                fields.push(begin.into_pyobject(py)?.into_any());
            }
            items.append(PyTuple::new(py, fields)?)?;
        }
        Ok(Some(items.unbind()))
    }

    /// Stops reading and frees buffers that no tensor uses.
    fn close(&self, py: Python<'_>) {
        let loader = self.loader.lock().unwrap_or_else(|e| e.into_inner()).take();
        py.detach(|| drop(loader));
    }

    /// Counters: bytes and tensors planned, read and delivered, time to first segment, method.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        let guard = self.loader.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(l) = guard.as_ref() {
            use std::sync::atomic::Ordering::Relaxed;
            let s = l.stats();
            d.set_item("total_bytes", l.plan().total_bytes)?;
            d.set_item("tensor_count", l.plan().tensor_count)?;
            d.set_item("files", l.plan().shards.len())?;
            d.set_item("bytes_read", s.bytes_read.load(Relaxed))?;
            d.set_item("bytes_delivered", s.bytes_delivered.load(Relaxed))?;
            d.set_item("tensors_delivered", s.tensors_delivered.load(Relaxed))?;
            d.set_item(
                "first_segment_ms",
                l.first_segment_after().map(|t| t.as_secs_f64() * 1e3),
            )?;
            d.set_item("method", l.method().as_str())?;
        }
        Ok(d)
    }
}

/// Headers of every file the URIs name: a list of dicts `{file, size, tensors: [(name, dtype,
/// shape, begin, end)], metadata}`; reads no tensor data.
#[pyfunction]
#[pyo3(signature = (uris, *, storage_options=None))]
pub fn inspect<'py>(
    py: Python<'py>,
    uris: Vec<String>,
    storage_options: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyList>> {
    let storage_options = super::storage_options(storage_options)?;
    let shards = py
        .detach(|| crate::source::open_all(&uris, &storage_options))
        .map_err(errors::to_py)?;
    let out = PyList::empty(py);
    for s in shards {
        let d = PyDict::new(py);
        d.set_item("file", &s.name)?;
        d.set_item("size", s.size)?;
        let tensors = PyList::empty(py);
        for t in &s.header.tensors {
            tensors.append((
                t.name.as_str(),
                t.dtype.as_str(),
                PyTuple::new(py, &t.shape)?,
                t.begin,
                t.end,
            ))?;
        }
        d.set_item("tensors", tensors)?;
        d.set_item("metadata", s.header.metadata.clone())?;
        out.append(d)?;
    }
    Ok(out)
}
