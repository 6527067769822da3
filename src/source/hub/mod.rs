//! The Hugging Face Hub (`hf://ORG/REPO[@REVISION][/path]`), read the way `huggingface_hub` reads
//! it: the same environment (`HF_ENDPOINT`, `HF_TOKEN`, the token file, `HF_HUB_OFFLINE`, the
//! cache layout), the revision resolved to a commit once per load, and each file's `resolve/` URL
//! followed to the storage host it redirects to.
//!
//! - this module: the URI and the settings taken from the environment;
//! - [`api`]: the Hub's HTTP API (revision → commit and file list, `resolve/` → where the bytes
//!   are), its errors, and the one retry loop for Hub requests;
//! - [`location`]: a resolved storage location and when it expires;
//! - [`layout`]: the Hugging Face cache's layout (where `HF_HUB_OFFLINE` finds snapshots and where
//!   the local cache puts Hub files);
//! - files.rs: the files themselves as sources ([`HubFile`], opened by [`open`]).
//!
//! Why not the `hf-hub` crate: it downloads whole files into the cache (sync or tokio API, with
//! its own client and progress bars); what a load needs is ranged reads of a resolved location
//! into the pipeline's buffers, and a handful of API calls, which reqwest (already here through
//! object_store) does without a second HTTP stack.

use std::path::PathBuf;

use crate::error::{Error, Result};

pub mod api;
mod files;
pub mod layout;
pub mod location;

pub use files::{open, open_tree};

/// The URI scheme.
pub const SCHEME: &str = "hf";
/// The Hub, when `HF_ENDPOINT` does not name another.
pub const DEFAULT_ENDPOINT: &str = "https://huggingface.co";
/// The most bytes of a token file read (a token is about 40).
const MAX_TOKEN_FILE: u64 = 64 * 1024;
/// The revision of a URI without `@`.
pub const DEFAULT_REVISION: &str = "main";

/// A parsed `hf://` URI.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HubUri {
    /// `org/name`.
    pub repo_id: String,
    /// The ref or commit asked for (`@...`, percent-decoded), `None` for the default branch.
    pub revision: Option<String>,
    /// A file or folder inside the repo, without leading or trailing `/` (empty: the root).
    pub path: String,
}

impl HubUri {
    /// Parses `hf://ORG/REPO[@REVISION][/path]`. The revision ends at the next `/`, so a ref with
    /// a slash is written URL-encoded (`@refs%2Fpr%2F1`), as `huggingface_hub`'s `HfFileSystem`
    /// takes it; `refs/pr/N` and `refs/convert/NAME` are also taken as written.
    pub fn parse(uri: &str) -> Result<HubUri> {
        let bad = |message: &str| Error::UnsupportedUri {
            uri: uri.to_string(),
            message: format!("{message} (expected hf://ORG/REPO[@REVISION][/path])"),
        };
        let rest = match uri.split_once("://") {
            Some((scheme, rest)) if scheme.eq_ignore_ascii_case(SCHEME) => rest,
            _ => return Err(bad("not an hf:// URI")),
        };
        if rest.contains(['?', '#']) {
            return Err(bad("a query or fragment is not part of a Hub path"));
        }
        let mut parts = rest.splitn(2, '/');
        let org = parts.next().unwrap_or_default();
        let rest = parts.next().unwrap_or_default();
        let (name, revision, path) = match rest.split_once('@') {
            Some((name, after)) if !name.contains('/') => {
                let (rev, path) = split_revision(after);
                let rev =
                    percent_decode(rev).ok_or_else(|| bad("the revision is not valid UTF-8"))?;
                if rev.is_empty() {
                    return Err(bad("empty revision after '@'"));
                }
                (name, Some(rev), path)
            }
            _ => match rest.split_once('/') {
                Some((name, path)) => (name, None, path),
                None => (rest, None, ""),
            },
        };
        if org.is_empty() || name.is_empty() {
            return Err(bad("the repo must be ORG/REPO"));
        }
        // huggingface_hub refuses these as a repo's org or name; a path would climb out with them.
        if [org, name].iter().any(|p| *p == "." || *p == "..") {
            return Err(bad("'.' and '..' are not a repo's org or name"));
        }
        let path = path.trim_matches('/');
        if path.split('/').any(|p| p == ".." || p == ".") {
            return Err(bad("'.' and '..' are not allowed in a Hub path"));
        }
        Ok(HubUri {
            repo_id: format!("{org}/{name}"),
            revision,
            path: path.to_string(),
        })
    }

    /// The revision to resolve: the one asked for, else `main`.
    pub fn revision(&self) -> &str {
        self.revision.as_deref().unwrap_or(DEFAULT_REVISION)
    }

    /// `hf://org/name@<commit>/<path>`, the name of a file at a resolved commit.
    pub fn file_uri(&self, commit: &str, path: &str) -> String {
        format!("hf://{}@{commit}/{path}", self.repo_id)
    }
}

/// Splits `REV/path` after `@`: the revision ends at the first `/`, except the Hub's
/// `refs/pr/N` and `refs/convert/NAME`, which `huggingface_hub` also takes unencoded.
fn split_revision(after: &str) -> (&str, &str) {
    for special in ["refs/pr/", "refs/convert/"] {
        if let Some(tail) = after.strip_prefix(special) {
            let end = special.len() + tail.find('/').unwrap_or(tail.len());
            return (&after[..end], after[end..].trim_start_matches('/'));
        }
    }
    match after.split_once('/') {
        Some((rev, path)) => (rev, path),
        None => (after, ""),
    }
}

fn percent_decode(s: &str) -> Option<String> {
    percent_encoding::percent_decode_str(s)
        .decode_utf8()
        .ok()
        .map(|c| c.into_owned())
}

/// Where the token came from: named in errors, never the token itself.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenSource {
    /// An environment variable (`HF_TOKEN`, `HUGGING_FACE_HUB_TOKEN`).
    Env(&'static str),
    /// The token file (`HF_TOKEN_PATH`, else `$HF_HOME/token`).
    File(PathBuf),
    /// The `token` storage option.
    Option,
}

impl std::fmt::Display for TokenSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TokenSource::Env(name) => write!(f, "the token from {name}"),
            TokenSource::File(path) => write!(f, "the token from the file {}", path.display()),
            TokenSource::Option => write!(f, "the token from the storage option token"),
        }
    }
}

/// What the environment (and the storage options) say about the Hub.
#[derive(Debug, Clone)]
pub struct HubSettings {
    /// `HF_ENDPOINT` without a trailing `/`.
    pub endpoint: String,
    pub token: Option<(String, TokenSource)>,
    /// `HF_HUB_OFFLINE`: files come from the Hugging Face cache only.
    pub offline: bool,
    /// Where the token file would be, for the message when there is no token.
    pub token_file: PathBuf,
}

impl HubSettings {
    /// The settings `huggingface_hub` would use, from the process environment. Storage options
    /// `endpoint` and `token` take precedence.
    pub fn from_env(storage_options: &[(String, String)]) -> Result<HubSettings> {
        Self::from_lookup(|k| std::env::var(k).ok(), storage_options)
    }

    pub fn from_lookup(
        env: impl Fn(&str) -> Option<String>,
        storage_options: &[(String, String)],
    ) -> Result<HubSettings> {
        let env = |k: &str| env(k).filter(|v| !v.trim().is_empty());
        let mut endpoint = env("HF_ENDPOINT").unwrap_or_else(|| DEFAULT_ENDPOINT.into());
        let mut endpoint_from = "HF_ENDPOINT".to_string();
        let mut token = None;
        for (key, value) in storage_options {
            match key.to_ascii_lowercase().as_str() {
                "endpoint" | "hf_endpoint" => {
                    endpoint = value.clone();
                    endpoint_from = format!("storage_options[{key:?}]");
                }
                "token" | "hf_token" => token = Some((value.clone(), TokenSource::Option)),
                _ => {
                    return Err(Error::option(
                        "storage_options",
                        format!(
                            "{key:?} is not an hf:// option (valid: endpoint, token, \
                             max_retries, retry_timeout, min_rate, min_rate_window)"
                        ),
                    ))
                }
            }
        }
        let endpoint = endpoint.trim().trim_end_matches('/').to_string();
        crate::error::remember_url_credentials(&endpoint);
        crate::options::check_endpoint(&endpoint).map_err(|e| {
            let shown = crate::store::redact_uri(&endpoint);
            Error::option(endpoint_from, format!("{shown:?}: {e}"))
        })?;
        let hf_home = hf_home(&env);
        let token_file = env("HF_TOKEN_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|| hf_home.join("token"));
        if token.is_none() {
            token = ["HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"]
                .into_iter()
                .find_map(|name| env(name).map(|t| (t.trim().to_string(), TokenSource::Env(name))));
        }
        if token.is_none() {
            // Read as huggingface_hub reads it, but never past a small cap (a token file
            // pointed at /dev/zero or a FIFO is no token).
            token = crate::bounded::read_file_limited(
                &token_file,
                &token_file.display().to_string(),
                crate::bounded::Whole::Body,
                MAX_TOKEN_FILE,
            )
            .ok()
            .and_then(|t| String::from_utf8(t).ok())
            .map(|t| t.trim().to_string())
            .filter(|t| !t.is_empty())
            .map(|t| (t, TokenSource::File(token_file.clone())));
        }
        if let Some((value, _)) = &token {
            crate::error::remember_secret(value);
        }
        Ok(HubSettings {
            endpoint,
            token,
            offline: env("HF_HUB_OFFLINE").is_some_and(|v| is_true(&v)),
            token_file,
        })
    }

    /// Where the token came from, or what would have given one, for error messages.
    pub fn token_note(&self) -> String {
        match &self.token {
            Some((_, source)) => format!("with {source}"),
            None => format!(
                "without a token (none in HF_TOKEN, HUGGING_FACE_HUB_TOKEN or {})",
                self.token_file.display()
            ),
        }
    }
}

/// `HF_HOME`, else `$XDG_CACHE_HOME/huggingface`, else `~/.cache/huggingface`.
pub fn hf_home(env: &impl Fn(&str) -> Option<String>) -> PathBuf {
    if let Some(home) = env("HF_HOME") {
        return expand_home(&home);
    }
    let cache = env("XDG_CACHE_HOME")
        .map(|p| expand_home(&p))
        .unwrap_or_else(|| dirs::home_dir().unwrap_or_default().join(".cache"));
    cache.join("huggingface")
}

fn expand_home(path: &str) -> PathBuf {
    match path.strip_prefix("~/") {
        Some(rest) => dirs::home_dir().unwrap_or_default().join(rest),
        None => PathBuf::from(path),
    }
}

/// `huggingface_hub`'s truthy values for boolean variables.
fn is_true(value: &str) -> bool {
    matches!(
        value.trim().to_ascii_uppercase().as_str(),
        "1" | "ON" | "YES" | "TRUE"
    )
}

/// A 40-hex git commit id.
pub fn is_commit(revision: &str) -> bool {
    revision.len() == 40 && revision.bytes().all(|b| b.is_ascii_hexdigit())
}

#[cfg(test)]
mod tests;
