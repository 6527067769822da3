//! The load options as Python gives them, and `resolve_options`: what Python asks when it needs a
//! resolved value (the distributed loader's memory limit) or wants a configuration checked early
//! (the vLLM plugin, at engine start). Environment variables, defaults and bounds stay in
//! `crate::options`; nothing of them is copied into Python.

use pyo3::prelude::*;

use super::args::{
    BlockSize, Bytes, CacheArg, Concurrency, MemoryLimit, MethodArg, Names, StorageOptions,
    VerifyArg,
};
use crate::options::{LoadOptions, Method};

/// The eight native load options (the public API's ninth, `device`, is torch's and stays in
/// Python), each already converted by its `FromPyObject` newtype.
#[allow(clippy::too_many_arguments)]
pub(crate) fn load_options(
    concurrency: Option<Concurrency>,
    block_size: Option<Bytes<BlockSize>>,
    memory_limit: Option<Bytes<MemoryLimit>>,
    names: Option<Names>,
    method: Option<MethodArg>,
    storage_options: Option<StorageOptions>,
    cache: Option<CacheArg>,
    verify: Option<VerifyArg>,
) -> LoadOptions {
    LoadOptions {
        concurrency: concurrency.map(|c| c.0),
        block_size: block_size.map(|b| b.0),
        memory_limit: memory_limit.map(|m| m.0),
        names: names.map(|n| n.0),
        method: method.map_or(Method::Auto, |m| m.0),
        storage_options: storage_options.unwrap_or_default().0,
        parts: None,
        cache: cache.map(|c| c.0),
        verify: verify.map(|v| v.0),
    }
}

/// Options with every value decided: the caller's, else `FASTLOAD_*`, else the default for the
/// source (object stores take more reads in flight), all checked.
#[pyclass(module = "fastload._fastload", frozen, get_all)]
pub struct ResolvedOptions {
    concurrency: usize,
    block_size: u64,
    memory_limit: u64,
    /// `"auto"`, `"mmap"` or `"read"`.
    method: &'static str,
    /// Deduplicated, in the order given; `None` for every tensor.
    names: Option<Vec<String>>,
}

#[pymethods]
impl ResolvedOptions {
    fn __repr__(&self) -> String {
        format!(
            "ResolvedOptions(concurrency={}, block_size={}, memory_limit={}, method={:?})",
            self.concurrency, self.block_size, self.memory_limit, self.method
        )
    }
}

/// Resolves and checks options as a load of `uris` would (without opening anything: `uris` only
/// say whether an object store is read); raises `ConfigError` for a value that cannot be used.
#[pyfunction]
#[pyo3(signature = (uris=Vec::new(), *, concurrency=None, block_size=None, memory_limit=None, names=None, method=None, storage_options=None, cache=None, verify=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn resolve_options(
    uris: Vec<String>,
    concurrency: Option<Concurrency>,
    block_size: Option<Bytes<BlockSize>>,
    memory_limit: Option<Bytes<MemoryLimit>>,
    names: Option<Names>,
    method: Option<MethodArg>,
    storage_options: Option<StorageOptions>,
    cache: Option<CacheArg>,
    verify: Option<VerifyArg>,
) -> PyResult<ResolvedOptions> {
    let opts = load_options(
        concurrency,
        block_size,
        memory_limit,
        names,
        method,
        storage_options,
        cache,
        verify,
    );
    crate::cache::CacheSettings::of(&opts)?;
    let r = opts.resolve(crate::source::any_remote(&uris))?;
    Ok(ResolvedOptions {
        concurrency: r.concurrency,
        block_size: r.block_size,
        memory_limit: r.memory_limit,
        method: r.method.as_str(),
        names: opts.names,
    })
}
