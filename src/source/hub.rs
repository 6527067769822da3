//! Files of a Hugging Face Hub repo (`hf://`) as sources. Opening resolves the revision to a
//! commit once, picks the files (the index's shards, else the folder's `*.safetensors`), and asks
//! `resolve/` for each file's size and storage location, concurrently. A read is one ranged GET of
//! that location (the token only goes to the Hub's own host), resumed when the body breaks off;
//! the location is resolved again when its signature expires or the storage host refuses it.
//!
//! With `HF_HUB_OFFLINE` set, nothing is asked of the network: the files come from the Hugging
//! Face cache (`refs/<revision>` → `snapshots/<commit>/`) as local files.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use futures_util::stream::{StreamExt, TryStreamExt};
use reqwest::header::{CONTENT_RANGE, RANGE};
use reqwest::{Method, StatusCode};

use super::{local, Source};
use crate::cache::{hub_layout, CacheIdentity, CacheSettings, HubLocation};
use crate::error::{Error, Result};
use crate::format::{index_shard_names, INDEX_FILE};
use crate::hub::api::{self, io_error, net_error, FileMeta, Hub};
use crate::hub::location::Location;
use crate::hub::{HubSettings, HubUri};
use crate::object::{Decision, RetrySettings};

/// `resolve/` requests in flight while opening.
const META_CONCURRENCY: usize = 16;
/// Times in a row a storage host may refuse a freshly resolved location before a read fails.
const MAX_REFUSED: u32 = 2;

/// One file of a repo at a commit.
#[derive(Debug)]
pub struct HubFile {
    /// `hf://org/name@<commit>/<path>`.
    name: String,
    repo_id: String,
    hub: Hub,
    resolve_url: url::Url,
    size: u64,
    etag: Option<String>,
    location: Mutex<Location>,
    identity: CacheIdentity,
}

impl HubFile {
    /// The location to read from: the one known while it is fresh, else resolved again.
    async fn location(&self, refresh: bool) -> Result<Location> {
        let known = self.location.lock().expect("location lock").clone();
        if !refresh && known.fresh() {
            return Ok(known);
        }
        let meta = self
            .hub
            .file_meta(&self.name, &self.repo_id, &self.resolve_url)
            .await?;
        if meta.size != self.size || (self.etag.is_some() && meta.etag != self.etag) {
            return Err(io_error(
                &self.name,
                io::ErrorKind::InvalidData,
                "the file changed on the Hub while it was being read (size or ETag differs)",
            ));
        }
        *self.location.lock().expect("location lock") = meta.location.clone();
        Ok(meta.location)
    }

    async fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let end = offset + dst.len() as u64;
        if end > self.size {
            return Err(io_error(
                &self.name,
                io::ErrorKind::UnexpectedEof,
                format!(
                    "cannot read bytes {offset}..{end} of a {} byte file",
                    self.size
                ),
            ));
        }
        let mut resume = self.hub.retry.resume_state();
        let mut done = 0usize;
        let mut refresh = false;
        let mut refused = 0;
        while done < dst.len() {
            let location = self.location(refresh).await?;
            refresh = false;
            let start = offset + done as u64;
            let range = format!("bytes={start}-{}", end - 1);
            let response = self
                .hub
                .send(&self.name, || {
                    self.hub
                        .request(Method::GET, &location.url)
                        .header(RANGE, range.as_str())
                })
                .await?;
            let status = response.status();
            if matches!(status.as_u16(), 401 | 403) && !location.same_host {
                // An expired or revoked signature: resolve again, a few times at most.
                refused += 1;
                if refused > MAX_REFUSED {
                    return Err(api::status_error(
                        &self.name,
                        status,
                        response.headers(),
                        "from the storage host, even with a freshly resolved location",
                    ));
                }
                refresh = true;
                continue;
            }
            let response = self.hub.check(&self.name, &self.repo_id, response).await?;
            let whole = status == StatusCode::OK && start == 0 && end == self.size;
            if status != StatusCode::PARTIAL_CONTENT && !whole {
                return Err(io_error(
                    &self.name,
                    io::ErrorKind::InvalidData,
                    format!("the storage host answered {status} to a range request"),
                ));
            }
            if status == StatusCode::PARTIAL_CONTENT {
                check_content_range(&self.name, &response, start, end)?;
            }
            refused = 0;
            let before = done;
            let cut = match self.copy(response, dst, &mut done, &mut resume).await? {
                Ok(cut) => cut,
                Err(Decision::Resume { wait, .. }) => {
                    tokio::time::sleep(wait).await;
                    continue;
                }
                Err(Decision::GiveUp { reason }) => {
                    return Err(io_error(
                        &self.name,
                        io::ErrorKind::TimedOut,
                        format!("bytes {offset}..{end} stalled after {done} bytes: {reason}"),
                    ))
                }
            };
            if done == dst.len() {
                break;
            }
            match resume.after_cut(done > before) {
                Decision::Resume { wait, .. } => tokio::time::sleep(wait).await,
                Decision::GiveUp { reason } => {
                    return Err(cut.unwrap_or_else(|| {
                        io_error(
                            &self.name,
                            io::ErrorKind::UnexpectedEof,
                            format!("body ended after {done} of {} bytes: {reason}", dst.len()),
                        )
                    }))
                }
            }
        }
        Ok(())
    }

    /// Copies a body into `dst[*done..]` until it ends (`Ok`, with the error that cut it, if
    /// any) or a window of the stall rule comes in below the minimum rate (`Err`: what next).
    async fn copy(
        &self,
        mut response: reqwest::Response,
        dst: &mut [u8],
        done: &mut usize,
        resume: &mut crate::object::ResumeState,
    ) -> Result<std::result::Result<Option<Error>, Decision>> {
        loop {
            let next = tokio::time::timeout_at(resume.window_end().into(), response.chunk()).await;
            match next {
                Ok(Ok(None)) => return Ok(Ok(None)),
                Ok(Err(e)) => return Ok(Ok(Some(net_error(&self.name, e)))),
                Ok(Ok(Some(chunk))) => {
                    if chunk.len() > dst.len() - *done {
                        return Err(io_error(
                            &self.name,
                            io::ErrorKind::InvalidData,
                            "the storage host sent more bytes than asked for",
                        ));
                    }
                    dst[*done..*done + chunk.len()].copy_from_slice(&chunk);
                    *done += chunk.len();
                    resume.arrived(chunk.len());
                }
                Err(_) if *done == dst.len() => return Ok(Ok(None)),
                Err(_) => {}
            }
            if std::time::Instant::now() >= resume.window_end() {
                if let Some(decision) = resume.window_passed() {
                    return Ok(Err(decision));
                }
            }
        }
    }
}

fn check_content_range(name: &str, r: &reqwest::Response, start: u64, end: u64) -> Result<()> {
    let got = api::header(r.headers(), CONTENT_RANGE.as_str()).unwrap_or_default();
    let expected = format!("bytes {start}-{}/", end - 1);
    if got.starts_with(&expected) {
        Ok(())
    } else {
        Err(io_error(
            name,
            io::ErrorKind::InvalidData,
            format!("asked for bytes {start}..{end}, got Content-Range {got:?}"),
        ))
    }
}

impl Source for HubFile {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.read(offset, dst))
    }

    fn cache_identity(&self) -> Option<CacheIdentity> {
        Some(self.identity.clone())
    }
}

/// Who a file is, for the cache: LFS files by their sha256 (`X-Linked-Etag`), others by their
/// git blob id; both are the blob's name in the Hugging Face cache. A weak ETag (a proxy's) names
/// no blob: such a file is not cached.
fn identity(uri: &HubUri, commit: &str, path: &str, meta: &FileMeta) -> Option<CacheIdentity> {
    let blob_id = meta.etag.clone()?;
    if meta.weak && !meta.lfs {
        return Some(CacheIdentity {
            uri: uri.file_uri(commit, path),
            size: meta.size,
            etag: Some(format!("W/\"{blob_id}\"")),
            sha256: None,
            hub: None,
        });
    }
    let revision = uri.revision();
    Some(CacheIdentity {
        uri: uri.file_uri(commit, path),
        size: meta.size,
        etag: Some(format!("\"{blob_id}\"")),
        sha256: meta.lfs.then(|| blob_id.to_lowercase()),
        hub: Some(HubLocation {
            repo_type: "model".into(),
            repo_id: uri.repo_id.clone(),
            commit: commit.to_string(),
            revision: (!crate::hub::is_commit(revision)).then(|| revision.to_string()),
            path_in_repo: path.to_string(),
            blob_id,
        }),
    })
}

/// The files an `hf://` URI names, opened: remote files, or with `HF_HUB_OFFLINE` the cached
/// snapshot's files.
/// Files are named `hf://org/name@<commit>/<path>`; `cache` says where the index file, read
/// whole here, is cached (the shards are cached by `crate::cache::wrap`).
pub fn open(
    uri: &str,
    storage_options: &[(String, String)],
    cache: &CacheSettings,
) -> Result<Vec<Arc<dyn Source>>> {
    let parsed = HubUri::parse(uri)?;
    let settings = HubSettings::from_env(storage_options)?;
    if settings.offline {
        return local::open(&[offline_path(&parsed)?.display().to_string()]);
    }
    let hub = Hub::new(settings, RetrySettings::default())?;
    crate::runtime::block_on(uri, open_remote(hub, parsed, cache))
}

async fn open_remote(hub: Hub, uri: HubUri, cache: &CacheSettings) -> Result<Vec<Arc<dyn Source>>> {
    let info = hub.repo_info(&uri).await?;
    let paths = pick_files(&hub, &uri, &info.commit, &info.files, cache).await?;
    let hub_ref = &hub;
    let commit = info.commit.as_str();
    let uri_ref = &uri;
    futures_util::stream::iter(paths)
        .map(|path| async move {
            let name = uri_ref.file_uri(commit, &path);
            let resolve_url = hub_ref.resolve_url(&uri_ref.repo_id, commit, &path);
            let meta = hub_ref
                .file_meta(&name, &uri_ref.repo_id, &resolve_url)
                .await?;
            let identity = identity(uri_ref, commit, &path, &meta).ok_or_else(|| {
                io_error(
                    &name,
                    io::ErrorKind::InvalidData,
                    "the Hub sent no ETag for this file",
                )
            })?;
            Ok(Arc::new(HubFile {
                name,
                repo_id: uri_ref.repo_id.clone(),
                hub: hub_ref.clone(),
                resolve_url,
                size: meta.size,
                etag: meta.etag,
                location: Mutex::new(meta.location),
                identity,
            }) as Arc<dyn Source>)
        })
        .buffered(META_CONCURRENCY)
        .try_collect()
        .await
}

/// The files to load: the URI's file; else the folder's index's shards; else the folder's
/// `*.safetensors` (direct children, sorted, as for a local directory).
async fn pick_files(
    hub: &Hub,
    uri: &HubUri,
    commit: &str,
    files: &[String],
    cache: &CacheSettings,
) -> Result<Vec<String>> {
    let name = uri.file_uri(commit, &uri.path);
    if files.iter().any(|f| f == &uri.path) {
        if uri.path.ends_with(".json") {
            return index_files(hub, uri, commit, &uri.path, cache).await;
        }
        return Ok(vec![uri.path.clone()]);
    }
    let folder = if uri.path.is_empty() {
        String::new()
    } else {
        format!("{}/", uri.path)
    };
    let index = format!("{folder}{INDEX_FILE}");
    if files.contains(&index) {
        return index_files(hub, uri, commit, &index, cache).await;
    }
    let shards: Vec<String> = files
        .iter()
        .filter(|f| {
            f.strip_prefix(&folder)
                .is_some_and(|rest| !rest.contains('/') && rest.ends_with(".safetensors"))
        })
        .cloned()
        .collect();
    if shards.is_empty() {
        let in_repo = files.iter().any(|f| f.starts_with(&folder));
        return Err(if in_repo {
            Error::NoShards { path: name }
        } else {
            Error::NotFound { path: name }
        });
    }
    let mut shards = shards;
    shards.sort();
    Ok(shards)
}

async fn index_files(
    hub: &Hub,
    uri: &HubUri,
    commit: &str,
    index: &str,
    cache: &CacheSettings,
) -> Result<Vec<String>> {
    let name = uri.file_uri(commit, index);
    let url = hub.resolve_url(&uri.repo_id, commit, index);
    let (meta, bytes) = hub.fetch(&name, &uri.repo_id, &url).await?;
    if let Some(identity) = identity(uri, commit, index, &meta) {
        if cache.enabled() && identity.size == bytes.len() as u64 {
            crate::cache::put_whole(&identity, &bytes, cache);
        }
    }
    let dir = index
        .rsplit_once('/')
        .map(|(d, _)| format!("{d}/"))
        .unwrap_or_default();
    Ok(index_shard_names(&bytes)
        .map_err(|e| Error::format(&name, e))?
        .into_iter()
        .map(|f| format!("{dir}{f}"))
        .collect())
}

/// The cached snapshot path of `uri` (`HF_HUB_OFFLINE`): `refs/<revision>` gives the commit
/// unless the revision is one.
fn offline_path(uri: &HubUri) -> Result<PathBuf> {
    let repo = hub_layout::repo_path(&hub_layout::hub_cache_root(), "model", &uri.repo_id);
    let revision = uri.revision();
    let commit = if crate::hub::is_commit(revision) {
        Some(revision.to_lowercase())
    } else {
        match hub_layout::read_ref(&repo, revision) {
            // Checked as online: anything else (`../../x`) would name a folder outside the cache.
            Some(commit) if !crate::hub::is_commit(&commit) => {
                return Err(io_error(
                    &format!("hf://{}@{revision}", uri.repo_id),
                    io::ErrorKind::InvalidData,
                    format!(
                        "HF_HUB_OFFLINE is set and {} holds {commit:?}, not a 40-hex commit",
                        hub_layout::ref_path(&repo, revision).display()
                    ),
                ))
            }
            other => other.map(|c| c.to_lowercase()),
        }
    };
    let snapshot = commit.map(|c| repo.join("snapshots").join(c));
    match snapshot {
        Some(root) if root.is_dir() => {
            // The revision is cached: a path missing from it is a missing file, not revision.
            let path = root.join(&uri.path);
            if std::fs::symlink_metadata(&path).is_ok() {
                Ok(path)
            } else {
                Err(Error::NotFound {
                    path: format!("hf://{}@{revision}/{}", uri.repo_id, uri.path),
                })
            }
        }
        _ => Err(io_error(
            &format!("hf://{}@{revision}", uri.repo_id),
            io::ErrorKind::NotFound,
            format!(
                "HF_HUB_OFFLINE is set and revision {revision} of {} is not in the Hugging Face \
                 cache ({}); load it once online (with cache=) or unset HF_HUB_OFFLINE",
                uri.repo_id,
                repo.display()
            ),
        )),
    }
}
