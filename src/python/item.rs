//! The typed values `_fastload.Stream` hands to Python: an [`Item`] per delivered tensor (or
//! piece) and [`Stats`], both frozen.

use std::collections::BTreeMap;
use std::sync::atomic::Ordering::Relaxed;

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use crate::pipeline::Control;

/// One tensor of a completed segment, or one piece of a tensor when the load reads `parts`.
///
/// `data` is a `dltensor` capsule viewing the loader's host memory: the tensor in its own dtype
/// when DLPack carries that dtype natively (`DLPACK_DTYPES`), else its bytes as flat uint8. For a
/// staged load it is the owner object the allocator returned (e.g. a torch uint8 tensor), or,
/// without an allocator, a capsule of the same kind that owns the memory fastload allocated
/// (kDLCUDA for a GPU).
/// `begin` is the piece's first byte within its tensor (then `dtype` is `"U8"` and `shape` is
/// `(len,)`), `None` for a whole tensor.
#[pyclass(module = "fastload._fastload", frozen, get_all)]
pub struct Item {
    pub name: Py<PyString>,
    pub dtype: &'static str,
    pub shape: Py<PyTuple>,
    pub data: Py<PyAny>,
    pub begin: Option<u64>,
}

#[pymethods]
impl Item {
    fn __repr__(&self, py: Python<'_>) -> String {
        format!(
            "Item(name={}, dtype={:?}, shape={}, begin={:?})",
            self.name
                .bind(py)
                .repr()
                .map_or_else(|_| "?".into(), |r| r.to_string()),
            self.dtype,
            self.shape.bind(py),
            self.begin
        )
    }
}

/// A load's counters at one moment, and the method and options in force.
#[pyclass(module = "fastload._fastload", frozen, get_all)]
#[derive(Clone)]
pub struct Stats {
    /// Bytes and tensors (or pieces) the plan delivers, and the files it reads.
    pub total_bytes: u64,
    pub tensor_count: usize,
    pub files: usize,
    pub bytes_read: u64,
    pub bytes_delivered: u64,
    pub tensors_delivered: u64,
    /// Milliseconds from the start to the first completed segment.
    pub first_segment_ms: Option<f64>,
    pub method: &'static str,
    /// Why that method: "local filesystem: mapped, no copy", a network filesystem's name, ...
    pub method_reason: String,
    pub concurrency: usize,
    pub block_size: u64,
    pub memory_limit: u64,
    /// `"cuda:N"` or `"host"` for a staged load, `None` otherwise.
    pub target: Option<String>,
    /// A staged load's copy queues (`copy_streams`); `None` for a load that copies nothing.
    pub copy_streams: Option<usize>,
    pub bytes_copied: u64,
    pub staging_peak_bytes: u64,
    /// Page-locked staging memory this load allocated (not reused from earlier loads' cache),
    /// and the wall-clock milliseconds during which some of it was being allocated.
    pub pinned_bytes: u64,
    pub pinned_ms: f64,
    /// Bytes mapped from the page cache without populating (every page was cached already).
    pub bytes_cached: u64,
    /// Staged loads with `method="mmap"`: bytes the device copied from the files' mapped pages
    /// where they are, and why the load stopped lending them (the rest read into staging).
    pub lent_bytes: u64,
    pub lend_refused: Option<String>,
    /// Loads with `method="direct"`: bytes read around the page cache (`O_DIRECT`), and
    /// why the load stopped doing so (the rest read through the page cache).
    pub direct_bytes: u64,
    pub direct_refused: Option<String>,
    /// Where the load's time went, in milliseconds (`pipeline::Stats`): `consumer_wait` for
    /// every load; for staged loads also `read` and `staging_wait` (added up over the reads in
    /// flight), `ring_wait`, `alloc`, `copy`, `copy_idle` and `fence_wait`, and `lend` (mapping
    /// and page-locking lent blocks, added up over the reads in flight) and `unlend` (giving them
    /// back, added up over the release threads).
    pub phases_ms: BTreeMap<&'static str, f64>,
}

impl Stats {
    pub fn of(l: &Control) -> Self {
        let s = l.stats();
        Stats {
            total_bytes: l.totals().total_bytes,
            tensor_count: l.totals().tensor_count,
            files: l.totals().files,
            bytes_read: s.bytes_read.load(Relaxed),
            bytes_delivered: s.bytes_delivered.load(Relaxed),
            tensors_delivered: s.tensors_delivered.load(Relaxed),
            first_segment_ms: l.first_segment_after().map(|t| t.as_secs_f64() * 1e3),
            method: l.method().as_str(),
            method_reason: l.config().method_reason.clone(),
            concurrency: l.config().concurrency,
            block_size: l.config().block_size,
            memory_limit: l.config().memory_limit,
            target: l.engine().map(str::to_owned),
            copy_streams: l.engine().map(|_| l.config().copy_streams),
            bytes_copied: s.bytes_copied.load(Relaxed),
            staging_peak_bytes: s.staging_peak.load(Relaxed),
            pinned_bytes: s.pinned_bytes.load(Relaxed),
            pinned_ms: s.pinned_ns.load(Relaxed) as f64 / 1e6,
            bytes_cached: s.bytes_cached.load(Relaxed),
            lent_bytes: s.lent_bytes.load(Relaxed),
            lend_refused: s.lend_refused.get().cloned(),
            direct_bytes: s.direct_bytes.load(Relaxed),
            direct_refused: s.direct_refused.get().cloned(),
            phases_ms: phases(s),
        }
    }
}

fn phases(s: &crate::pipeline::Stats) -> BTreeMap<&'static str, f64> {
    let ms = |c: &std::sync::atomic::AtomicU64| c.load(Relaxed) as f64 / 1e6;
    BTreeMap::from([
        ("read", ms(&s.read_ns)),
        ("staging_wait", ms(&s.staging_wait_ns)),
        ("ring_wait", ms(&s.ring_wait_ns)),
        ("alloc", ms(&s.alloc_ns)),
        ("copy", ms(&s.copy_ns)),
        ("copy_idle", ms(&s.copy_idle_ns)),
        ("fence_wait", ms(&s.fence_wait_ns)),
        ("lend", ms(&s.lend_ns)),
        ("unlend", ms(&s.unlend_ns)),
        ("consumer_wait", ms(&s.consumer_wait_ns)),
    ])
}

#[pymethods]
impl Stats {
    /// The counters as a `dict` (the shape `fastload.Stream.stats()` returns).
    fn as_dict<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let d = PyDict::new(py);
        macro_rules! put {
            ($($field:ident),*) => { $( d.set_item(stringify!($field), &self.$field)?; )* };
        }
        put!(
            total_bytes,
            tensor_count,
            files,
            bytes_read,
            bytes_delivered,
            tensors_delivered,
            first_segment_ms,
            method,
            method_reason,
            concurrency,
            block_size,
            memory_limit,
            target,
            copy_streams,
            bytes_copied,
            staging_peak_bytes,
            pinned_bytes,
            pinned_ms,
            bytes_cached,
            lent_bytes,
            lend_refused,
            direct_bytes,
            direct_refused,
            phases_ms
        );
        Ok(d)
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        Ok(format!("Stats({})", self.as_dict(py)?.repr()?))
    }
}
