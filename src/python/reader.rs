//! `_fastload.Reader`: files opened once (sources and validated headers), then reads of chosen
//! byte ranges of them into fresh host buffers (`crate::ranges`). `fastload.safe_open` keeps one
//! for its life and reads each tensor, or the rows of a slice, through it.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyTuple};

use super::args::{BlockSize, Bytes, CacheArg, Concurrency, StorageOptions, VerifyArg};
use super::dlpack;
use super::options::load_options;
use super::wait::{self, off_thread};
use crate::format::Dtype;
use crate::source::Shard;

/// The largest span [`Reader::map`] maps on the calling thread (GIL released) rather than on a
/// thread of its own: 32 MiB, a few milliseconds from the page cache.
const MAP_HERE: u64 = 32 << 20;

#[pyclass(module = "fastload._fastload", frozen)]
pub struct Reader {
    shards: Vec<Shard>,
    /// Some file is read over the network (the options' defaults differ).
    remote: bool,
    /// Reads in flight and bytes per read, resolved as a load of the same URIs resolves them.
    #[pyo3(get)]
    concurrency: usize,
    #[pyo3(get)]
    block_size: u64,
    /// Bytes read and reads issued by every `read` so far.
    counts: Arc<Counts>,
    /// The process that opened the files: a forked child cannot read remote ones (`read`).
    opened_in: u32,
}

impl Reader {
    /// The files as they were opened (each source pinned to the version seen then), and
    /// whether some are remote: a load over them (`Stream(..., reader=)`) reads those versions.
    pub(super) fn opened(&self) -> (Vec<Shard>, bool) {
        (self.shards.clone(), self.remote)
    }
}

/// Bytes read and reads issued, over every read of a [`Reader`] (and its [`PendingRead`]s).
#[derive(Default)]
struct Counts {
    bytes: AtomicU64,
    reads: AtomicU64,
}

impl Counts {
    fn add(&self, done: crate::ranges::Done) {
        self.bytes.fetch_add(done.bytes, Relaxed);
        self.reads.fetch_add(done.reads, Relaxed);
    }
}

/// What a read started by `Reader.read_later` sends back.
type ReadOut = crate::Result<(crate::memory::HostBuffer, crate::ranges::Done)>;

/// A read started by `Reader.read_later`: `wait()` for its bytes.
#[pyclass(module = "fastload._fastload", frozen)]
pub struct PendingRead {
    /// Taken by the first `wait`.
    rx: Mutex<Option<Receiver<ReadOut>>>,
}

#[pymethods]
impl PendingRead {
    /// The bytes read, as `Reader.read` gives them (a flat uint8 `dltensor` capsule), once they
    /// are in; the read's error if it failed. Waits with the GIL released, Ctrl-C honoured (the
    /// read goes on, its result dropped). Once only.
    fn wait(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let Some(mut rx) = self.rx.lock().map(|mut r| r.take()).unwrap_or(None) else {
            return Err(crate::Error::Internal {
                message: "read_later: waited for twice".into(),
            }
            .into());
        };
        let Some(out) = wait::recv(py, &mut rx)? else {
            return Err(wait::panicked("read_later"));
        };
        let (buffer, _) = out?;
        let len = buffer.len() as u64;
        dlpack::capsule(py, &Arc::new(buffer), 0, len, Dtype::U8, &[len])
    }
}

impl Reader {
    /// A remote source's connections are driven by the runtime of the process that opened it:
    /// in a forked child a request would wait for them until it timed out. Local files read as
    /// well in a child as anywhere.
    fn check_process(&self, s: &Shard) -> PyResult<()> {
        if s.local_path().is_none() && std::process::id() != self.opened_in {
            return Err(crate::Error::Forked {
                what: format!("remote file {}", s.source.name()),
                verb: "read",
                opened_in: self.opened_in,
            }
            .into());
        }
        Ok(())
    }

    fn shard(&self, shard: usize) -> PyResult<&Shard> {
        self.shards.get(shard).ok_or_else(|| {
            crate::Error::option(
                "shard",
                format!("no file {shard}: {} are open", self.shards.len()),
            )
            .into()
        })
    }
}

#[pymethods]
impl Reader {
    // boilerplate: pyo3 takes each keyword argument as a parameter of its own (the load options
    // a Reader takes, as `resolve_options` and `Stream` take them)
    #[new]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (uris, *, concurrency=None, block_size=None, storage_options=None, cache=None, verify=None, keyset=None, associated_data=None, peers=None, peer_token=None))]
    fn new(
        py: Python<'_>,
        uris: Vec<String>,
        concurrency: Option<Concurrency>,
        block_size: Option<Bytes<BlockSize>>,
        storage_options: Option<StorageOptions>,
        cache: Option<CacheArg>,
        verify: Option<VerifyArg>,
        keyset: Option<super::tink::KeysetArg>,
        associated_data: Option<super::tink::AssociatedDataArg>,
        peers: Option<super::args::PeersArg>,
        peer_token: Option<super::args::PeerTokenArg>,
    ) -> PyResult<Self> {
        let mut opts = load_options(
            concurrency,
            block_size,
            None,
            None,
            None,
            None,
            storage_options,
            cache,
            verify,
            keyset,
            associated_data,
        );
        super::args::set_peers(&mut opts, peers, peer_token);
        let remote = crate::uri::any_remote(&uris);
        let resolved = opts.resolve(remote)?;
        let mut cache = crate::source::cache::CacheSettings::for_load(&opts)?;
        // Ranges of an object are read, never the whole: copies are read, none is written;
        // except with verify, where each file with a digest is read whole once before anything
        // is served from it (`ranges::verify_whole`), and that read fills its copy.
        cache.fill = cache.verify;
        let (block, concurrency) = (resolved.block_size, resolved.concurrency);
        let decryption = crate::source::decrypt::Decryption::for_load(&opts)?;
        let shards = off_thread(py, "open", move || {
            let mut shards =
                crate::source::open::open_all(&uris, &opts.storage_options, &cache, &decryption)?;
            if cache.verify {
                crate::ranges::verify_whole(&mut shards, &cache, block, concurrency)?;
            }
            Ok::<_, crate::Error>(shards)
        })??;
        Ok(Reader {
            shards,
            remote,
            concurrency: resolved.concurrency,
            block_size: resolved.block_size,
            counts: Arc::default(),
            opened_in: std::process::id(),
        })
    }

    /// Each file's header (`{file, size, tensors: [(name, dtype, shape, begin, end)], metadata}`)
    /// plus `data_start` (the file offset tensor offsets count from), `version` (the version
    /// opened, a string; `None` where the source tells none) and `read_cost`; `metadata` is `None` when
    /// the header has no `__metadata__`, as
    /// `safetensors.safe_open(...).metadata()` tells it apart from `{}`.
    fn headers<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let out = PyList::empty(py);
        for s in &self.shards {
            let d = header_dict(py, s)?;
            d.set_item("data_start", s.header.data_start)?;
            d.set_item("metadata", s.header.metadata.clone())?;
            // The version opened (`Source::version`): ranks compare it before an exchange.
            d.set_item("version", s.source.version())?;
            // What one more request costs (`Source::read_cost`): slices plan their runs by it.
            d.set_item("read_cost", s.source.read_cost())?;
            out.append(d)?;
        }
        Ok(out)
    }

    /// Reads `ranges` (`(file offset, len)`) of file `shard` one after the other into a new
    /// buffer; returns it as a flat uint8 `dltensor` capsule. Reads nothing outside the ranges.
    fn read(&self, py: Python<'_>, shard: usize, ranges: Vec<(u64, u64)>) -> PyResult<Py<PyAny>> {
        let s = self.shard(shard)?;
        self.check_process(s)?;
        let (source, block, concurrency) = (s.source.clone(), self.block_size, self.concurrency);
        let (buffer, done) = off_thread(py, "read", move || {
            crate::ranges::read(source, &ranges, block, concurrency)
        })??;
        self.counts.add(done);
        let len = buffer.len() as u64;
        dlpack::capsule(py, &Arc::new(buffer), 0, len, Dtype::U8, &[len])
    }

    /// `read`, started now and finished without the caller: the reads run on a thread of their
    /// own, which never takes the GIL, and `PendingRead.wait()` gives the capsule. Read-ahead
    /// starts many of these from one thread (Python threads doing the same would queue for the
    /// GIL as each read ends). Ranges outside the file are refused here, before anything runs.
    fn read_later(&self, shard: usize, ranges: Vec<(u64, u64)>) -> PyResult<PendingRead> {
        let s = self.shard(shard)?;
        self.check_process(s)?;
        crate::ranges::reads(&ranges, s.size, self.block_size, &s.name)?;
        let (source, block, concurrency) = (s.source.clone(), self.block_size, self.concurrency);
        let counts = self.counts.clone();
        let (tx, rx) = sync_channel(1);
        wait::spawn("read-later", move || {
            let out = crate::ranges::read(source, &ranges, block, concurrency);
            if let Ok((_, done)) = &out {
                counts.add(*done);
            }
            let _ = tx.send(out);
        })?;
        Ok(PendingRead {
            rx: Mutex::new(Some(rx)),
        })
    }

    /// `len` bytes at file offset `offset` of file `shard` without a copy: a private mapping of
    /// them (writes stay in this process), its pages faulted in and the file checked unchanged
    /// (a file cut short is an error here, never a fault later on), as a flat uint8 `dltensor`
    /// capsule; `None` where the file cannot be mapped (object stores, encrypted files), to be
    /// read instead. Counted as read.
    fn map(
        &self,
        py: Python<'_>,
        shard: usize,
        offset: u64,
        len: u64,
    ) -> PyResult<Option<Py<PyAny>>> {
        let s = self.shard(shard)?;
        if offset.checked_add(len).is_none_or(|end| end > s.size) {
            return Err(crate::Error::option(
                "offset",
                format!(
                    "{len} bytes at {offset} lie outside {} ({} bytes)",
                    s.name, s.size
                ),
            )
            .into());
        }
        let (source, name) = (s.source.clone(), s.name.clone());
        let work = move || {
            let Some(mapped) = source.map(offset, len as usize) else {
                return Ok(None);
            };
            let buffer = mapped?;
            buffer.populate(0, len as usize, &name)?;
            source.check_unchanged()?;
            Ok::<_, crate::Error>(Some(buffer))
        };
        // A small span is mapped here with the GIL released: handing it to a thread of its own
        // cost more than the mapping (a thread to start and be scheduled, 3-4 ms where torch's
        // copy threads still spin on a 2-core host). A large one, whose pages may come from a
        // slow disk, on a thread, so that Ctrl-C is honoured while it waits.
        let mapped = if len <= MAP_HERE {
            super::gil::detach(py, work)
        } else {
            off_thread(py, "map", work)?
        }?;
        let Some(buffer) = mapped else {
            return Ok(None);
        };
        self.counts.add(crate::ranges::Done {
            bytes: len,
            reads: 1,
        });
        dlpack::capsule(py, &Arc::new(buffer), 0, len, Dtype::U8, &[len]).map(Some)
    }

    /// Bytes read by every `read` so far.
    #[getter]
    fn bytes_read(&self) -> u64 {
        self.counts.bytes.load(Relaxed)
    }

    /// Reads issued (requests, for object stores) by every `read` so far.
    #[getter]
    fn reads(&self) -> u64 {
        self.counts.reads.load(Relaxed)
    }
}

/// One file's header for `Reader.headers` (`safe_open`): `{file, size, tensors: [(name, dtype,
/// shape, begin, end)], metadata}`.
fn header_dict<'py>(py: Python<'py>, s: &crate::source::Shard) -> PyResult<Bound<'py, PyDict>> {
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
    // No `__metadata__` reads as empty here (`Reader::headers` tells the two apart).
    d.set_item("metadata", s.header.metadata.clone().unwrap_or_default())?;
    Ok(d)
}
