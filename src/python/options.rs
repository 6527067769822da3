//! The load options as Python gives them, and `resolve_options`: what Python asks when it needs a
//! resolved value (the distributed loader's memory limit) or wants a configuration checked early
//! (the vLLM plugin, at engine start). Environment variables, defaults and bounds stay in
//! `crate::options`; nothing of them is copied into Python.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

use super::args::{
    BlockSize, Bytes, CacheArg, Concurrency, CopyStreams, MemoryLimit, MethodArg, Names,
    StorageOptions, VerifyArg,
};
use super::tink::{AssociatedDataArg, KeysetArg};
use crate::options::{LoadOptions, Method, OptionDef, OPTIONS};

/// One row of `_fastload.OPTIONS` ([`crate::options::OPTIONS`]), from which `fastload._options`
/// builds the signatures and the engines' extra-config keys.
#[pyclass(module = "fastload._fastload", name = "OptionDef", frozen)]
pub struct PyOptionDef(&'static OptionDef);

// boilerplate: one getter a field, as pyo3 exposes a field to Python
#[pymethods]
impl PyOptionDef {
    #[getter]
    fn name(&self) -> &'static str {
        self.0.name
    }
    #[getter]
    #[pyo3(name = "type")]
    fn python_type(&self) -> &'static str {
        self.0.python_type
    }
    #[getter]
    fn signature_default(&self) -> Option<&'static str> {
        self.0.signature_default
    }
    #[getter]
    fn default(&self) -> &'static str {
        self.0.default
    }
    #[getter]
    fn env(&self) -> Option<&'static str> {
        self.0.env
    }
    #[getter]
    fn help(&self) -> &'static str {
        self.0.help
    }
    /// The names of the [`crate::options::Taker`]s that take it.
    #[getter]
    fn takes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyTuple>> {
        PyTuple::new(py, self.0.takers.iter().map(|t| t.as_str()))
    }
    fn __repr__(&self) -> String {
        format!("OptionDef(name='{}')", self.0.name)
    }
}

/// `_fastload.OPTIONS`: every row of [`OPTIONS`], in order.
pub(crate) fn option_table(py: Python<'_>) -> PyResult<Bound<'_, PyTuple>> {
    let rows = OPTIONS
        .iter()
        .map(|o| Bound::new(py, PyOptionDef(o)))
        .collect::<PyResult<Vec<_>>>()?;
    PyTuple::new(py, rows)
}

/// The native load options (`Taker::Native` in [`OPTIONS`]; `device` is torch's and stays in
/// Python), each already converted by its `FromPyObject` newtype. A new one is a parameter here,
/// in the `#[pyo3(signature)]`s of `resolve_options` and `Stream::new` (and `Reader::new` where
/// it takes it), and a `LoadOptions` field: `tests/test_options.py` checks each signature.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_options(
    concurrency: Option<Concurrency>,
    block_size: Option<Bytes<BlockSize>>,
    memory_limit: Option<Bytes<MemoryLimit>>,
    names: Option<Names>,
    method: Option<MethodArg>,
    copy_streams: Option<CopyStreams>,
    storage_options: Option<StorageOptions>,
    cache: Option<CacheArg>,
    verify: Option<VerifyArg>,
    keyset: Option<KeysetArg>,
    associated_data: Option<AssociatedDataArg>,
) -> LoadOptions {
    LoadOptions {
        concurrency: concurrency.map(|c| c.0),
        block_size: block_size.map(|b| b.0),
        memory_limit: memory_limit.map(|m| m.0),
        names: names.map(|n| n.0),
        method: method.map_or(Method::Auto, |m| m.0),
        copy_streams: copy_streams.map(|c| c.0),
        storage_options: storage_options.unwrap_or_default().0,
        parts: None,
        cache: cache.map(|c| c.0),
        verify: verify.map(|v| v.0),
        keyset: keyset.map(|k| k.0),
        associated_data: associated_data.map(|a| a.0),
        peers: None,
        peer_token: None,
    }
}

/// Options with every value decided: the caller's, else `FASTLOAD_*`, else the default for the
/// source (object stores take more reads in flight), all checked.
#[pyclass(module = "fastload._fastload", frozen, get_all)]
pub struct ResolvedOptions {
    concurrency: usize,
    block_size: u64,
    memory_limit: u64,
    /// `"auto"`, `"mmap"`, `"read"` or `"direct"`.
    method: &'static str,
    /// Copy queues of a GPU load.
    copy_streams: usize,
    /// Deduplicated, in the order given; `None` for every tensor.
    names: Option<Vec<String>>,
}

#[pymethods]
impl ResolvedOptions {
    fn __repr__(&self) -> String {
        format!(
            "ResolvedOptions(concurrency={}, block_size={}, memory_limit={}, method={:?}, \
             copy_streams={})",
            self.concurrency, self.block_size, self.memory_limit, self.method, self.copy_streams
        )
    }
}

/// Resolves and checks options as a load of `uris` would (without opening anything: `uris` only
/// say whether an object store is read); raises `ConfigError` for a value that cannot be used.
// boilerplate: pyo3 takes each keyword argument as a parameter of its own: the load options,
// as `Stream` and `Reader` take them too
#[pyfunction]
#[pyo3(signature = (uris=Vec::new(), *, concurrency=None, block_size=None, memory_limit=None, names=None, method=None, copy_streams=None, storage_options=None, cache=None, verify=None, keyset=None, associated_data=None, peers=None, peer_token=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve_options(
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
    keyset: Option<KeysetArg>,
    associated_data: Option<AssociatedDataArg>,
    peers: Option<super::args::PeersArg>,
    peer_token: Option<super::args::PeerTokenArg>,
) -> PyResult<ResolvedOptions> {
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
    super::args::set_peers(&mut opts, peers, peer_token);
    crate::source::cache::CacheSettings::for_load(&opts)?;
    // A keyset that cannot be read fails here, at engine start, naming the option.
    crate::source::decrypt::Decryption::for_load(&opts)?;
    let r = opts.resolve(crate::uri::any_remote(&uris))?;
    Ok(ResolvedOptions {
        concurrency: r.concurrency,
        block_size: r.block_size,
        memory_limit: r.memory_limit,
        method: r.method.as_str(),
        copy_streams: r.copy_streams,
        names: opts.names,
    })
}
