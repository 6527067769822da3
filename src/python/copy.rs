//! `fastload.copy`: the Rust copy (`crate::copy`) run off the GIL, in slices that let
//! Ctrl-C through (an interrupted copy aborts the files in flight before the KeyboardInterrupt).

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{
    BlockSize, Bytes as ByteCount, Concurrency, MemoryLimit, Overwrite, PartSize, StorageOptions,
    Switch,
};
use super::wait::{off_thread_serving, Ask};
use crate::copy::{self as core, CopyOptions};
use crate::sink::WriteOptions;

/// How long an interrupted copy may take to abort the uploads of its files in flight.
const CLEANUP: std::time::Duration = std::time::Duration::from_secs(30);

/// A question from the copy's thread for the calling thread: this rank's message for the
/// all-gather; the answer is every rank's, or why the exchange failed.
type Gathered = Result<Vec<String>, String>;

/// Runs the caller's `exchange(message) -> list[str]` (on the calling thread, GIL held): an
/// ordinary Python exception is the answer's error; a KeyboardInterrupt or SystemExit met
/// meanwhile ends the copy as a Ctrl-C does.
fn gather(py: Python<'_>, exchange: &Py<PyAny>, message: String) -> PyResult<Gathered> {
    match exchange
        .call1(py, (message,))
        .and_then(|all| all.extract::<Vec<String>>(py))
    {
        Ok(all) => Ok(Ok(all)),
        Err(e) if e.is_instance_of::<pyo3::exceptions::PyException>(py) => Ok(Err(e.to_string())),
        Err(e) => Err(e),
    }
}

/// The group's all-gather as the copy's thread calls it: asked of the calling thread, which runs
/// the collective (see [`off_thread_serving`]).
fn all_gather(ask: Ask<String, Gathered>) -> core::Exchange {
    std::sync::Arc::new(move |message: String| {
        let answer = ask(message).ok_or_else(|| crate::Error::Cancelled {
            what: "the copy's exchange between ranks (the call stopped waiting)".into(),
        })?;
        answer.map_err(|e| crate::Error::Internal {
            message: format!("the copy's exchange between ranks failed: {e}"),
        })
    })
}

/// Copies `src` to `dst`; returns `{"copied": [...], "skipped": [...], "bytes": n, "stopped":
/// None or why}` for this rank's share. `exchange` (an all-gather of one str per rank) lets the
/// ranks split large files into parts; it is called on this thread (the caller's), while the copy
/// waits for it.
#[pyfunction]
#[pyo3(signature = (src, dst, *, overwrite=Switch::off(), storage_options=None, verify=true,
                    concurrency=None, block_size=None, memory_limit=None, part_size=None,
                    rank=0, world=1, progress=true, keyset=None, associated_data=None,
                    exchange=None),
       // `overwrite`'s default as Python shows it (pyo3 shows `...` for a non-literal).
       text_signature = "(src, dst, *, overwrite=False, storage_options=None, verify=True, \
                         concurrency=None, block_size=None, memory_limit=None, part_size=None, \
                         rank=0, world=1, progress=True, keyset=None, associated_data=None, \
                         exchange=None)")]
#[allow(clippy::too_many_arguments)]
pub fn copy<'py>(
    py: Python<'py>,
    src: String,
    dst: String,
    overwrite: Switch<Overwrite>,
    storage_options: Option<StorageOptions>,
    verify: bool,
    concurrency: Option<Concurrency>,
    block_size: Option<ByteCount<BlockSize>>,
    memory_limit: Option<ByteCount<MemoryLimit>>,
    part_size: Option<ByteCount<PartSize>>,
    rank: usize,
    world: usize,
    progress: bool,
    keyset: Option<super::tink::KeysetArg>,
    associated_data: Option<super::tink::AssociatedDataArg>,
    exchange: Option<Py<PyAny>>,
) -> PyResult<Bound<'py, PyDict>> {
    let mut options = CopyOptions {
        write: WriteOptions {
            overwrite: overwrite.0,
            storage_options: storage_options.unwrap_or_default().0,
            memory_limit: memory_limit.map(|m| m.0),
            part_size: part_size.map(|p| p.0),
            metadata: Vec::new(),
            encryption: super::write::encryption(keyset, associated_data)?,
        },
        concurrency: concurrency.map_or(crate::options::DEFAULT_COPY_CONCURRENCY, |c| c.0),
        block_size: block_size.map_or(crate::options::DEFAULT_COPY_BLOCK_SIZE, |b| b.0),
        verify,
        rank,
        world,
        progress: if progress {
            crate::cli::copy::progress()
        } else {
            None
        },
        exchange: None,
    };
    let grouped = exchange.is_some();
    // On Ctrl-C the files in flight abort their uploads before the KeyboardInterrupt is raised.
    // The exchange's collectives run here, on the calling thread, as the copy asks for them.
    let serve = |py: Python<'_>, message: String| match &exchange {
        Some(exchange) => gather(py, exchange, message),
        None => Ok(Err("no exchange was given".into())),
    };
    let report = off_thread_serving(py, "copy", CLEANUP, serve, move |ask| {
        if grouped {
            options.exchange = Some(all_gather(ask));
        }
        core::copy(&src, &dst, &options)
    })??;
    let out = PyDict::new(py);
    out.set_item("copied", report.copied)?;
    out.set_item("skipped", report.skipped)?;
    out.set_item("bytes", report.bytes)?;
    out.set_item("stopped", report.stopped)?;
    Ok(out)
}
