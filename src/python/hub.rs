//! What Python asks Rust about the Hugging Face Hub instead of restating it: what an `hf://` URI
//! names ([`HubUri::parse`], the parser every load uses) and where the Hugging Face cache is
//! ([`layout::hub_cache_root`], the folder a load's cache fills).

use std::ffi::OsString;

use pyo3::prelude::*;

use crate::source::hub::{layout, HubUri};
use crate::uri::{kind, Kind};

/// `(repo_id, revision, path)` of an `hf://ORG/REPO[@REVISION][/path]` URI (scheme in any case;
/// `revision` None for the default branch; `path` without leading or trailing `/`), as a load
/// reads it; None when `uri` is not an `hf://` URI; `ConfigError` when it is one that does not
/// name a repo (`..`, an empty revision, a query).
#[pyfunction]
pub fn parse_hub_uri(uri: &str) -> PyResult<Option<(String, Option<String>, String)>> {
    if kind(uri) != Kind::Hub {
        return Ok(None);
    }
    let parsed = HubUri::parse(uri)?;
    Ok(Some((parsed.repo_id, parsed.revision, parsed.path)))
}

/// The Hugging Face cache folder the environment names now (`HF_HUB_CACHE`,
/// `HUGGINGFACE_HUB_CACHE`, `HF_HOME/hub`, `XDG_CACHE_HOME/huggingface/hub`,
/// `~/.cache/huggingface/hub`), as `huggingface_hub` resolves it at import.
#[pyfunction]
pub fn hub_cache_dir() -> OsString {
    layout::hub_cache_root().into_os_string()
}
