//! The rule for names that come from data (`crate::format::check_inside`), for the Python
//! integrations that resolve an index or write small files: the same check, and the same
//! exception (`ConfigError` naming where the name came from), as a load's; and the index file
//! the writers publish, in the form the reader takes.

use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::format::{check_inside as inside, index_json as index_bytes, index_shard_names};
use crate::Error;

/// The shard files the index `index` names (its bytes `data`), sorted, each once, as a load
/// resolves them: an entry outside the index's folder raises `ConfigError` naming the index and
/// the entry, a malformed index `FormatError`.
#[pyfunction]
pub fn index_files(index: &str, data: &[u8]) -> PyResult<Vec<String>> {
    Ok(index_shard_names(data).map_err(|e| Error::format(index, e))?)
}

/// `name` when it names a file inside the folder it is joined to under every reading (a local
/// path, an object key, a relative URL); else `ConfigError` saying why, naming `source` (where
/// the name came from) and the name.
#[pyfunction]
pub fn check_inside(name: &str, source: &str) -> PyResult<String> {
    inside(name).map_err(|reason| Error::NameOutside {
        path: source.to_string(),
        name: name.to_string(),
        reason,
    })?;
    Ok(name.to_string())
}

/// The bytes of `model.safetensors.index.json` for a sharded checkpoint: `weight_map` pairs of
/// (tensor name, shard file) and the checkpoint's `total_size`, written as transformers and
/// `huggingface_hub` write the index (`crate::format::index_json`), and read by the same crate.
#[pyfunction]
pub fn index_json<'py>(
    py: Python<'py>,
    weight_map: Vec<(String, String)>,
    total_size: u64,
) -> Bound<'py, PyBytes> {
    let pairs = weight_map.iter().map(|(t, f)| (t.as_str(), f.as_str()));
    PyBytes::new(py, &index_bytes(pairs, total_size))
}
