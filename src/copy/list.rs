//! What a copy reads: the files a source URI names (one file, or every file under a folder, a
//! prefix or a Hub repo's path at a resolved commit), each with its path relative to that folder
//! and who its bytes are ([`Item::id`], [`Item::digest`]).

use std::path::Path;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::source::identity::Digest;
use crate::source::{hub, local, object, Source};
use crate::uri::{kind, Kind};

/// One file to copy.
#[derive(Debug, Clone)]
pub struct Item {
    /// Path below the source folder, `/`-separated (a single file: its base name).
    pub rel: String,
    pub source: Arc<dyn Source>,
    /// What its bytes are checked against while they stream (Hub: sha256 or git blob id).
    pub digest: Option<Digest>,
    /// Who the source's bytes are, recorded at the destination so that a rerun can skip the
    /// file: `sha256:<hex>`, `git-blob:<hex>`, `etag:<etag>`, `local:<mtime ns>`.
    pub id: Option<String>,
}

/// The files a source URI names.
#[derive(Debug)]
pub struct Listing {
    /// The URI named one file (it then goes to the destination as a file, or into it when the
    /// destination is a folder).
    pub single: bool,
    pub items: Vec<Item>,
}

/// Lists `src` (a path, `file://`, `s3://`, `gs://`, `az://`, `http(s)://` one file, `hf://`).
pub fn list(src: &str, storage_options: &[(String, String)]) -> Result<Listing> {
    match kind(src) {
        Kind::Hub => {
            let (single, files) = hub::open_tree(src, storage_options)?;
            let items = files
                .into_iter()
                .map(|(rel, source)| {
                    let identity = source.cache_identity();
                    let digest = identity.as_ref().and_then(|i| i.digest());
                    let id = digest
                        .as_ref()
                        .map(digest_id)
                        .or_else(|| identity.and_then(|i| i.etag).map(|e| format!("etag:{e}")));
                    Item {
                        rel,
                        source,
                        digest,
                        id,
                    }
                })
                .collect();
            Ok(Listing { single, items })
        }
        Kind::ObjectStore => list_objects(src, storage_options),
        Kind::Peer => Err(Error::UnsupportedUri {
            uri: src.to_string(),
            message: "copy reads no peer:// URI: copy from the origin the serve serves".into(),
        }),
        Kind::Local => list_local(src),
    }
}

/// The id a digest gives.
pub fn digest_id(digest: &Digest) -> String {
    match digest {
        Digest::Sha256(h) => format!("sha256:{h}"),
        Digest::GitBlob(h) => format!("git-blob:{h}"),
    }
}

fn list_objects(src: &str, storage_options: &[(String, String)]) -> Result<Listing> {
    let remote = crate::store::open(src, storage_options)?;
    let http = crate::uri::store(src) == Some(crate::uri::Store::Http);
    let (single, found) = crate::runtime::block_on(src, async {
        if !remote.is_prefix || http {
            match object::head(&remote, &remote.path).await {
                Ok(found) => return Ok((true, vec![found])),
                Err(Error::NotFound { .. }) if !http => {}
                Err(e) => return Err(e),
            }
        }
        Ok((false, object::list_tree(&remote).await?))
    })?;
    if found.is_empty() {
        return Err(Error::NotFound { path: remote.uri });
    }
    let prefix = remote.path.as_ref().to_string();
    let items = found
        .into_iter()
        .map(|f| {
            let key = f.path.as_ref();
            let rel = if single {
                key.rsplit('/').next().unwrap_or(key).to_string()
            } else if prefix.is_empty() {
                key.to_string()
            } else {
                key.strip_prefix(&prefix)
                    .map(|r| r.trim_start_matches('/').to_string())
                    .unwrap_or_else(|| key.to_string())
            };
            let name = remote.uri_of(&f.path);
            let id = f
                .validators()
                .strong_etag()
                .map(|e| format!("etag:{}", e.trim_matches('"')));
            let (store, retry) = (remote.store.clone(), remote.retry.clone());
            let source =
                object::RemoteObject::new(name, store, f.path.clone(), f.size, retry).pinned_to(&f);
            Item {
                rel,
                source: Arc::new(source),
                digest: None,
                id,
            }
        })
        .collect();
    Ok(Listing { single, items })
}

fn list_local(src: &str) -> Result<Listing> {
    let root = Path::new(crate::uri::local_path(src));
    let meta = std::fs::metadata(root).map_err(|e| Error::io(src, e))?;
    let mut files = Vec::new();
    let single = !meta.is_dir();
    if single {
        let base = root.file_name().map(|n| n.to_string_lossy().into_owned());
        files.push((base.unwrap_or_else(|| src.to_string()), root.to_path_buf()));
    } else {
        walk(root, "", &mut files)?;
        files.sort();
    }
    if files.is_empty() {
        return Err(Error::NotFound {
            path: src.to_string(),
        });
    }
    let items = files
        .into_iter()
        .map(|(rel, path)| {
            let source = local::LocalFile::open(&path)?;
            let id = std::fs::metadata(&path).ok().map(|m| {
                use std::os::unix::fs::MetadataExt;
                format!("local:{}.{:09}", m.mtime(), m.mtime_nsec())
            });
            Ok(Item {
                rel,
                source: Arc::new(source),
                digest: None,
                id,
            })
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(Listing { single, items })
}

/// Regular files under `dir` (symlinks to files followed, as in a Hugging Face cache snapshot;
/// symlinks to folders skipped; a writer's temporary files left out).
fn walk(dir: &Path, rel: &str, out: &mut Vec<(String, std::path::PathBuf)>) -> Result<()> {
    let shown = dir.display().to_string();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(&shown, e))? {
        let entry = entry.map_err(|e| Error::io(&shown, e))?;
        let path = entry.path();
        let name = entry
            .file_name()
            .to_str()
            .map(str::to_string)
            .ok_or_else(|| {
                Error::io(
                    path.display().to_string(),
                    std::io::Error::new(std::io::ErrorKind::InvalidData, "the name is not UTF-8"),
                )
            })?;
        if name.ends_with(".fastload-tmp") {
            continue;
        }
        let child = if rel.is_empty() {
            name
        } else {
            format!("{rel}/{name}")
        };
        let meta = std::fs::metadata(&path).map_err(|e| Error::io(&child, e))?;
        let link = entry.file_type().is_ok_and(|t| t.is_symlink());
        if meta.is_dir() && link {
            // A linked folder may link back up (a cycle): only real folders are walked.
            continue;
        }
        if meta.is_dir() {
            walk(&path, &child, out)?;
        } else if meta.is_file() {
            out.push((child, path));
        }
    }
    Ok(())
}
