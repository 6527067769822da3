//! Files of a Hugging Face Hub repo (`hf://`) as sources. Opening resolves the revision to a
//! commit once, picks the files (the index's shards, else the folder's `*.safetensors`), and asks
//! `resolve/` for each file's size and storage location, concurrently. A read is one ranged GET of
//! that location (the token only goes to the Hub's own host) through [`crate::source::remote`]'s one
//! resumable read, pinned to the storage host's ETag (`If-Match`); the location is resolved again
//! when its signature expires or the storage host refuses it.
//!
//! With `HF_HUB_OFFLINE` set, nothing is asked of the network: the files come from the Hugging
//! Face cache (`refs/<revision>` → `snapshots/<commit>/`) as local files.

use std::io;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use futures_util::future::BoxFuture;
use futures_util::stream::{StreamExt, TryStreamExt};
use reqwest::header::{
    ACCEPT_ENCODING, CONTENT_ENCODING, CONTENT_LENGTH, CONTENT_RANGE, ETAG, IF_MATCH,
    LAST_MODIFIED, RANGE,
};
use reqwest::{Method, StatusCode};

use super::api::{self, net_error, FileMeta, Hub};
use super::layout;
use super::location::Location;
use super::{HubSettings, HubUri};
use crate::error::{Error, Result};
use crate::format::{check_folder, index_shard_names, INDEX_FILE};
use crate::source::identity::{CacheIdentity, HubLocation};
use crate::source::remote::{self, io_error, Answer, Pin, RangedGet, Response, Version};
use crate::source::{local, Source};

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
    /// The version every read is pinned to: the storage host's ETag (for a file the Hub serves
    /// itself, the one `resolve/` sent; else the first response's), for the host in `pin_host`.
    pin: Pin,
    pin_host: Mutex<Option<String>>,
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
            return Err(remote::changed(
                &self.name,
                "its size or ETag on the Hub differs from when loading began",
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
        let get = HubGet { file: self };
        remote::read_range(&get, &self.pin, &self.name, offset, dst, &self.hub.retry).await
    }
}

/// The ranged requests of one Hub file: a GET of its storage location, resolved again when its
/// signature expired or the storage host refuses it, with `If-Match` once the storage host's
/// ETag is pinned.
struct HubGet<'f> {
    file: &'f HubFile,
}

// boilerplate: the RangedGet signature, as every location of an object implements it
impl RangedGet for HubGet<'_> {
    fn get<'a>(
        &'a self,
        range: std::ops::Range<u64>,
        pinned: &'a Version,
    ) -> BoxFuture<'a, Result<Answer>> {
        Box::pin(self.request(range, pinned))
    }

    /// For a file the Hub serves itself, what `resolve/` says now (the ETag its reads are
    /// pinned to came from there); a storage host's reads pin their first response instead.
    fn head(&self) -> BoxFuture<'_, Result<Option<Version>>> {
        Box::pin(async move {
            let file = self.file;
            let meta = file
                .hub
                .file_meta(&file.name, &file.repo_id, &file.resolve_url)
                .await?;
            Ok(meta.location.same_host.then(|| Version {
                etag: meta.etag_header,
                ..Version::default()
            }))
        })
    }
}

impl HubGet<'_> {
    async fn request(&self, range: std::ops::Range<u64>, pinned: &Version) -> Result<Answer> {
        let file = self.file;
        let name = file.name.as_str();
        let mut refresh = false;
        let mut refused = 0;
        loop {
            let location = file.location(refresh).await?;
            let if_match = self.if_match(&location, pinned);
            let response = self.send(&location, &range, if_match.as_deref()).await?;
            let status = response.status();
            if status == StatusCode::PRECONDITION_FAILED {
                let sent = if_match.map(|etag| format!("If-Match: {etag}"));
                return Ok(Answer::Refused {
                    sent: sent.unwrap_or_default(),
                });
            }
            if matches!(status.as_u16(), 401 | 403) && !location.same_host {
                // An expired or revoked signature: resolve again, a few times at most.
                refused += 1;
                if refused > MAX_REFUSED {
                    return Err(api::status_error(
                        name,
                        status,
                        response.headers(),
                        "from the storage host, even with a freshly resolved location",
                    ));
                }
                refresh = true;
                continue;
            }
            let response = file.hub.check(name, &file.repo_id, response).await?;
            return self.answer(response, &range);
        }
    }

    /// The `If-Match` of a read from `location`: the pinned ETag while reads stay on the host it
    /// came from. The pin is the storage host's ETag: another host (a location resolved again
    /// elsewhere) has its own, and the file's metadata was checked on resolving.
    fn if_match(&self, location: &Location, pinned: &Version) -> Option<String> {
        let file = self.file;
        let host = location.url.origin().ascii_serialization();
        let mut pin_host = file.pin_host.lock().expect("pin lock");
        if pin_host.as_deref() != Some(host.as_str()) {
            if pin_host.is_some() {
                file.pin.reset();
            }
            *pin_host = Some(host);
            None
        } else {
            pinned.strong_etag().map(str::to_string)
        }
    }

    /// One ranged GET of `location`, through the Hub's retry loop.
    async fn send(
        &self,
        location: &Location,
        range: &std::ops::Range<u64>,
        if_match: Option<&str>,
    ) -> Result<reqwest::Response> {
        let file = self.file;
        let range_header = format!("bytes={}-{}", range.start, range.end - 1);
        file.hub
            .send(&file.name, || {
                let request = file
                    .hub
                    .request(Method::GET, &location.url)
                    .header(RANGE, range_header.as_str())
                    // The bytes as stored: a CDN (the Hub's Xet bridge on CloudFront) ignores
                    // Range and sends the whole file when gzip is accepted.
                    .header(ACCEPT_ENCODING, "identity");
                match if_match {
                    Some(etag) => request.header(IF_MATCH, etag),
                    None => request,
                }
            })
            .await
    }

    /// A storage host's answer to the read of `range` (checked by the Hub's rules): the bytes
    /// and the version they are of, or why they cannot be used.
    fn answer(&self, response: reqwest::Response, range: &std::ops::Range<u64>) -> Result<Answer> {
        let file = self.file;
        let name = file.name.as_str();
        let (start, end) = (range.start, range.end);
        let status = response.status();
        let headers = response.headers();
        let (served, size) = match status {
            StatusCode::PARTIAL_CONTENT => content_range(name, headers, start, end)?,
            StatusCode::OK if start == 0 && end == file.size && whole(headers, end) => {
                (0..file.size, None)
            }
            StatusCode::OK => {
                return Err(io_error(
                    name,
                    io::ErrorKind::InvalidData,
                    format!(
                        "the storage host ignored Range: it answered 200 OK with the whole \
                         file (Content-Length {}) to a request for bytes {start}..{end}",
                        api::header(headers, CONTENT_LENGTH.as_str()).unwrap_or("absent")
                    ),
                ))
            }
            _ => {
                return Err(io_error(
                    name,
                    io::ErrorKind::InvalidData,
                    format!("the storage host answered {status} to a range request"),
                ))
            }
        };
        let version = Version {
            etag: api::header(headers, ETAG.as_str()).map(str::to_string),
            version: None,
            last_modified: api::header(headers, LAST_MODIFIED.as_str()).map(str::to_string),
        };
        let owned = name.to_string();
        let body = response
            .bytes_stream()
            .map_err(move |e| net_error(&owned, e))
            .boxed();
        Ok(Answer::Bytes(Response {
            range: served,
            size,
            version,
            body,
        }))
    }
}

/// Whether a 200 carries exactly the `size` bytes asked for: no content coding, and no other
/// `Content-Length`.
fn whole(headers: &reqwest::header::HeaderMap, size: u64) -> bool {
    let coding = api::header(headers, CONTENT_ENCODING.as_str()).unwrap_or("identity");
    let length = api::header(headers, CONTENT_LENGTH.as_str());
    coding.eq_ignore_ascii_case("identity") && length.is_none_or(|l| l.trim().parse() == Ok(size))
}

/// The range and object size a 206's `Content-Range` (`bytes a-b/size`) names.
fn content_range(
    name: &str,
    headers: &reqwest::header::HeaderMap,
    start: u64,
    end: u64,
) -> Result<(std::ops::Range<u64>, Option<u64>)> {
    let got = api::header(headers, CONTENT_RANGE.as_str()).unwrap_or_default();
    let parsed = got.strip_prefix("bytes ").and_then(|rest| {
        let (span, size) = rest.split_once('/')?;
        let (a, b) = span.split_once('-')?;
        let (a, b) = (a.trim().parse::<u64>().ok()?, b.trim().parse::<u64>().ok()?);
        Some((a..b.checked_add(1)?, size.trim().parse::<u64>().ok()))
    });
    parsed.ok_or_else(|| {
        io_error(
            name,
            io::ErrorKind::InvalidData,
            format!("asked for bytes {start}..{end}, got Content-Range {got:?}"),
        )
    })
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
            revision: (!super::is_commit(revision)).then(|| revision.to_string()),
            path_in_repo: path.to_string(),
            blob_id,
        }),
    })
}

/// The files an `hf://` URI names, opened: remote files, or with `HF_HUB_OFFLINE` the cached
/// snapshot's files.
/// Files are named `hf://org/name@<commit>/<path>`. An index file, read whole here, is handed to
/// `keep` with its identity (the opener caches it; the shards are cached by the opener too).
pub fn open(
    uri: &str,
    storage_options: &[(String, String)],
    keep: &Keep<'_>,
) -> Result<Vec<Arc<dyn Source>>> {
    let parsed = HubUri::parse(uri)?;
    // The retry and stall-rule keys of object stores (max_retries, retry_timeout, min_rate,
    // min_rate_window) drive the Hub's requests and reads too.
    let (retry, rest) = crate::store::split_retry_options(storage_options)?;
    let settings = HubSettings::from_env(&rest)?;
    if settings.offline {
        return local::open(&[offline_path(&parsed)?.display().to_string()]);
    }
    let hub = Hub::new(settings, retry)?;
    crate::runtime::block_on(uri, open_remote(hub, parsed, keep))
}

/// What [`open`] hands a file it read whole while opening (an index file), with its identity.
pub type Keep<'a> = dyn Fn(&CacheIdentity, &[u8]) + Sync + 'a;

async fn open_remote(hub: Hub, uri: HubUri, keep: &Keep<'_>) -> Result<Vec<Arc<dyn Source>>> {
    let info = hub.repo_info(&uri).await?;
    let paths = pick_files(&hub, &uri, &info.commit, &info.files, keep).await?;
    let hub_ref = &hub;
    let commit = info.commit.as_str();
    let uri_ref = &uri;
    futures_util::stream::iter(paths)
        .map(|path| async move {
            Ok(open_file(hub_ref, uri_ref, commit, &path).await? as Arc<dyn Source>)
        })
        .buffered(META_CONCURRENCY)
        .try_collect()
        .await
}

/// What [`open_tree`] finds: whether the URI named one file, and each file with its name.
pub type Tree = (bool, Vec<(String, Arc<dyn Source>)>);

/// Every file of the repo under the URI's path (the path itself when it names a file), for a
/// copy: `(path relative to the URI's folder, source)` in name order, and whether the URI named
/// one file (then its name is the file's base name). Each
/// source's `cache_identity` gives its sha256 or git blob id.
pub fn open_tree(uri: &str, storage_options: &[(String, String)]) -> Result<Tree> {
    let parsed = HubUri::parse(uri)?;
    let (retry, rest) = crate::store::split_retry_options(storage_options)?;
    let settings = HubSettings::from_env(&rest)?;
    let hub = Hub::new(settings, retry)?;
    crate::runtime::block_on(uri, async move {
        let info = hub.repo_info(&parsed).await?;
        let commit = info.commit.as_str();
        let single = info.files.contains(&parsed.path);
        let picked: Vec<(String, String)> = if single {
            let base = parsed.path.rsplit('/').next().unwrap_or(&parsed.path);
            vec![(base.to_string(), parsed.path.clone())]
        } else {
            let folder = if parsed.path.is_empty() {
                String::new()
            } else {
                format!("{}/", parsed.path)
            };
            let mut picked: Vec<(String, String)> = info
                .files
                .iter()
                .filter_map(|f| Some((f.strip_prefix(&folder)?.to_string(), f.clone())))
                .collect();
            picked.sort();
            if picked.is_empty() {
                return Err(Error::NotFound {
                    path: parsed.file_uri(commit, &parsed.path),
                });
            }
            picked
        };
        // Names from the listing become destination paths: a hostile one fails before any
        // file is opened (the copy checks again when it joins them to the destination).
        for (rel, path) in &picked {
            crate::format::check_inside(rel).map_err(|reason| Error::UnsupportedUri {
                uri: parsed.file_uri(commit, path),
                message: format!("its name {rel:?} cannot be copied: {reason}; nothing was copied"),
            })?;
        }
        let (hub_ref, uri_ref) = (&hub, &parsed);
        let opened: Vec<(String, Arc<dyn Source>)> = futures_util::stream::iter(picked)
            .map(|(rel, path)| async move {
                let file = open_file(hub_ref, uri_ref, commit, &path).await?;
                Ok::<_, Error>((rel, file as Arc<dyn Source>))
            })
            .buffered(META_CONCURRENCY)
            .try_collect()
            .await?;
        Ok((single, opened))
    })
}

/// One file of the repo at `commit`, its size, ETag and location asked of `resolve/`.
async fn open_file(
    hub_ref: &Hub,
    uri_ref: &HubUri,
    commit: &str,
    path: &str,
) -> Result<Arc<HubFile>> {
    let name = uri_ref.file_uri(commit, path);
    let resolve_url = hub_ref.resolve_url(&uri_ref.repo_id, commit, path);
    let meta = hub_ref
        .file_meta(&name, &uri_ref.repo_id, &resolve_url)
        .await?;
    let identity = identity(uri_ref, commit, path, &meta).ok_or_else(|| {
        io_error(
            &name,
            io::ErrorKind::InvalidData,
            "the Hub sent no ETag for this file",
        )
    })?;
    // A file the Hub serves itself is pinned to the ETag `resolve/` sent.
    let same_host = meta.location.same_host;
    let pin_host = same_host.then(|| meta.location.url.origin().ascii_serialization());
    let pinned = same_host.then(|| Version {
        etag: meta.etag_header.clone(),
        ..Version::default()
    });
    Ok(Arc::new(HubFile {
        name,
        repo_id: uri_ref.repo_id.clone(),
        hub: hub_ref.clone(),
        resolve_url,
        size: meta.size,
        etag: meta.etag,
        // From resolve/'s header: the form the Hub sends with the bytes.
        pin: Pin::new(Some(meta.size), pinned).confirmed(),
        pin_host: Mutex::new(pin_host),
        location: Mutex::new(meta.location),
        identity,
    }))
}

/// The files to load: the URI's file; else the folder's index's shards; else the folder's
/// `*.safetensors` (direct children, sorted, one whole checkpoint, as for a local directory).
async fn pick_files(
    hub: &Hub,
    uri: &HubUri,
    commit: &str,
    files: &[String],
    keep: &Keep<'_>,
) -> Result<Vec<String>> {
    let name = uri.file_uri(commit, &uri.path);
    if files.iter().any(|f| f == &uri.path) {
        if uri.path.ends_with(".json") {
            return index_files(hub, uri, commit, &uri.path, keep).await;
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
        return index_files(hub, uri, commit, &index, keep).await;
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
    let names: Vec<&str> = shards.iter().map(|f| &f[folder.len()..]).collect();
    check_folder(&names).map_err(|e| Error::format(&name, e))?;
    Ok(shards)
}

async fn index_files(
    hub: &Hub,
    uri: &HubUri,
    commit: &str,
    index: &str,
    keep: &Keep<'_>,
) -> Result<Vec<String>> {
    let name = uri.file_uri(commit, index);
    let url = hub.resolve_url(&uri.repo_id, commit, index);
    let (meta, bytes) = hub.fetch(&name, &uri.repo_id, &url).await?;
    if let Some(identity) = identity(uri, commit, index, &meta) {
        keep(&identity, &bytes);
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
    let repo = layout::repo_path(&layout::hub_cache_root(), "model", &uri.repo_id);
    let revision = uri.revision();
    let commit = if super::is_commit(revision) {
        Some(revision.to_lowercase())
    } else {
        match layout::read_ref(&repo, revision) {
            // Checked as online: anything else (`../../x`) would name a folder outside the cache.
            Some(commit) if !super::is_commit(&commit) => {
                return Err(io_error(
                    &format!("hf://{}@{revision}", uri.repo_id),
                    io::ErrorKind::InvalidData,
                    format!(
                        "HF_HUB_OFFLINE is set and {} holds {commit:?}, not a 40-hex commit",
                        layout::ref_path(&repo, revision).display()
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
        // The repo is not in the cache at all: a missing file, as huggingface_hub's
        // LocalEntryNotFoundError is a FileNotFoundError.
        _ if !repo.is_dir() => Err(Error::Missing {
            path: format!("hf://{}@{revision}", uri.repo_id),
            message: format!(
                "HF_HUB_OFFLINE is set and {} is not in the Hugging Face cache ({}); load it \
                 once online (with the local cache on) or unset HF_HUB_OFFLINE",
                uri.repo_id,
                repo.display()
            ),
        }),
        _ => Err(io_error(
            &format!("hf://{}@{revision}", uri.repo_id),
            io::ErrorKind::NotFound,
            format!(
                "HF_HUB_OFFLINE is set and revision {revision} of {} is not in the Hugging Face \
                 cache ({}); load it once online (with the local cache on) or unset HF_HUB_OFFLINE",
                uri.repo_id,
                repo.display()
            ),
        )),
    }
}
