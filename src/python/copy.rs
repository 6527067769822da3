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

/// Copies `src` to `dst`; returns `{"copied": [...], "skipped": [...], "bytes": n}` for this
/// rank's share.
#[pyfunction]
#[pyo3(signature = (src, dst, *, overwrite=false, storage_options=None, verify=true,
                    concurrency=None, block_size=None, memory_limit=None, part_size=None,
                    rank=0, world=1, progress=true, keyset=None, associated_data=None))]
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
) -> PyResult<Bound<'py, PyDict>> {
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
    };
    // On Ctrl-C the files in flight abort their uploads before the KeyboardInterrupt is raised.
    let report = off_thread_cleaning_up(py, "copy", CLEANUP, move || {
        core::copy(&src, &dst, &options)
    })??;
    let out = PyDict::new(py);
    out.set_item("copied", report.copied)?;
    out.set_item("skipped", report.skipped)?;
    out.set_item("bytes", report.bytes)?;
    Ok(out)
}
