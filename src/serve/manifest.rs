//! What a serve serves: every file of the checkpoints it was given, found once at start, each
//! under `(NAME, path)` in a map that requests are looked up in (no request path ever reaches
//! the file system), with the identity its origin pinned, and the manifest JSON listing them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, RwLock};

use serde::Serialize;

use super::hold::Held;
use crate::error::{Error, Result};
use crate::source::identity::CacheIdentity;
use crate::source::Source;

/// Who a file's bytes are, as its origin said when the serve pinned it.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Identity {
    pub sha256: Option<String>,
    /// Quotes included, as the store sent it.
    pub etag: Option<String>,
    pub version: Option<String>,
    /// The Hub commit the file was read at.
    pub commit: Option<String>,
    #[serde(skip)]
    pub size: u64,
}

impl Identity {
    /// The identity of a remote object as its source pinned it, with the version id its HEAD
    /// gave (object stores that keep versions).
    pub fn of(id: &CacheIdentity, version: Option<String>) -> Identity {
        Identity {
            sha256: id.sha256.as_ref().map(|s| s.to_ascii_lowercase()),
            etag: id.etag.clone(),
            version,
            commit: id.hub.as_ref().map(|h| h.commit.clone()),
            size: id.size,
        }
    }

    /// The canonical identity string both sides of the peer protocol compare.
    pub fn canonical(&self) -> String {
        crate::source::identity::canonical_identity(
            self.sha256.as_deref(),
            self.etag.as_deref(),
            self.version.as_deref(),
            self.size,
        )
    }

    /// What the `ETag` header of an answer says: the sha256, else the origin's ETag.
    pub fn etag_header(&self) -> String {
        let tag = self
            .sha256
            .as_deref()
            .or(self.etag.as_deref())
            .unwrap_or("");
        format!("\"{}\"", tag.trim_start_matches("W/").trim_matches('"'))
    }
}

/// Where a served file's bytes are read from now.
#[derive(Clone)]
pub enum Content {
    /// Its source: a local file, a cached copy, or the origin read through (filling the cache).
    Source(Arc<dyn Source>),
    /// In host memory (`--hold`).
    Held(Arc<Held>),
}

/// One file a serve serves.
pub struct Served {
    /// Relative, `/`-separated.
    pub path: String,
    pub size: u64,
    pub identity: Identity,
    pub canonical: String,
    pub origin_uri: Option<String>,
    /// Who the remote object is, for its cached copy once filled.
    pub cache: Option<CacheIdentity>,
    content: RwLock<Content>,
    held: AtomicBool,
}

impl Served {
    pub fn new(
        path: String,
        identity: Identity,
        origin_uri: Option<String>,
        source: Arc<dyn Source>,
    ) -> Served {
        let held = source.local_path().is_some();
        Served {
            path,
            size: source.size(),
            canonical: identity.canonical(),
            identity,
            origin_uri,
            cache: source.cache_identity(),
            content: RwLock::new(Content::Source(source)),
            held: AtomicBool::new(held),
        }
    }

    pub fn content(&self) -> Content {
        self.content
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// From now on the bytes come from `content`, all of them at the serve.
    pub fn set_held(&self, content: Content) {
        *self.content.write().unwrap_or_else(|e| e.into_inner()) = content;
        self.held.store(true, Ordering::Release);
    }

    pub fn is_held(&self) -> bool {
        self.held.load(Ordering::Acquire)
    }
}

/// One checkpoint: its name and origin, and its files in order.
pub struct Checkpoint {
    pub name: String,
    pub origin: Option<String>,
    pub files: Vec<Arc<Served>>,
}

/// Every checkpoint of a serve, and the one map requests are looked up in.
pub struct Catalog {
    pub checkpoints: Vec<Checkpoint>,
    by_name: HashMap<(String, String), Arc<Served>>,
}

impl Catalog {
    /// Checks names (unique, `[A-Za-z0-9._-]+`) and paths (relative, no `..`) and builds the map.
    pub fn new(checkpoints: Vec<Checkpoint>) -> Result<Catalog> {
        let mut by_name = HashMap::new();
        for c in &checkpoints {
            check_name(&c.name)?;
            if checkpoints.iter().filter(|o| o.name == c.name).count() > 1 {
                return Err(Error::option(
                    "--name",
                    format!(
                        "two checkpoints are named {:?}: give each its own --name",
                        c.name
                    ),
                ));
            }
            for f in &c.files {
                crate::format::check_inside(&f.path)
                    .map_err(|e| Error::option("uri", format!("{:?}: {e}", f.path)))?;
                by_name.insert((c.name.clone(), f.path.clone()), f.clone());
            }
        }
        Ok(Catalog {
            checkpoints,
            by_name,
        })
    }

    /// The file `path` of checkpoint `name`, exactly as listed.
    pub fn get(&self, name: &str, path: &str) -> Option<&Arc<Served>> {
        self.by_name.get(&(name.to_string(), path.to_string()))
    }

    pub fn files(&self) -> impl Iterator<Item = &Arc<Served>> {
        self.checkpoints.iter().flat_map(|c| c.files.iter())
    }

    /// Files held whole, and their bytes.
    pub fn held(&self) -> (usize, u64) {
        self.files()
            .filter(|f| f.is_held())
            .fold((0, 0), |(n, b), f| (n + 1, b + f.size))
    }

    /// The manifest (`GET /v1/manifest`).
    pub fn manifest(&self) -> serde_json::Value {
        let checkpoints: Vec<_> = self
            .checkpoints
            .iter()
            .map(|c| {
                let files: Vec<_> = c
                    .files
                    .iter()
                    .map(|f| {
                        serde_json::json!({
                            "path": f.path,
                            "size": f.size,
                            "identity": f.identity,
                            "origin_uri": f.origin_uri,
                            "held": f.is_held(),
                        })
                    })
                    .collect();
                serde_json::json!({"name": c.name, "origin": c.origin, "files": files})
            })
            .collect();
        serde_json::json!({"protocol": 1, "checkpoints": checkpoints, "tiers": ["http"]})
    }
}

/// A checkpoint's name: `[A-Za-z0-9._-]+`, not `.` or `..`.
pub fn check_name(name: &str) -> Result<()> {
    let ok = !name.is_empty()
        && name != "."
        && name != ".."
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        return Ok(());
    }
    Err(Error::option(
        "--name",
        format!("{name:?} is not a name: use letters, digits, '.', '_' and '-' only"),
    ))
}

/// The name a URI gets without `--name`: its last path segment (a Hub repo's name without its
/// revision), any other character than `[A-Za-z0-9._-]` made a `-`.
pub fn default_name(uri: &str) -> String {
    let path = uri.split_once("://").map_or(uri, |(_, rest)| rest);
    let path = path.split(['?', '#']).next().unwrap_or(path);
    let last = path
        .trim_end_matches('/')
        .rsplit('/')
        .find(|s| !s.is_empty() && !s.starts_with('@'))
        .unwrap_or("checkpoint");
    let last = last.split('@').next().unwrap_or(last);
    let name: String = last
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .collect();
    match name.as_str() {
        "" | "." | ".." => "checkpoint".into(),
        _ => name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::testing::Bytes;

    fn served(path: &str) -> Arc<Served> {
        let source = Arc::new(Bytes {
            name: "mem://x".into(),
            data: vec![1, 2, 3],
        });
        Arc::new(Served::new(path.into(), Identity::default(), None, source))
    }

    #[test]
    fn default_names_are_the_last_segment() {
        assert_eq!(default_name("s3://bucket/models/llama/"), "llama");
        assert_eq!(default_name("hf://org/repo@main"), "repo");
        assert_eq!(default_name("hf://org/repo"), "repo");
        assert_eq!(default_name("/tmp/x/ckpt"), "ckpt");
        assert_eq!(default_name("/tmp/x/my model"), "my-model");
        assert_eq!(default_name("/"), "checkpoint");
    }

    #[test]
    fn names_and_paths_are_checked_and_looked_up_exactly() {
        for bad in ["a/b", "..", "", "a b", "a%2f"] {
            assert!(check_name(bad).is_err(), "{bad:?}");
        }
        let one = |name: &str, files| Checkpoint {
            name: name.into(),
            origin: None,
            files,
        };
        let catalog = Catalog::new(vec![one(
            "m",
            vec![served("a.safetensors"), served("sub/b.json")],
        )])
        .unwrap();
        assert!(catalog.get("m", "sub/b.json").is_some());
        for (n, p) in [
            ("m", "../m/a.safetensors"),
            ("m", "/a.safetensors"),
            ("m", "sub"),
            ("M", "a.safetensors"),
        ] {
            assert!(catalog.get(n, p).is_none(), "{n} {p}");
        }
        assert!(Catalog::new(vec![one("m", vec![]), one("m", vec![])]).is_err());
        assert!(Catalog::new(vec![one("m", vec![served("../x")])]).is_err());
        let manifest = catalog.manifest();
        assert_eq!(manifest["protocol"], 1);
        assert_eq!(manifest["checkpoints"][0]["files"][1]["path"], "sub/b.json");
        assert_eq!(manifest["checkpoints"][0]["files"][1]["size"], 3);
        assert_eq!(manifest["tiers"][0], "http");
    }
}
