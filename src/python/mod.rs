//! The private native module `fastload._fastload`. Python values become owned Rust values first;
//! every wait runs with the GIL released.

use pyo3::prelude::*;
use pyo3::types::PyTuple;

mod args;
mod copy;
mod dlpack;
mod errors;
mod gil;
mod hub;
mod item;
mod names;
mod objects;
mod options;
mod ranks;
mod reader;
mod regions;
mod stream;
mod tink;
mod wait;
mod write;

use crate::format::Dtype;
use crate::options::Size;

/// Parses a byte size ("64MiB", "1.5GB", "4096").
#[pyfunction]
fn parse_size(value: &str) -> PyResult<u64> {
    Ok(value
        .parse::<Size>()
        .map_err(|e| crate::Error::option("size", e))?
        .0)
}

/// Whether `uri` names an object in an object store (its scheme is one of `SCHEMES`), which
/// fastload reads itself; anything else is a local path or `file://` URL.
#[pyfunction]
fn is_remote_uri(uri: &str) -> bool {
    crate::uri::is_remote(uri)
}

/// `text` with every credential fastload knows of (or recognises by its place: a URL's password,
/// a presigned URL's signature) replaced by `***`: what every message of ours goes through.
#[pyfunction]
fn scrub(text: &str) -> String {
    crate::error::scrub(text)
}

/// What the local cache did in this process: `{"hits", "filled_bytes", "published",
/// "disabled_reason"}` (see `crate::source::cache`), once copies being published are published.
#[pyfunction]
fn cache_stats(py: Python<'_>) -> PyResult<Bound<'_, pyo3::types::PyDict>> {
    let s = gil::detach(py, crate::source::cache::stats);
    let out = pyo3::types::PyDict::new(py);
    out.set_item("hits", s.hits)?;
    out.set_item("filled_bytes", s.filled_bytes)?;
    out.set_item("published", s.published)?;
    out.set_item("disabled_reason", s.disabled_reason)?;
    Ok(out)
}

/// Runs the `fastload` command line with `argv` (program name first); returns the exit code.
/// `fastload bench` runs its peers with this interpreter unless told otherwise.
#[pyfunction]
fn cli_main(py: Python<'_>, argv: Vec<String>) -> PyResult<i32> {
    let python: Option<String> = py.import("sys")?.getattr("executable")?.extract().ok();
    wait::off_thread(py, "cli", move || crate::cli::run_in(argv, python))
}

/// The number of CUDA devices; raises `FastloadError` when no driver can be loaded. Loads and
/// initialises the driver on first use, never at import.
#[pyfunction]
fn cuda_device_count(py: Python<'_>) -> PyResult<usize> {
    #[cfg(feature = "cuda")]
    {
        Ok(gil::detach(py, crate::device::cuda::device_count)?)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = py;
        Err(crate::Error::device("CUDA support was not built in").into())
    }
}

/// `{"host": bytes, "pinned": bytes}`, the shape both memory functions return.
fn by_kind(c: crate::device::CachedMemory) -> std::collections::HashMap<&'static str, u64> {
    [("host", c.host), ("pinned", c.pinned)].into()
}

/// Host memory kept by fastload for the next load, in bytes: {"host": ..., "pinned": ...}.
#[pyfunction]
fn cached_memory() -> std::collections::HashMap<&'static str, u64> {
    by_kind(crate::device::cached_memory())
}

/// Gives the host memory kept for the next load back; returns the bytes given back, as
/// `cached_memory`.
#[pyfunction]
fn release_memory(py: Python<'_>) -> std::collections::HashMap<&'static str, u64> {
    by_kind(gil::detach(py, crate::device::release_cached_memory))
}

#[pymodule]
fn _fastload(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", crate::VERSION)?;
    // Facts Python asks instead of copying (tuples: nobody can change them from Python).
    let py = m.py();
    m.add("SCHEMES", PyTuple::new(py, crate::uri::remote_schemes())?)?;
    m.add("DTYPES", PyTuple::new(py, Dtype::ALL.map(Dtype::as_str))?)?;
    m.add("INDEX_FILE", crate::format::INDEX_FILE)?;
    m.add("UNANSWERED", wait::UNANSWERED)?;
    let dlpack: Vec<&str> = Dtype::ALL
        .into_iter()
        .filter(|d| dlpack::native(*d).is_some())
        .map(Dtype::as_str)
        .collect();
    m.add("DLPACK_DTYPES", PyTuple::new(py, dlpack)?)?;
    m.add("OPTIONS", options::option_table(py)?)?;
    // What one more request costs the planner of slices (`Source::read_cost`): by kind.
    m.add("LOCAL_READ_COST", crate::source::LOCAL_READ_COST)?;
    m.add("REMOTE_READ_COST", crate::source::REMOTE_READ_COST)?;
    m.add("MAPPED_READ_COST", crate::source::MAPPED_READ_COST)?;
    m.add_class::<regions::Region>()?;
    m.add_function(wrap_pyfunction!(regions::plan_region, m)?)?;
    m.add_function(wrap_pyfunction!(regions::merge_runs, m)?)?;
    m.add_class::<stream::Stream>()?;
    m.add_class::<item::Item>()?;
    m.add_class::<item::Stats>()?;
    m.add_class::<options::ResolvedOptions>()?;
    m.add_class::<options::PyOptionDef>()?;
    m.add_class::<ranks::RankPlan>()?;
    m.add_class::<reader::Reader>()?;
    m.add_class::<reader::PendingRead>()?;
    m.add_class::<write::FileWriter>()?;
    m.add_function(wrap_pyfunction!(write::write_bytes, m)?)?;
    m.add_function(wrap_pyfunction!(write::remove, m)?)?;
    m.add_function(wrap_pyfunction!(copy::copy, m)?)?;
    m.add_function(wrap_pyfunction!(options::resolve_options, m)?)?;
    m.add_function(wrap_pyfunction!(ranks::checkpoint_tensors, m)?)?;
    m.add_function(wrap_pyfunction!(ranks::plan_ranks, m)?)?;
    m.add_function(wrap_pyfunction!(is_remote_uri, m)?)?;
    m.add_function(wrap_pyfunction!(names::index_files, m)?)?;
    m.add_function(wrap_pyfunction!(names::check_inside, m)?)?;
    m.add_function(wrap_pyfunction!(names::index_json, m)?)?;
    m.add_function(wrap_pyfunction!(hub::parse_hub_uri, m)?)?;
    m.add_function(wrap_pyfunction!(hub::hub_cache_dir, m)?)?;
    m.add_function(wrap_pyfunction!(parse_size, m)?)?;
    m.add_function(wrap_pyfunction!(scrub, m)?)?;
    m.add_function(wrap_pyfunction!(cache_stats, m)?)?;
    m.add_function(wrap_pyfunction!(cli_main, m)?)?;
    m.add_function(wrap_pyfunction!(cuda_device_count, m)?)?;
    m.add_function(wrap_pyfunction!(stream::inspect_json, m)?)?;
    #[cfg(feature = "bench-bindings")]
    m.add_function(wrap_pyfunction!(tink::_tink_decrypt, m)?)?;
    m.add_function(wrap_pyfunction!(objects::list_objects, m)?)?;
    m.add_function(wrap_pyfunction!(objects::fetch_small_file, m)?)?;
    m.add_function(wrap_pyfunction!(objects::prune_small_files, m)?)?;
    m.add_function(wrap_pyfunction!(cached_memory, m)?)?;
    m.add_function(wrap_pyfunction!(release_memory, m)?)?;
    // A daemon thread coming back from a wait of ours after the interpreter began to exit parks
    // (see `gil`): closed by the last atexit handler of ours to run, registered first.
    py.import("atexit")?
        .call_method1("register", (wrap_pyfunction!(gil::close, m)?,))?;
    Ok(())
}
