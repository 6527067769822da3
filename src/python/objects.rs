//! Small whole objects from an object store, for the files that travel beside a checkpoint
//! (config, tokenizer): a folder listing, a capped read, and copies kept in a folder by the
//! cache's rules (`crate::source::cache::named`), on the same stores, credentials and endpoint
//! rules as the loads (`crate::source::open::object_store`).

use std::path::PathBuf;

use pyo3::prelude::*;

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
            let remote = crate::store::open(&uri, &options)?;
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

/// The copy of the object `uri` at `dest/name` (`name` relative, `/`-separated, checked first),
/// fetched unless the one there is current, with the cache's record of what it copies beside it
/// (`.cache/fastload/NAME.json`): `("kept", 0)`, `("written", size)`, `("missing", 0)` (a copy
/// fastload left of it removed) or `("too_large", size)` for an object of more than `max_bytes`,
/// unread. A link in `dest` where a folder or the file must be raises `StorageError`.
#[pyfunction]
#[pyo3(signature = (uri, dest, name, max_bytes, *, storage_options=None))]
pub fn fetch_small_file(
    py: Python<'_>,
    uri: String,
    dest: PathBuf,
    name: String,
    max_bytes: u64,
    storage_options: Option<StorageOptions>,
) -> PyResult<(&'static str, u64)> {
    use crate::source::cache::named::{fetch, Fetched};

    crate::format::check_inside(&name).map_err(|reason| crate::Error::NameOutside {
        path: uri.clone(),
        name: name.clone(),
        reason,
    })?;
    let options = storage_options.unwrap_or_default().0;
    let fetched = off_thread(py, "fetch_small_file", move || -> crate::Result<Fetched> {
        let remote = crate::store::open(&uri, &options)?;
        let path = remote.path.clone();
        crate::runtime::block_on(&remote.uri, fetch(&remote, &path, &dest, &name, max_bytes))
    })??;
    Ok(match fetched {
        Fetched::Kept => ("kept", 0),
        Fetched::Written(size) => ("written", size),
        Fetched::Missing => ("missing", 0),
        Fetched::TooLarge(size) => ("too_large", size),
    })
}

/// Removes the files `fetch_small_file` put directly into `dest` whose names are not in `keep`
/// (their objects are gone, or no longer pulled); other files stay.
#[pyfunction]
pub fn prune_small_files(py: Python<'_>, dest: PathBuf, keep: Vec<String>) {
    super::gil::detach(py, move || crate::source::cache::named::prune(&dest, &keep));
}
