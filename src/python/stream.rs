//! `_fastload.Stream`: the pipeline as a Python iterator of completed segments.

use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use super::args::{BlockSize, Bytes, Concurrency, MemoryLimit, MethodArg, Names, StorageOptions};
use super::item::{Item, Stats};
use super::{dlpack, options::load_options};
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
/// its tensors as a list of [`Item`]s. With `parts` (byte ranges `(name, begin, end)` within
/// tensors) only those ranges are read, and each comes back as a U8 item of shape `(len,)` with
/// `begin` set.
///
/// With `target` ("cuda", "cuda:N", or "host" for the same staged pipeline into host memory) and
/// `allocate` (see `PyAllocator`), blocks go through staging buffers into the memory `allocate`
/// hands out, and each item's `data` is that owner object (e.g. a torch uint8 tensor).
#[pyclass(module = "fastload._fastload")]
pub struct Stream {
    loader: Mutex<Option<Loader>>,
    /// The counters as `close()` left them.
    closed: Mutex<Option<Stats>>,
}

#[pymethods]
impl Stream {
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (uris, *, concurrency=None, block_size=None, memory_limit=None, names=None, method=None, storage_options=None, parts=None, target=None, allocate=None))]
    fn new(
        py: Python<'_>,
        uris: Vec<String>,
        concurrency: Option<Concurrency>,
        block_size: Option<Bytes<BlockSize>>,
        memory_limit: Option<Bytes<MemoryLimit>>,
        names: Option<Names>,
        method: Option<MethodArg>,
        storage_options: Option<StorageOptions>,
        parts: Option<Vec<Part>>,
        target: Option<String>,
        allocate: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let mut opts = load_options(
            concurrency,
            block_size,
            memory_limit,
            names,
            method,
            storage_options,
        );
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
        }?;
        Ok(Stream {
            loader: Mutex::new(Some(loader)),
            closed: Mutex::new(None),
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
        let Some(loaded) = next.transpose()? else {
            return Ok(None);
        };
        let items = PyList::empty(py);
        let (host, mut placed) = match loaded.memory {
            Memory::Host(buffer) => (Some(buffer), None),
            Memory::Placed(d) => (None, Some(d.into_iter())),
        };
        for t in &loaded.tensors {
            let data = match (&host, placed.as_mut()) {
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
            items.append(Item {
                name: PyString::new(py, &t.name).unbind(),
                dtype: t.dtype.as_str(),
                shape: PyTuple::new(py, &t.shape)?.unbind(),
                data,
                begin: t.piece,
            })?;
        }
        Ok(Some(items.unbind()))
    }

    /// Stops reading and frees buffers that no tensor uses.
    fn close(&self, py: Python<'_>) {
        let loader = self.loader.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(l) = &loader {
            *self.closed.lock().unwrap_or_else(|e| e.into_inner()) = Some(Stats::of(l));
        }
        py.detach(|| drop(loader));
    }

    /// The counters so far; once closed, as they were when it closed.
    fn stats(&self) -> Option<Stats> {
        let guard = self.loader.lock().unwrap_or_else(|e| e.into_inner());
        match guard.as_ref() {
            Some(l) => Some(Stats::of(l)),
            None => self
                .closed
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone(),
        }
    }
}

/// Headers of every file the URIs name: a list of dicts `{file, size, tensors: [(name, dtype,
/// shape, begin, end)], metadata}`; reads no tensor data.
#[pyfunction]
#[pyo3(signature = (uris, *, storage_options=None))]
pub fn inspect<'py>(
    py: Python<'py>,
    uris: Vec<String>,
    storage_options: Option<StorageOptions>,
) -> PyResult<Bound<'py, PyList>> {
    let storage_options = storage_options.unwrap_or_default().0;
    let shards = py.detach(|| crate::source::open_all(&uris, &storage_options))?;
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
