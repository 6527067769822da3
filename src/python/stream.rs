//! `_fastload.Stream`: the pipeline as a Python iterator of completed segments.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::{dlpack, errors, options};
use crate::device::{self, Allocation, Allocator, Destination, Target};
use crate::pipeline::{self, Loader, Memory};
use crate::plan::{Part, TensorSlot};

/// Destinations from a Python callable, called (with the GIL, from the copy thread) once per
/// segment with the byte sizes of its tensors; it returns `(stream, [(owner, address), ...])`:
/// the `CUstream` handle the memory was allocated on (or `None`) and, per tensor, an object that
/// owns the memory (a torch tensor) and its address.
///
/// Why torch allocates the device memory rather than the driver (`cuMemAlloc`, exported as
/// kDLCUDA): torch's caching allocator then accounts for it (vLLM sizes its KV cache from
/// torch's numbers), frees are cheap and asynchronous instead of `cuMemFree`'s device-wide sync,
/// and freed weights are reused by torch. The cost, one Python call per segment, is measured by
/// `fastload bench --device cuda` (driver allocations) against `benches/run.py --device cuda`.
struct PyAllocator {
    allocate: Py<PyAny>,
}

impl Allocator for PyAllocator {
    fn allocate(&mut self, tensors: &[TensorSlot]) -> crate::Result<Allocation> {
        Python::attach(|py| -> PyResult<Allocation> {
            let sizes: Vec<u64> = tensors.iter().map(|t| t.len).collect();
            let out = self.allocate.bind(py).call1((sizes,))?;
            let (stream, items): (Option<u64>, Vec<(Py<PyAny>, u64)>) = out.extract()?;
            Ok(Allocation {
                destinations: items
                    .into_iter()
                    .map(|(owner, addr)| Destination {
                        addr,
                        owner: Box::new(owner),
                    })
                    .collect(),
                stream,
            })
        })
        .map_err(|e| crate::Error::Allocation {
            source: Box::new(e),
        })
    }
}

/// A running load. Each `next()` waits (GIL released) for the next completed segment and returns
/// a list of `(name, dtype, shape, capsule)`; a capsule holds the tensor as the native DLPack dtype
/// or, for dtypes DLPack/torch cannot carry, as flat bytes. With `parts` (byte ranges
/// `(name, begin, end)` within tensors) only those ranges are read, and each comes back as
/// `(name, "U8", (len,), capsule, begin)`.
///
/// With `target` ("cuda", "cuda:N", or "host" for the same staged pipeline into host memory) and
/// `allocate` (see `PyAllocator`), blocks go through staging buffers into the memory `allocate`
/// hands out, and each item carries that owner object (e.g. a torch uint8 tensor) in place of
/// the capsule.
#[pyclass(module = "fastload._fastload")]
pub struct Stream {
    loader: Mutex<Option<Loader>>,
}

#[pymethods]
impl Stream {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (uris, *, concurrency=None, block_size=None, memory_limit=None, names=None, method=None, storage_options=None, parts=None, target=None, allocate=None))]
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
        target: Option<String>,
        allocate: Option<Py<PyAny>>,
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
        let loader = match (target, allocate) {
            (None, None) => py.detach(|| pipeline::open(&uris, &opts)),
            (Some(target), Some(allocate)) => py.detach(|| {
                let engine = device::engine(&target)?;
                let allocator = Box::new(PyAllocator { allocate });
                pipeline::open_staged(&uris, &opts, Target { engine, allocator })
            }),
            _ => Err(crate::Error::option(
                "target",
                "target and allocate go together",
            )),
        }
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
        let (host, mut placed) = match loaded.memory {
            Memory::Host(buffer) => (Some(buffer), None),
            Memory::Placed(d) => (None, Some(d.into_iter())),
        };
        for t in &loaded.tensors {
            let cap = match (&host, placed.as_mut()) {
                (Some(buffer), _) => {
                    dlpack::capsule(py, buffer, t.offset, t.len, t.dtype, &t.shape)?
                }
                (None, Some(it)) => {
                    let d = it.next().expect("one destination per tensor");
                    match d.owner.downcast::<Py<PyAny>>() {
                        Ok(owner) => *owner,
                        Err(_) => py.None(),
                    }
                }
                (None, None) => unreachable!("a segment is in host memory or placed"),
            };
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

    /// Counters: bytes and tensors planned, read and delivered, time to first segment; the method
    /// and options in force.
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
            d.set_item("concurrency", l.config().concurrency)?;
            d.set_item("block_size", l.config().block_size)?;
            d.set_item("memory_limit", l.config().memory_limit)?;
            d.set_item("target", l.engine())?;
            d.set_item("bytes_copied", s.bytes_copied.load(Relaxed))?;
            d.set_item("staging_peak_bytes", s.staging_peak.load(Relaxed))?;
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
