//! Small whole objects from an object store, for the files that travel beside a checkpoint
//! (config, tokenizer): a folder listing and a capped read, on the same stores, credentials and
//! endpoint rules as the loads (`crate::source::open::object_store`).

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use super::args::StorageOptions;
use super::wait::off_thread;

/// `(uri, size)` of every object directly under `uri` taken as a folder, in name order.
#[pyfunction]
#[pyo3(signature = (uri, *, storage_options=None))]
pub fn list_objects(
    py: Python<'_>,
    uri: String,
    storage_options: Option<StorageOptions>,
) -> PyResult<Vec<(String, u64)>> {
    let options = storage_options.unwrap_or_default().0;
    let found = off_thread(
        py,
        "list_objects",
        move || -> crate::Result<Vec<(String, u64)>> {
            let remote = crate::source::object::open(&uri, &options)?;
            let found =
                crate::runtime::block_on(&remote.uri, crate::source::object::list_folder(&remote))?;
            Ok(found
                .into_iter()
                .map(|f| (remote.uri_of(&f.path), f.size))
                .collect())
        },
    )??;
    Ok(found)
}

/// One object's bytes, whole; an object larger than `max_bytes` raises `StorageError` unread.
#[pyfunction]
#[pyo3(signature = (uri, max_bytes, *, storage_options=None))]
pub fn read_object<'py>(
    py: Python<'py>,
    uri: String,
    max_bytes: u64,
    storage_options: Option<StorageOptions>,
) -> PyResult<Bound<'py, PyBytes>> {
    let options = storage_options.unwrap_or_default().0;
    let bytes = off_thread(py, "read_object", move || -> crate::Result<Vec<u8>> {
        let remote = crate::source::object::open(&uri, &options)?;
        let path = remote.path.clone();
        crate::runtime::block_on(
            &remote.uri,
            crate::source::object::read_small(&remote, &path, max_bytes),
        )
    })??;
    Ok(PyBytes::new(py, &bytes))
}
