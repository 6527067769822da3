//! Where bytes come from: URI resolution (files, shard directories, index files, `file://`) and
//! the local fast path (positioned reads on blocking threads, straight into the destination).

use std::collections::BTreeSet;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::format::{self, FormatError, Header};
use crate::object;

/// The index file that sharded Hugging Face checkpoints carry.
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// Where a shard's bytes live.
#[derive(Debug)]
pub enum Data {
    /// A local file, read with `pread` or mapped.
    Local { path: PathBuf, file: Arc<File> },
    /// An object in an object store, read with ranged GETs.
    Remote {
        store: Arc<dyn object_store::ObjectStore>,
        path: object_store::path::Path,
    },
}

/// One safetensors file or object, opened, with its validated header.
#[derive(Debug)]
pub struct Shard {
    /// The name used in messages (the path or URI as the user would recognise it).
    pub name: String,
    pub data: Data,
    pub size: u64,
    pub header: Header,
}

impl Shard {
    /// The local path, for files on this machine.
    pub fn local_path(&self) -> Option<&Path> {
        match &self.data {
            Data::Local { path, .. } => Some(path),
            Data::Remote { .. } => None,
        }
    }
}

fn local_path(uri: &str) -> Result<PathBuf> {
    if uri.starts_with("file:") {
        // file:///abs/path, file://localhost/abs/path, percent-encoded as Path::as_uri() writes.
        return url::Url::parse(uri)
            .ok()
            .and_then(|u| u.to_file_path().ok())
            .ok_or_else(|| Error::UnsupportedUri {
                uri: uri.to_string(),
                message: "not a valid file:// URL with an absolute path".into(),
            });
    }
    if let Some((scheme, _)) = uri.split_once("://") {
        return Err(Error::UnsupportedUri {
            uri: uri.to_string(),
            message: format!(
                "scheme {scheme}:// is not supported by this build (local paths and file:// are)"
            ),
        });
    }
    Ok(PathBuf::from(uri))
}

/// The shard file names an index's `weight_map` lists (sorted, each once), each checked to be a
/// plain relative path inside the index's folder. `name` is the index, for messages.
pub fn index_shard_names(bytes: &[u8], name: &str) -> Result<Vec<String>> {
    let value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        let reason = e.to_string();
        Error::format(name, FormatError::IndexInvalidJson { reason })
    })?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::format(name, FormatError::IndexNoWeightMap))?;
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            let tensor = tensor.clone();
            Error::format(name, FormatError::IndexEntryNotAName { tensor })
        })?;
        let inside = Path::new(file)
            .components()
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if !inside || file.is_empty() {
            let (tensor, file) = (tensor.clone(), file.to_string());
            return Err(Error::format(
                name,
                FormatError::IndexEntryOutside { tensor, file },
            ));
        }
        files.insert(file.to_string());
    }
    Ok(files.into_iter().collect())
}

fn index_files(index: &Path) -> Result<Vec<PathBuf>> {
    let name = index.display().to_string();
    let bytes = std::fs::read(index).map_err(|e| Error::io(&name, e))?;
    let dir = index.parent().unwrap_or(Path::new("."));
    Ok(index_shard_names(&bytes, &name)?
        .into_iter()
        .map(|f| dir.join(f))
        .collect())
}

fn expand(uri: &str) -> Result<Vec<PathBuf>> {
    let path = local_path(uri)?;
    let meta = std::fs::metadata(&path).map_err(|e| Error::io(uri, e))?;
    if meta.is_dir() {
        let index = path.join(INDEX_FILE);
        if index.is_file() {
            return index_files(&index);
        }
        let mut files: Vec<PathBuf> = std::fs::read_dir(&path)
            .map_err(|e| Error::io(uri, e))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "safetensors") && p.is_file())
            .collect();
        if files.is_empty() {
            return Err(Error::NotFound {
                path: format!("{uri} (no .safetensors files in this directory)"),
            });
        }
        files.sort();
        return Ok(files);
    }
    if path.extension().is_some_and(|e| e == "json") {
        return index_files(&path);
    }
    Ok(vec![path])
}

/// Turns the user's URIs into the list of files to load, in a stable order.
pub fn resolve(uris: &[String]) -> Result<Vec<PathBuf>> {
    if uris.is_empty() {
        return Err(Error::option("uri", "no file given"));
    }
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for uri in uris {
        for p in expand(uri)? {
            if seen.insert(p.clone()) {
                out.push(p);
            }
        }
    }
    Ok(out)
}

/// Reads exactly `buf.len()` bytes at `offset`, retrying interrupted and short reads.
pub fn read_exact_at(file: &File, buf: &mut [u8], offset: u64, name: &str) -> Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], offset + done as u64) {
            Ok(0) => {
                return Err(Error::Io {
                    path: name.to_string(),
                    source: std::io::Error::new(
                        std::io::ErrorKind::UnexpectedEof,
                        format!(
                            "file ended at byte {} while reading {} bytes at offset {offset} (was it truncated while loading?)",
                            offset + done as u64,
                            buf.len()
                        ),
                    ),
                })
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(Error::io(name, e)),
        }
    }
    Ok(())
}

/// Opens one file and validates its header. Reads at most 8 + header-length bytes, and only after
/// the length was checked against the file size and the 100 MB cap.
pub fn open_shard(path: &Path) -> Result<Shard> {
    let name = path.display().to_string();
    let file = File::open(path).map_err(|e| Error::io(&name, e))?;
    let meta = file.metadata().map_err(|e| Error::io(&name, e))?;
    if meta.is_dir() {
        return Err(Error::format(&name, FormatError::IsDirectory));
    }
    let size = meta.len();
    let mut prefix = [0u8; format::PREFIX_LEN as usize];
    let got = prefix.len().min(size as usize);
    read_exact_at(&file, &mut prefix[..got], 0, &name)?;
    let n = format::header_len(&prefix[..got], size).map_err(|e| Error::format(&name, e))?;
    let mut json = vec![0u8; n as usize];
    read_exact_at(&file, &mut json, format::PREFIX_LEN, &name)?;
    let header = format::parse_header(&json, size).map_err(|e| Error::format(&name, e))?;
    Ok(Shard {
        name,
        data: Data::Local {
            path: path.to_path_buf(),
            file: Arc::new(file),
        },
        size,
        header,
    })
}

/// True when any URI names an object in an object store (not a local file).
pub fn any_remote(uris: &[String]) -> bool {
    uris.iter().any(|u| object::is_remote(u))
}

/// Resolves the URIs and opens every file or object, reading headers concurrently when there are
/// many shards. `storage_options` configure object stores (see [`crate::object::open`]).
pub fn open_all(uris: &[String], storage_options: &[(String, String)]) -> Result<Vec<Shard>> {
    if uris.is_empty() {
        return Err(Error::option("uri", "no file given"));
    }
    let mut out = Vec::new();
    let mut local = Vec::new();
    for uri in uris {
        if object::is_remote(uri) {
            out.extend(open_local(&std::mem::take(&mut local))?);
            out.extend(open_remote(uri, storage_options)?);
        } else {
            local.push(uri.clone());
        }
    }
    out.extend(open_local(&local)?);
    Ok(out)
}

fn open_local(uris: &[String]) -> Result<Vec<Shard>> {
    if uris.is_empty() {
        return Ok(Vec::new());
    }
    let paths = resolve(uris)?;
    if paths.len() <= 2 {
        return paths.iter().map(|p| open_shard(p)).collect();
    }
    let workers = paths.len().min(16);
    let chunk = paths.len().div_ceil(workers);
    std::thread::scope(|scope| {
        let handles: Vec<_> = paths
            .chunks(chunk)
            .map(|part| {
                scope.spawn(move || {
                    part.iter()
                        .map(|p| open_shard(p))
                        .collect::<Result<Vec<_>>>()
                })
            })
            .collect();
        let mut out = Vec::with_capacity(paths.len());
        for h in handles {
            out.extend(h.join().expect("header reader thread panicked")?);
        }
        Ok(out)
    })
}

/// Lists what an object-store URI names and reads every header, 16 requests at a time.
fn open_remote(uri: &str, storage_options: &[(String, String)]) -> Result<Vec<Shard>> {
    use futures_util::stream::{StreamExt, TryStreamExt};

    let remote = object::open(uri, storage_options)?;
    crate::runtime::get().block_on(async {
        let objects = object::resolve(&remote).await?;
        futures_util::stream::iter(objects)
            .map(|(path, size)| {
                let remote = &remote;
                async move {
                    let header = object::read_header(remote, &path, size).await?;
                    Ok::<_, Error>(Shard {
                        name: remote.uri_of(&path),
                        data: Data::Remote {
                            store: remote.store.clone(),
                            path,
                        },
                        size,
                        header,
                    })
                }
            })
            .buffered(16)
            .try_collect()
            .await
    })
}
