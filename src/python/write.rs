//! Writing safetensors files: [`FileWriter`] takes the tensors' names, dtypes and shapes, says in
//! which order their bytes go (`order`), then takes each tensor's bytes as a buffer (zero-copy: the
//! buffer's owner stays alive until its bytes are written or uploaded) and publishes the file on
//! `finish`. Every wait runs off the GIL, in slices that let Ctrl-C through.

use std::sync::{Arc, Mutex};

use bytes::Bytes;
use pyo3::prelude::*;

use super::args::{Bytes as ByteCount, MemoryLimit, StorageOptions};
use super::wait::off_thread;
use crate::format::Dtype;
use crate::write::{FileWriter as Writer, TensorSpec, WriteOptions};
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

type Shared = Arc<Mutex<Option<Writer>>>;

/// One safetensors file being written (see `fastload.save_file`).
#[pyclass(module = "fastload._fastload", frozen)]
pub struct FileWriter {
    inner: Shared,
    order: Vec<usize>,
    uri: String,
}

fn options(
    overwrite: bool,
    storage_options: Option<StorageOptions>,
    memory_limit: Option<ByteCount<MemoryLimit>>,
    part_size: Option<u64>,
) -> WriteOptions {
    WriteOptions {
        overwrite,
        storage_options: storage_options.unwrap_or_default().0,
        memory_limit: memory_limit.map(|m| m.0),
        part_size,
        metadata: Vec::new(),
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
    /// A writer dropped unfinished aborts (see `crate::write`), with the GIL released: the parts
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
                        memory_limit=None, part_size=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        uri: String,
        tensors: Vec<(String, String, Vec<u64>)>,
        metadata: Option<Vec<(String, String)>>,
        overwrite: bool,
        storage_options: Option<StorageOptions>,
        memory_limit: Option<ByteCount<MemoryLimit>>,
        part_size: Option<u64>,
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
        let opts = options(overwrite, storage_options, memory_limit, part_size);
        let shown = crate::source::object::redact_uri(&uri);
        let writer = off_thread(py, "save_file", move || {
            Writer::create(&uri, &specs, metadata.as_deref(), &opts)
        })??;
        Ok(FileWriter {
            order: writer.order().to_vec(),
            uri: shown,
            inner: Arc::new(Mutex::new(Some(writer))),
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

    /// Publishes the file (renamed into place, or the upload completed).
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let uri = self.uri.clone();
        with_writer(py, &self.inner, "save_file", move |w| {
            w.take().ok_or_else(|| closed(&uri))?.finish()
        })
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
        crate::write::write_all(&uri, Bytes::from(data), &opts)
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
        crate::write::remove(&uri, &opts)
    })??)
}
