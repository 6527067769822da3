//! Writing safetensors files: [`FileWriter`] takes the tensors' names, dtypes and shapes, says in
//! which order their bytes go (`order`), then takes each tensor's bytes as a buffer (zero-copy: the
//! buffer's owner stays alive until its bytes are written or uploaded) and publishes the file on
//! `finish`. Every wait runs off the GIL, in slices that let Ctrl-C through.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pyo3::prelude::*;

use super::args::{Bytes as ByteCount, MemoryLimit, PartSize, StorageOptions};
use super::tink::{AssociatedDataArg, KeysetArg};
use super::wait::off_thread;
use crate::device::Engine;
use crate::format::Dtype;
use crate::pipeline::save::{DeviceBytes, DeviceSaver};
use crate::sink::{FileWriter as Writer, TensorSpec, WriteOptions};
use crate::Error;

/// A contiguous CPU tensor's memory, kept alive (a reference to the tensor) while Rust holds its
/// bytes: they go to the file or the network without a copy.
struct Held {
    tensor: Option<Py<PyAny>>,
    ptr: usize,
    len: usize,
}

impl AsRef<[u8]> for Held {
    fn as_ref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        #[allow(unsafe_code)]
        // SAFETY: `ptr` and `len` are the data pointer and byte size of a contiguous CPU tensor
        // (checked in `held`), whose storage stays allocated while we hold a reference to the
        // tensor, as long as `self`. Its owner may change the values meanwhile, as with
        // safetensors' own writer.
        unsafe {
            std::slice::from_raw_parts(self.ptr as *const u8, self.len)
        }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        if let Some(tensor) = self.tensor.take() {
            super::gil::attach(move |_| drop(tensor));
        }
    }
}

/// The bytes of `tensor`, a contiguous torch tensor on the CPU.
fn held(tensor: &Bound<'_, PyAny>) -> PyResult<Bytes> {
    let bad = |m: &str| -> PyErr { Error::option("tensors", m.to_string()).into() };
    let device: String = tensor.getattr("device")?.getattr("type")?.extract()?;
    if device != "cpu" {
        return Err(bad(&format!("expected a CPU tensor, got one on {device}")));
    }
    if !tensor.call_method0("is_contiguous")?.extract::<bool>()? {
        return Err(bad("a tensor's bytes are not contiguous"));
    }
    let len: usize = tensor.getattr("nbytes")?.extract()?;
    let ptr: usize = tensor.call_method0("data_ptr")?.extract()?;
    Ok(Bytes::from_owner(Held {
        tensor: Some(tensor.clone().unbind()),
        ptr,
        len,
    }))
}

/// A Python object (a GPU tensor) kept alive while copies read its memory; released with the GIL.
struct Owner(Option<Py<PyAny>>);

impl Drop for Owner {
    fn drop(&mut self) {
        if let Some(obj) = self.0.take() {
            super::gil::attach(move |_| drop(obj));
        }
    }
}

type Shared = Arc<Mutex<Option<Writer>>>;
type Engines = Arc<Mutex<HashMap<usize, Arc<dyn Engine>>>>;

/// One safetensors file being written (see `fastload.save_file`).
#[pyclass(module = "fastload._fastload", frozen)]
pub struct FileWriter {
    inner: Shared,
    order: Vec<usize>,
    uri: String,
    /// Copies GPU tensors out (`write_device`), within `memory_limit`.
    saver: Arc<DeviceSaver>,
    /// One copy engine per CUDA device, opened by the first tensor of that device.
    engines: Engines,
    /// Set once the file is in place: a caller whose `finish` was cut short by Ctrl-C learns
    /// (after `abort`, which waits for it) whether it must remove what it published.
    published: Arc<AtomicBool>,
}

fn options(
    overwrite: bool,
    storage_options: Option<StorageOptions>,
    memory_limit: Option<ByteCount<MemoryLimit>>,
    part_size: Option<ByteCount<PartSize>>,
) -> WriteOptions {
    WriteOptions {
        overwrite,
        storage_options: storage_options.unwrap_or_default().0,
        memory_limit: memory_limit.map(|m| m.0),
        part_size: part_size.map(|p| p.0),
        metadata: Vec::new(),
        encryption: None,
    }
}

/// The encryption `keyset=` and `associated_data=` ask for (none without a keyset; the
/// environment's `FASTLOAD_KEYSET` is for reading and never makes a write encrypted).
pub(crate) fn encryption(
    keyset: Option<KeysetArg>,
    associated_data: Option<AssociatedDataArg>,
) -> crate::Result<Option<crate::sink::Encryption>> {
    match (keyset, associated_data) {
        (None, None) => Ok(None),
        (None, Some(_)) => Err(Error::option(
            "associated_data",
            "given without keyset= (nothing is encrypted)",
        )),
        (Some(k), ad) => {
            crate::sink::Encryption::new(&k.0 .0, ad.as_ref().map(|a| a.0 .0.as_slice()), "keyset")
                .map(Some)
        }
    }
}

/// Runs `f` on the writer off the GIL; a writer already finished or aborted is an error.
fn with_writer<T: Send + 'static>(
    py: Python<'_>,
    inner: &Shared,
    what: &str,
    f: impl FnOnce(&mut Option<Writer>) -> crate::Result<T> + Send + 'static,
) -> PyResult<T> {
    let inner = inner.clone();
    Ok(off_thread(py, what, move || {
        let mut slot = inner.lock().unwrap_or_else(|e| e.into_inner());
        f(&mut slot)
    })??)
}

fn closed(uri: &str) -> Error {
    Error::InvalidTensors {
        uri: uri.to_string(),
        message: "the writer was finished or aborted already".into(),
    }
}

impl Drop for FileWriter {
    /// A writer dropped unfinished aborts (see `crate::sink`), with the GIL released: the parts
    /// it cancels hold tensors, whose release takes the GIL on the runtime's threads. The lock is
    /// taken with the GIL released too: a call cut short by Ctrl-C may still hold it while its
    /// worker aborts the upload, and that abort needs the GIL to release the tensors (holding the
    /// GIL here stalled the drop until the abort gave up, after `ABORT_ON_DROP`).
    fn drop(&mut self) {
        let inner = self.inner.clone();
        Python::attach(|py| {
            super::gil::detach(py, move || {
                let unfinished = inner.lock().unwrap_or_else(|e| e.into_inner()).take();
                drop(unfinished);
            })
        });
    }
}

#[pymethods]
impl FileWriter {
    /// `tensors`: `(name, dtype, shape)` with safetensors dtype names ("F32", "BF16", ...).
    #[new]
    #[pyo3(signature = (uri, tensors, metadata=None, *, overwrite=false, storage_options=None,
                        memory_limit=None, part_size=None, keyset=None, associated_data=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        uri: String,
        tensors: Vec<(String, String, Vec<u64>)>,
        metadata: Option<Vec<(String, String)>>,
        overwrite: bool,
        storage_options: Option<StorageOptions>,
        memory_limit: Option<ByteCount<MemoryLimit>>,
        part_size: Option<ByteCount<PartSize>>,
        keyset: Option<KeysetArg>,
        associated_data: Option<AssociatedDataArg>,
    ) -> PyResult<Self> {
        let mut specs = Vec::with_capacity(tensors.len());
        for (name, dtype, shape) in tensors {
            let dtype = Dtype::parse(&dtype).ok_or_else(|| {
                Error::option(
                    "tensors",
                    format!("tensor {name:?}: unknown safetensors dtype {dtype:?}"),
                )
            })?;
            specs.push(TensorSpec { name, dtype, shape });
        }
        let mut opts = options(overwrite, storage_options, memory_limit, part_size);
        opts.encryption = encryption(keyset, associated_data)?;
        let limit = opts
            .memory_limit
            .unwrap_or(crate::options::DEFAULT_WRITE_MEMORY_LIMIT);
        let shown = crate::store::redact_uri(&uri);
        let writer = off_thread(py, "save_file", move || {
            Writer::create(&uri, &specs, metadata.as_deref(), &opts)
        })??;
        Ok(FileWriter {
            order: writer.order().to_vec(),
            uri: shown,
            saver: Arc::new(DeviceSaver::new(limit, writer.holds_at_most())),
            engines: Arc::default(),
            inner: Arc::new(Mutex::new(Some(writer))),
            published: Arc::default(),
        })
    }

    /// Indices of the tensors given to the constructor, in the order their bytes are written.
    #[getter]
    fn order(&self) -> Vec<usize> {
        self.order.clone()
    }

    /// The destination (credentials left out).
    #[getter]
    fn uri(&self) -> String {
        self.uri.clone()
    }

    /// The bytes of the next tensor in `order`: a contiguous CPU torch tensor (held, not copied).
    fn write(&self, py: Python<'_>, data: &Bound<'_, PyAny>) -> PyResult<()> {
        let bytes = held(data)?;
        let uri = self.uri.clone();
        with_writer(py, &self.inner, "save_file", move |w| {
            w.as_mut().ok_or_else(|| closed(&uri))?.write_tensor(bytes)
        })
    }

    /// The bytes of the next tensor in `order` from CUDA device memory: `nbytes` bytes at device
    /// address `ptr` of device `device`, read once the work queued so far on `stream` (a
    /// `CUstream` handle, 0 for the legacy default stream; None: no wait) is done. They are
    /// copied out block by block into page-locked buffers while earlier blocks are written;
    /// `owner` (the tensor) is held until every copy from it is done.
    #[pyo3(signature = (ptr, nbytes, device, stream, owner))]
    fn write_device(
        &self,
        py: Python<'_>,
        ptr: u64,
        nbytes: u64,
        device: usize,
        stream: Option<u64>,
        owner: Py<PyAny>,
    ) -> PyResult<()> {
        let tensor = DeviceBytes {
            addr: ptr,
            len: nbytes,
            stream,
            owner: Box::new(Owner(Some(owner))),
        };
        let uri = self.uri.clone();
        let (saver, engines) = (self.saver.clone(), self.engines.clone());
        with_writer(py, &self.inner, "save_file", move |w| {
            let w = w.as_mut().ok_or_else(|| closed(&uri))?;
            let engine = {
                let mut engines = engines.lock().unwrap_or_else(|e| e.into_inner());
                match engines.get(&device) {
                    Some(e) => e.clone(),
                    None => {
                        let e = crate::device::engine(&format!("cuda:{device}"))?;
                        engines.insert(device, e.clone());
                        e
                    }
                }
            };
            saver.write(w, engine.as_ref(), tensor)
        })
    }

    /// Bytes per device-to-host copy of `write_device`.
    #[getter]
    fn device_block_size(&self) -> usize {
        self.saver.block_size()
    }

    /// Publishes the file (renamed into place, or the upload completed). With `publish=False`
    /// the file is only made complete and durable (synced under its temporary name, every part
    /// uploaded), for a later `finish()` to publish: a shard set is published once all are.
    #[pyo3(signature = (*, publish=true))]
    fn finish(&self, py: Python<'_>, publish: bool) -> PyResult<()> {
        let uri = self.uri.clone();
        let published = self.published.clone();
        with_writer(py, &self.inner, "save_file", move |w| {
            if !publish {
                return w.as_mut().ok_or_else(|| closed(&uri))?.prepare();
            }
            w.take().ok_or_else(|| closed(&uri))?.finish()?;
            published.store(true, Ordering::SeqCst);
            Ok(())
        })
    }

    /// Whether the file was published (it stays set: removing it is the caller's).
    #[getter]
    fn published(&self) -> bool {
        self.published.load(Ordering::SeqCst)
    }

    /// Gives up: nothing is published, the upload is aborted. Does nothing once finished.
    fn abort(&self, py: Python<'_>) -> PyResult<()> {
        with_writer(py, &self.inner, "save_file", move |w| match w.take() {
            Some(w) => w.abort(),
            None => Ok(()),
        })
    }
}

/// Writes `data` to `uri` whole, published as `FileWriter` publishes (an index file).
#[pyfunction]
#[pyo3(signature = (uri, data, *, overwrite=false, storage_options=None))]
pub fn write_bytes(
    py: Python<'_>,
    uri: String,
    data: Vec<u8>,
    overwrite: bool,
    storage_options: Option<StorageOptions>,
) -> PyResult<()> {
    let opts = options(overwrite, storage_options, None, None);
    Ok(off_thread(py, "write_bytes", move || {
        crate::sink::write_all(&uri, Bytes::from(data), &opts)
    })??)
}

/// Deletes the file or object at `uri`; a missing one is not an error.
#[pyfunction]
#[pyo3(signature = (uri, *, storage_options=None))]
pub fn remove(
    py: Python<'_>,
    uri: String,
    storage_options: Option<StorageOptions>,
) -> PyResult<()> {
    let opts = options(false, storage_options, None, None);
    Ok(off_thread(py, "remove", move || {
        crate::sink::remove(&uri, &opts)
    })??)
}
