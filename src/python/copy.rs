//! `fastload.copy`: the Rust copy (`crate::write::copy`) run off the GIL, in slices that let
//! Ctrl-C through (an interrupted copy aborts the files in flight before the KeyboardInterrupt).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{Bytes as ByteCount, MemoryLimit, StorageOptions};
use super::wait::off_thread_cleaning_up;
use crate::write::copy::{self as core, CopyOptions};
use crate::write::WriteOptions;

/// How long an interrupted copy may take to abort the uploads of its files in flight.
const CLEANUP: std::time::Duration = std::time::Duration::from_secs(30);

/// The caller's `exchange` callable, held where the copy's threads reach it and taken back (its
/// reference dropped with the GIL held) by the call that lent it: a reference left to a worker
/// thread would be released only whenever pyo3 next holds the GIL, keeping the process group it
/// captures alive past `destroy_process_group()` into interpreter exit (gloo then aborted the
/// process: "terminate called without an active exception").
type Lent = std::sync::Arc<std::sync::Mutex<Option<Py<PyAny>>>>;

/// The group's all-gather as the copy calls it (from its own thread): `exchange(str) -> list[str]`.
fn all_gather(exchange: Lent) -> core::Exchange {
    std::sync::Arc::new(move |message: String| {
        super::gil::attach(|py| {
            let callable = exchange
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .map(|c| c.clone_ref(py));
            let Some(callable) = callable else {
                return Err(crate::Error::Internal {
                    message: "the copy's exchange between ranks was used after the copy".into(),
                });
            };
            callable
                .call1(py, (message,))
                .and_then(|all| all.extract::<Vec<String>>(py))
                .map_err(|e| crate::Error::Internal {
                    message: format!("the copy's exchange between ranks failed: {e}"),
                })
        })
    })
}

/// Copies `src` to `dst`; returns `{"copied": [...], "skipped": [...], "bytes": n, "stopped":
/// None or why}` for this rank's share. `exchange` (an all-gather of one str per rank) lets the
/// ranks split large files into parts.
#[pyfunction]
#[pyo3(signature = (src, dst, *, overwrite=false, storage_options=None, verify=true,
                    concurrency=None, block_size=None, memory_limit=None, part_size=None,
                    rank=0, world=1, progress=true, keyset=None, associated_data=None,
                    exchange=None))]
#[allow(clippy::too_many_arguments)]
pub fn copy<'py>(
    py: Python<'py>,
    src: String,
    dst: String,
    overwrite: bool,
    storage_options: Option<StorageOptions>,
    verify: bool,
    concurrency: Option<usize>,
    block_size: Option<u64>,
    memory_limit: Option<ByteCount<MemoryLimit>>,
    part_size: Option<u64>,
    rank: usize,
    world: usize,
    progress: bool,
    keyset: Option<super::tink::KeysetArg>,
    associated_data: Option<super::tink::AssociatedDataArg>,
    exchange: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let lent: Option<Lent> = exchange.map(|e| std::sync::Arc::new(std::sync::Mutex::new(Some(e))));
    let options = CopyOptions {
        write: WriteOptions {
            overwrite,
            storage_options: storage_options.unwrap_or_default().0,
            memory_limit: memory_limit.map(|m| m.0),
            part_size,
            metadata: Vec::new(),
            encryption: super::write::encryption(keyset, associated_data)?,
        },
        concurrency: concurrency.unwrap_or(core::DEFAULT_CONCURRENCY),
        block_size: block_size.unwrap_or(core::DEFAULT_BLOCK_SIZE),
        verify,
        rank,
        world,
        progress: if progress {
            crate::cli::copy::progress()
        } else {
            None
        },
        exchange: lent.clone().map(all_gather),
    };
    // On Ctrl-C the files in flight abort their uploads before the KeyboardInterrupt is raised.
    let report = off_thread_cleaning_up(py, "copy", CLEANUP, move || {
        core::copy(&src, &dst, &options)
    });
    if let Some(lent) = lent {
        drop(lent.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
    let report = report??;
    let out = PyDict::new(py);
    out.set_item("copied", report.copied)?;
    out.set_item("skipped", report.skipped)?;
    out.set_item("bytes", report.bytes)?;
    out.set_item("stopped", report.stopped)?;
    Ok(out)
}
