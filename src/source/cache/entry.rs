//! Where the cached copy of one object lives, whether it is there and current, and how a filled
//! copy is verified and published.
//!
//! Two layouts:
//! - Hub objects ([`CacheIdentity::hub`]): the Hugging Face cache ([`layout`]). A blob is
//!   named by its content's etag, so a blob of the right size is the right content; publishing
//!   adds the snapshot link and the ref.
//! - Everything else: `<dir>/objects/<h>.safetensors` with a sidecar `<h>.json` recording the
//!   object's URI, size and ETag, where `<h>` is a hash of the URI. The copy is used only while
//!   the sidecar matches what the store reports now (same ETag or sha256, same size).
//!
//! Files being filled are `<final>.fastload-partial` (not huggingface_hub's `.incomplete`,
//! which it would resume as if filled from the start), written only under the entry's lock.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use super::CacheSettings;
use crate::source::hub::layout;
use crate::source::identity::{CacheIdentity, HubLocation};

/// The files of one cache entry.
#[derive(Debug, Clone)]
pub struct Entry {
    pub identity: CacheIdentity,
    /// The published copy (a blob for Hub objects).
    pub path: PathBuf,
    /// The file being filled.
    pub partial: PathBuf,
    /// The advisory lock a filler holds (huggingface_hub's for Hub blobs).
    pub lock: PathBuf,
    /// The identity record (non-Hub entries only).
    pub sidecar: Option<PathBuf>,
    /// The cache directory the entry lies under (the HF cache for Hub objects), for messages.
    pub root: PathBuf,
}

/// Blob ids longer than this (a 400-character ETag), or not plain file names, name their blob
/// by their sha256 instead: file names are limited to 255 bytes.
const MAX_BLOB_NAME: usize = 128;

/// What a non-Hub entry (and a named copy, [`super::named`]) records about the object it copies.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
pub(super) struct Record {
    pub uri: String,
    pub size: u64,
    pub etag: Option<String>,
    pub sha256: Option<String>,
}

impl Entry {
    /// The entry for `identity`, or `None` when it cannot be cached: no strong ETag nor sha256
    /// to tell a changed object from the copy (a weak `W/` ETag says "equivalent", not "the same
    /// bytes", so it is no identity), or a Hub path that is not a plain relative path.
    pub fn new(identity: &CacheIdentity, settings: &CacheSettings) -> Option<Entry> {
        let mut identity = identity.clone();
        if let Some(hub) = &mut identity.hub {
            if !layout::is_safe_path_in_repo(&hub.path_in_repo) {
                return None;
            }
            let plain = hub.blob_id.len() <= MAX_BLOB_NAME
                && layout::is_safe_path_in_repo(&hub.blob_id)
                && !hub.blob_id.contains('/');
            if !plain {
                // Too long for a file name, or not one: named by its hash (the snapshot link
                // points at that name, so huggingface_hub still finds the file).
                hub.blob_id = format!("fastload-{}", hex(&sha256(hub.blob_id.as_bytes())));
            }
            let root = &settings.hub_root;
            let repo = layout::repo_path(root, &hub.repo_type, &hub.repo_id);
            let path = layout::blob_path(&repo, &hub.blob_id);
            let lock = layout::lock_path(root, &hub.repo_type, &hub.repo_id, &hub.blob_id);
            return Some(Entry {
                partial: with_suffix(&path, ".fastload-partial"),
                path,
                lock,
                sidecar: None,
                root: root.clone(),
                identity,
            });
        }
        let strong = identity.etag.as_deref().is_some_and(|e| !is_weak(e));
        if !strong && identity.sha256.is_none() {
            return None;
        }
        let root = settings.dir.clone()?;
        let dir = root.join("objects");
        let key = hex(&sha256(identity.uri.as_bytes()))[..32].to_string();
        let path = dir.join(format!("{key}.safetensors"));
        Some(Entry {
            partial: with_suffix(&path, ".fastload-partial"),
            lock: dir.join(format!("{key}.lock")),
            sidecar: Some(dir.join(format!("{key}.json"))),
            path,
            root,
            identity,
        })
    }

    /// Why this entry's cache directory cannot be used (`disabled_reason`): the directory and
    /// the OS error.
    pub fn unusable(&self, e: &std::io::Error) -> String {
        format!(
            "cannot use the cache directory {}: {e}",
            self.root.display()
        )
    }

    /// Whether a published copy of this very object is there: right size, and for non-Hub
    /// entries a sidecar naming the same URI and ETag (or sha256).
    pub fn is_cached(&self) -> bool {
        let size_ok = fs::metadata(&self.path)
            .map(|m| m.is_file() && m.len() == self.identity.size)
            .unwrap_or(false);
        if !size_ok {
            return false;
        }
        match &self.sidecar {
            None => true,
            Some(sidecar) => {
                let Ok(bytes) = fs::read(sidecar) else {
                    return false;
                };
                serde_json::from_slice::<Record>(&bytes).is_ok_and(|s| s == self.record())
            }
        }
    }

    /// `verify=True` on a published copy: whether its sha256 (where the object's is known; else
    /// a Hub file's git blob id) is the object's. A copy that is not is removed (with a warning), so that the object is read
    /// from the network, and filled again.
    pub(crate) fn copy_matches(&self, run: &super::Run) -> bool {
        let (what, want, hashed) = if let Some(want) = &self.identity.sha256 {
            ("sha256", want, hash_file(&self.path))
        } else if let Some(want) = self.git_blob_id() {
            // A Hub file outside LFS, named by its git blob id.
            (
                "git blob id",
                &want.to_string(),
                git_blob_sha1(&self.path, self.identity.size),
            )
        } else {
            return true;
        };
        match hashed {
            Ok(got) if got.eq_ignore_ascii_case(want) => true,
            Ok(got) => {
                let _ = fs::remove_file(&self.path);
                if let Some(sidecar) = &self.sidecar {
                    let _ = fs::remove_file(sidecar);
                }
                run.warn(&format!(
                    "{}: the cached copy {} has {what} {got}, not {want}: removed, read from \
                     the network",
                    self.identity.uri,
                    self.path.display()
                ));
                false
            }
            Err(e) => {
                run.warn(&format!(
                    "{}: cannot read the cached copy {}: {e}; read from the network",
                    self.identity.uri,
                    self.path.display()
                ));
                false
            }
        }
    }

    /// For Hub entries found in the cache: adds the snapshot link and ref when missing (another
    /// revision's load may have published the blob). Failures are ignored: the blob serves.
    pub fn complete_hub_links(&self) {
        if let Some(hub) = &self.identity.hub {
            let _ = link_snapshot(&self.path, hub);
        }
    }

    /// The git blob id (sha1) a Hub file outside LFS is known by, where it looks like one.
    fn git_blob_id(&self) -> Option<&str> {
        let hub = self.identity.hub.as_ref()?;
        let id = hub.blob_id.as_str();
        (id.len() == 40 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
    }

    fn record(&self) -> Record {
        Record {
            uri: self.identity.uri.clone(),
            size: self.identity.size,
            etag: self.identity.etag.clone(),
            sha256: self.identity.sha256.clone(),
        }
    }

    /// Verifies the filled partial file (size; sha256 where known) and publishes it atomically.
    /// On a mismatch the partial is deleted and the reason returned.
    pub fn verify_and_publish(&self, file: &File) -> Result<(), String> {
        let failed = |what: String| {
            let _ = fs::remove_file(&self.partial);
            Err(what)
        };
        file.sync_all()
            .map_err(|e| format!("cannot flush {}: {e}", self.partial.display()))?;
        let len = file.metadata().map(|m| m.len()).unwrap_or(u64::MAX);
        if len != self.identity.size {
            let size = self.identity.size;
            return failed(format!("the copy has {len} bytes, the object {size}"));
        }
        if let Some(want) = &self.identity.sha256 {
            let got = hash_file(&self.partial)
                .map_err(|e| format!("cannot read {}: {e}", self.partial.display()))?;
            if !got.eq_ignore_ascii_case(want) {
                return failed(format!(
                    "sha256 {got} of the copy is not the object's {want}"
                ));
            }
        } else if let Some(want) = self.git_blob_id() {
            // A Hub file outside LFS is named by its git blob id: that can be checked too.
            let got = git_blob_sha1(&self.partial, len)
                .map_err(|e| format!("cannot read {}: {e}", self.partial.display()))?;
            if !got.eq_ignore_ascii_case(want) {
                return failed(format!(
                    "git blob id {got} of the copy is not the file's {want}"
                ));
            }
        }
        let io = |e: std::io::Error| format!("cannot publish {}: {e}", self.path.display());
        if let Some(sidecar) = &self.sidecar {
            // An old record goes first: between the two renames, no record matches.
            let _ = fs::remove_file(sidecar);
            fs::rename(&self.partial, &self.path).map_err(io)?;
            let text = serde_json::to_vec_pretty(&self.record()).expect("a record serializes");
            write_atomically(sidecar, &text).map_err(io)?;
        } else {
            fs::rename(&self.partial, &self.path).map_err(io)?;
        }
        if let Some(parent) = self.path.parent() {
            let _ = File::open(parent).and_then(|d| d.sync_all());
        }
        if let Some(hub) = &self.identity.hub {
            link_snapshot(&self.path, hub).map_err(io)?;
        }
        Ok(())
    }
}

/// `snapshots/<commit>/<path>` → the blob (a relative link, replaced atomically), then
/// `refs/<revision>` → the commit.
fn link_snapshot(blob: &Path, hub: &HubLocation) -> std::io::Result<()> {
    let repo = blob
        .parent()
        .and_then(Path::parent)
        .expect("a blob lies in <repo>/blobs");
    let link = layout::snapshot_path(repo, &hub.commit, &hub.path_in_repo);
    let target = layout::blob_link_target(&hub.path_in_repo, &hub.blob_id);
    if fs::read_link(&link).ok().as_deref() != Some(target.as_path()) {
        fs::create_dir_all(link.parent().expect("a snapshot file has a folder"))?;
        let tmp = with_suffix(&link, &format!(".fastload-{}", std::process::id()));
        let _ = fs::remove_file(&tmp);
        std::os::unix::fs::symlink(&target, &tmp)?;
        fs::rename(&tmp, &link)?;
    }
    if let Some(revision) = &hub.revision {
        if revision != &hub.commit && layout::is_safe_path_in_repo(revision) {
            let ref_file = layout::ref_path(repo, revision);
            if layout::read_ref(repo, revision).as_deref() != Some(hub.commit.as_str()) {
                fs::create_dir_all(ref_file.parent().expect("a ref has a folder"))?;
                write_atomically(&ref_file, hub.commit.as_bytes())?;
            }
        }
    }
    Ok(())
}

/// Writes `bytes` to a temporary file beside `path`, flushes it and renames it over `path`.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let tmp = with_suffix(path, &format!(".fastload-{}", std::process::id()));
    let mut file = File::create(&tmp)?;
    file.write_all(bytes)?;
    file.sync_all()?;
    fs::rename(&tmp, path)
}

/// Whether an ETag is weak (`W/"..."`): the same weak ETag may name different bytes.
pub fn is_weak(etag: &str) -> bool {
    etag.trim_start().starts_with("W/")
}

pub fn with_suffix(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(suffix);
    path.with_file_name(name)
}

pub fn sha256(bytes: &[u8]) -> Vec<u8> {
    ring::digest::digest(&ring::digest::SHA256, bytes)
        .as_ref()
        .to_vec()
}

pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The lowercase hex sha256 of a file, read in 8 MiB pieces.
fn hash_file(path: &Path) -> std::io::Result<String> {
    hash_with(path, &ring::digest::SHA256, b"")
}

/// A file's git blob id: sha1 of `blob <len>\0` and the bytes.
fn git_blob_sha1(path: &Path, len: u64) -> std::io::Result<String> {
    let prefix = format!("blob {len}\0");
    hash_with(
        path,
        &ring::digest::SHA1_FOR_LEGACY_USE_ONLY,
        prefix.as_bytes(),
    )
}

fn hash_with(
    path: &Path,
    algorithm: &'static ring::digest::Algorithm,
    prefix: &[u8],
) -> std::io::Result<String> {
    let mut file = File::open(path)?;
    let mut ctx = ring::digest::Context::new(algorithm);
    ctx.update(prefix);
    let mut buf = vec![0u8; 8 << 20];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => ctx.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(hex(ctx.finish().as_ref()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn identity(uri: &str, etag: Option<&str>, hub: Option<HubLocation>) -> CacheIdentity {
        CacheIdentity {
            uri: uri.into(),
            size: 5,
            etag: etag.map(String::from),
            sha256: None,
            hub,
        }
    }

    fn settings(dir: &Path) -> CacheSettings {
        CacheSettings {
            dir: Some(dir.join("fl")),
            hub_root: dir.join("hub"),
            fill: true,
            verify: false,
            ..Default::default()
        }
    }

    fn fill(entry: &Entry, bytes: &[u8]) -> File {
        fs::create_dir_all(entry.partial.parent().unwrap()).unwrap();
        fs::write(&entry.partial, bytes).unwrap();
        File::open(&entry.partial).unwrap()
    }

    #[test]
    fn objects_without_etag_or_sha_are_not_cached() {
        let dir = tempfile::tempdir().unwrap();
        assert!(Entry::new(&identity("s3://b/k", None, None), &settings(dir.path())).is_none());
    }

    #[test]
    fn a_published_copy_serves_its_etag_only() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path());
        let entry = Entry::new(&identity("s3://b/k", Some("\"a\""), None), &s).unwrap();
        assert!(!entry.is_cached());
        entry.verify_and_publish(&fill(&entry, b"hello")).unwrap();
        assert!(entry.is_cached());
        assert!(!entry.partial.exists());
        assert_eq!(fs::read(&entry.path).unwrap(), b"hello");
        let changed = Entry::new(&identity("s3://b/k", Some("\"b\""), None), &s).unwrap();
        assert_eq!(changed.path, entry.path);
        assert!(!changed.is_cached());
    }

    #[test]
    fn a_wrong_size_or_sha_deletes_the_partial_and_publishes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path());
        let mut id = identity("s3://b/k", Some("\"a\""), None);
        let entry = Entry::new(&id, &s).unwrap();
        assert!(entry.verify_and_publish(&fill(&entry, b"hell")).is_err());
        assert!(!entry.partial.exists() && !entry.path.exists());
        id.sha256 = Some(hex(&sha256(b"world")));
        let entry = Entry::new(&id, &s).unwrap();
        let err = entry
            .verify_and_publish(&fill(&entry, b"hello"))
            .unwrap_err();
        assert!(err.contains("sha256"), "{err}");
        assert!(!entry.partial.exists() && !entry.path.exists());
        id.sha256 = Some(hex(&sha256(b"hello")));
        let entry = Entry::new(&id, &s).unwrap();
        entry.verify_and_publish(&fill(&entry, b"hello")).unwrap();
        assert!(entry.is_cached());
    }

    #[test]
    fn hub_objects_publish_blob_snapshot_link_and_ref() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path());
        let hub = HubLocation {
            repo_type: "model".into(),
            repo_id: "org/name".into(),
            commit: "c".repeat(40),
            revision: Some("main".into()),
            path_in_repo: "sub/m.safetensors".into(),
            blob_id: "b".repeat(64),
        };
        let entry = Entry::new(&identity("hf://org/name", None, Some(hub.clone())), &s).unwrap();
        let repo = dir.path().join("hub/models--org--name");
        assert_eq!(entry.path, repo.join("blobs").join("b".repeat(64)));
        assert_eq!(
            entry.lock,
            dir.path()
                .join("hub/.locks/models--org--name")
                .join(format!("{}.lock", "b".repeat(64)))
        );
        entry.verify_and_publish(&fill(&entry, b"hello")).unwrap();
        let link = layout::snapshot_path(&repo, &hub.commit, &hub.path_in_repo);
        assert_eq!(fs::read(&link).unwrap(), b"hello");
        assert!(fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink());
        assert_eq!(layout::read_ref(&repo, "main"), Some(hub.commit.clone()));
        assert!(entry.is_cached());
        let mut evil = hub;
        evil.path_in_repo = "../x".into();
        assert!(Entry::new(&identity("hf://o/n", None, Some(evil)), &s).is_none());
    }
}
