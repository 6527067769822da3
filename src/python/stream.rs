//! `_fastload.Stream`: the pipeline as a Python iterator of completed segments.

use std::sync::{Arc, Mutex, MutexGuard, TryLockError};

use pyo3::prelude::*;
use pyo3::types::{PyList, PyString, PyTuple};

use super::args::{
    BlockSize, Bytes, CacheArg, Concurrency, CopyStreams, MemoryLimit, MethodArg, Names,
    StorageOptions, VerifyArg,
};
use super::dlpack::{self, DLDevice};
use super::errors::raised;
use super::gil;
use super::item::{Item, Stats};
use super::options::load_options;
use super::reader::Reader;
use super::wait::{off_thread, SLICE};
use crate::device::{self, Allocation, Allocator, Destination, PerTensor, Target};
use crate::pipeline::{self, Control, Loaded, Loader, Memory};
use crate::plan::TensorSlot;

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
        gil::attach(|py| -> PyResult<Allocation> {
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

/// A running load. Each `next()` waits (GIL released, in slices so that Ctrl-C raises
/// KeyboardInterrupt within one) for the next completed segment and returns its tensors as a list
/// of [`Item`]s. With `parts` (byte ranges `(name, begin, end)` within tensors, or `(name,
/// region)`: a planned region's reads) only those ranges are read, and each comes back as a U8 item of shape `(len,)` with `begin` set.
///
/// With `target` ("cuda", "cuda:N", or "host" for the same staged pipeline into host memory),
/// blocks go through staging buffers into destination memory: with `allocate` (see
/// `PyAllocator`) the memory it hands out, and each item's `data` is that owner object (e.g. a
/// torch uint8 tensor); without it, memory fastload allocates itself, one allocation per tensor
/// (`cuMemAlloc` for a GPU, host buffers for "host"), and each item's `data` is a `dltensor`
/// capsule (kDLCUDA or kDLCPU) that owns it.
///
/// `stats()` and `close()` never wait for a `next()` in progress on another thread: they use the
/// load's [`Control`], not the loader a `next()` holds. A stream closed before it finished (by
/// `close()` from another thread, or Ctrl-C) raises `StreamClosedError` from `next()`, never a
/// plain end.
///
/// Threads may share a stream: `next()` calls take turns at the loader, and each segment goes to
/// exactly one of them. A load that failed raises its error to every later `next()`, on any
/// thread, so that no consumer mistakes it for the end. A process forked after the stream was
/// opened cannot use it (its reads run on the parent's threads): `next()` there raises
/// [`crate::Error::Forked`], and the parent's load is left alone (never dropped there).
#[pyclass(module = "fastload._fastload")]
pub struct Stream {
    /// Held by `next()` through its wait.
    feed: Mutex<Feed>,
    control: Arc<Control>,
    /// The counters as `close()` left them.
    closed: Mutex<Option<Stats>>,
    /// Where fastload-allocated destinations are (a staged load without `allocate`).
    placed: DLDevice,
    /// The process that opened it.
    opened_in: u32,
}

/// Where `next()` takes segments from.
enum Feed {
    Open(Loader),
    /// Every tensor delivered, or closed (then `Control::closed`); its buffers are gone.
    Ended,
    /// The load failed: raised again to every later `next()`.
    Failed(Arc<crate::Error>),
}

/// One turn at the feed: `None` when nothing came within a slice.
type Step = Option<Result<Option<Loaded>, Arc<crate::Error>>>;

#[pymethods]
impl Stream {
    // boilerplate: pyo3 takes each keyword argument as a parameter of its own (the load options,
    // as `resolve_options` and `Reader` take them)
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (uris, *, concurrency=None, block_size=None, memory_limit=None, names=None, method=None, copy_streams=None, storage_options=None, cache=None, verify=None, keyset=None, associated_data=None, peers=None, peer_token=None, parts=None, target=None, allocate=None, reader=None))]
    fn new(
        py: Python<'_>,
        uris: Vec<String>,
        concurrency: Option<Concurrency>,
        block_size: Option<Bytes<BlockSize>>,
        memory_limit: Option<Bytes<MemoryLimit>>,
        names: Option<Names>,
        method: Option<MethodArg>,
        copy_streams: Option<CopyStreams>,
        storage_options: Option<StorageOptions>,
        cache: Option<CacheArg>,
        verify: Option<VerifyArg>,
        keyset: Option<super::tink::KeysetArg>,
        associated_data: Option<super::tink::AssociatedDataArg>,
        peers: Option<super::args::PeersArg>,
        peer_token: Option<super::args::PeerTokenArg>,
        parts: Option<super::regions::PartRanges>,
        target: Option<String>,
        allocate: Option<Py<PyAny>>,
        reader: Option<PyRef<'_, Reader>>,
    ) -> PyResult<Self> {
        let mut opts = load_options(
            concurrency,
            block_size,
            memory_limit,
            names,
            method,
            copy_streams,
            storage_options,
            cache,
            verify,
            keyset,
            associated_data,
        );
        opts.parts = parts.map(|p| p.0);
        super::args::set_peers(&mut opts, peers, peer_token);
        if let Some(reader) = reader {
            // A safe_open handle's load: its files as it opened them, each read pinned to the
            // version it saw then (`uris` named them for the handle, and are not opened again).
            let (shards, remote) = reader.opened();
            let loader = off_thread(py, "open", move || {
                let target = match (target, allocate) {
                    (None, None) => None,
                    (Some(target), Some(allocate)) => {
                        let engine = device::engine(&target)?;
                        let allocator = Box::new(PyAllocator { allocate });
                        Some(Target { engine, allocator })
                    }
                    (Some(target), None) => {
                        let Target { engine, allocator } = device::rust_target(&target)?;
                        let allocator = Box::new(PerTensor(allocator));
                        Some(Target { engine, allocator })
                    }
                    (None, Some(_)) => return Err(no_target()),
                };
                pipeline::open_opened(shards, remote, &opts, target)
            })??;
            return Ok(Stream::around(loader));
        }
        let loader = match (target, allocate) {
            // Local files on a local filesystem open in microseconds (no server to wait for,
            // nothing Ctrl-C would have to cut short): on this thread, not one started for it.
            (None, None) if opens_here(&uris) => {
                Ok(gil::detach(py, || pipeline::open(&uris, &opts)))
            }
            (None, None) => off_thread(py, "open", move || pipeline::open(&uris, &opts)),
            (Some(target), Some(allocate)) => off_thread(py, "open", move || {
                let engine = device::engine(&target)?;
                let allocator = Box::new(PyAllocator { allocate });
                pipeline::open_staged(&uris, &opts, Target { engine, allocator })
            }),
            (Some(target), None) => off_thread(py, "open", move || {
                let Target { engine, allocator } = device::rust_target(&target)?;
                let allocator = Box::new(PerTensor(allocator));
                pipeline::open_staged(&uris, &opts, Target { engine, allocator })
            }),
            (None, Some(_)) => Err(no_target().into()),
        }??;
        Ok(Stream::around(loader))
    }

    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<PyList>>> {
        self.in_its_process()?;
        let next = loop {
            let step = gil::detach(py, || self.step());
            match step {
                Some(next) => break next,
                None => {
                    if let Err(interrupt) = py.check_signals() {
                        // Ctrl-C (or another signal's exception): stop reading, free the
                        // buffers, and let the exception through.
                        self.stop(py);
                        return Err(interrupt);
                    }
                }
            }
        };
        match next {
            Err(failed) => Err(raised(py, &failed)),
            Ok(None) if self.control.closed() => Err(self.control.closed_error().into()),
            Ok(None) => Ok(None),
            Ok(Some(loaded)) => Ok(Some(self.items(py, loaded)?)),
        }
    }

    /// Stops reading and frees buffers that no tensor uses; from any thread, without waiting for
    /// a `next()` in progress (which then raises `StreamClosedError`, unless the load had
    /// finished). In a forked child it does nothing: the load is the parent's.
    fn close(&self, py: Python<'_>) {
        if self.in_its_process().is_err() {
            return;
        }
        {
            let mut closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
            if closed.is_none() {
                *closed = Some(Stats::of(&self.control));
            }
        }
        self.stop(py);
    }

    /// The counters so far; once closed, as they were when it closed.
    fn stats(&self) -> Option<Stats> {
        let closed = self.closed.lock().unwrap_or_else(|e| e.into_inner());
        Some(closed.clone().unwrap_or_else(|| Stats::of(&self.control)))
    }
}

/// The error of `allocate` without a target.
fn no_target() -> crate::Error {
    crate::Error::option(
        "allocate",
        "allocate needs a target (\"cuda\", \"cuda:N\" or \"host\")",
    )
}

impl Stream {
    /// The stream of a started load.
    fn around(loader: Loader) -> Stream {
        let placed = DLDevice::of_engine(loader.engine().unwrap_or("host"));
        Stream {
            control: loader.control().clone(),
            feed: Mutex::new(Feed::Open(loader)),
            closed: Mutex::new(None),
            placed,
            opened_in: std::process::id(),
        }
    }

    fn in_its_process(&self) -> crate::Result<()> {
        if std::process::id() == self.opened_in {
            Ok(())
        } else {
            Err(crate::Error::Forked {
                what: "stream".into(),
                verb: "iterate",
                opened_in: self.opened_in,
            })
        }
    }

    /// One wait of at most a slice for the next segment (GIL released; threads take turns).
    fn step(&self) -> Step {
        let mut feed = self.feed.lock().unwrap_or_else(|e| e.into_inner());
        let loader = match &mut *feed {
            Feed::Open(loader) => loader,
            Feed::Ended => return Some(Ok(None)),
            Feed::Failed(e) => return Some(Err(e.clone())),
        };
        match loader.next_segment_within(SLICE)? {
            Some(Ok(loaded)) => Some(Ok(Some(loaded))),
            // Ended: its buffers go now, not when the stream object does.
            None => {
                *feed = Feed::Ended;
                Some(Ok(None))
            }
            Some(Err(e)) => {
                let e = Arc::new(e);
                *feed = Feed::Failed(e.clone());
                Some(Err(e))
            }
        }
    }

    /// Closes the load and frees its buffers, unless a `next()` on another thread holds the
    /// loader: that one sees the close within a slice and ends the load itself.
    fn stop(&self, py: Python<'_>) {
        self.control.close();
        let open = match self.feed.try_lock() {
            Ok(mut feed) => take_open(&mut feed),
            Err(TryLockError::Poisoned(e)) => take_open(&mut e.into_inner()),
            Err(TryLockError::WouldBlock) => None,
        };
        gil::detach(py, || drop(open));
    }

    /// The items of a segment: views of its host buffer, the allocator's owner objects, or
    /// capsules owning fastload-allocated destinations.
    fn items(&self, py: Python<'_>, loaded: Loaded) -> PyResult<Py<PyList>> {
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
                    let Destination { addr, owner } =
                        it.next().expect("one destination per tensor");
                    match owner.downcast::<Py<PyAny>>() {
                        Ok(owner) => *owner,
                        // SAFETY: the allocator's memory for this tensor, `t.len` bytes at
                        // `addr` on the load's device, kept alive by `owner`.
                        #[allow(unsafe_code)]
                        Err(owner) => unsafe {
                            dlpack::capsule_of(
                                py,
                                addr,
                                self.placed,
                                owner,
                                t.len,
                                t.dtype,
                                &t.shape,
                            )?
                        },
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
        Ok(items.unbind())
    }
}

/// The loader of an open feed, which is then ended.
fn take_open(feed: &mut MutexGuard<'_, Feed>) -> Option<Loader> {
    match std::mem::replace(&mut **feed, Feed::Ended) {
        Feed::Open(loader) => Some(loader),
        other => {
            **feed = other;
            None
        }
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.in_its_process().is_err() {
            // A forked child: the load's threads are the parent's, and dropping it could wait on
            // them or on locks they held at the fork. Leaked, once per stream and child.
            let feed = self.feed.get_mut().unwrap_or_else(|e| e.into_inner());
            std::mem::forget(std::mem::replace(feed, Feed::Ended));
        }
    }
}

/// Whether a load of `uris` is opened on the caller's thread: a few plain files (no
/// `scheme://`, no directory or index, which may name a thousand shards) on local filesystems,
/// whose headers are a few local reads that never wait on a network. Anything else is opened
/// off-thread, so that Ctrl-C still interrupts it.
fn opens_here(uris: &[String]) -> bool {
    uris.len() <= OPENED_HERE
        && uris.iter().all(|u| {
            let path = std::path::Path::new(u);
            !u.contains("://")
                && path.extension().is_none_or(|e| e != "json")
                && path.is_file()
                && crate::source::fs::remote_filesystem(path).is_none()
        })
}

/// The most files [`opens_here`] opens on the caller's thread.
const OPENED_HERE: usize = 8;

/// What the URIs hold, from their headers alone (no tensor data read): the JSON object of
/// `fastload inspect --json`, which `fastload.inspect` parses, so that the two have one shape.
#[pyfunction]
#[pyo3(signature = (uris, *, storage_options=None, keyset=None, associated_data=None))]
pub fn inspect_json(
    py: Python<'_>,
    uris: Vec<String>,
    storage_options: Option<StorageOptions>,
    keyset: Option<super::tink::KeysetArg>,
    associated_data: Option<super::tink::AssociatedDataArg>,
) -> PyResult<String> {
    let decryption = super::tink::decryption(keyset, associated_data)?;
    let storage_options = storage_options.unwrap_or_default().0;
    let shards = off_thread(py, "inspect", move || {
        crate::source::open::open_all(
            &uris,
            &storage_options,
            &crate::source::cache::CacheSettings::off(),
            &decryption,
        )
    })??;
    Ok(crate::cli::inspect_json(&shards))
}
