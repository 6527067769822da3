//! Copies of small objects kept under their own names in a folder that libraries read (a model's
//! config and tokenizer files, beside weights that stream), each with the cache's record of the
//! object it copies ([`Record`]: URI, size, ETag, sha256) at `.cache/fastload/<name>.json`. A copy
//! is kept while its file still holds the bytes the record describes and the store answers "not
//! modified" to the record's ETag; else the object is fetched again. Every file goes through
//! [`inside`] (real folders only, written whole under a temporary name).

use std::io::Read;
use std::path::Path;

use super::entry::{hex, Record};
use super::inside;
use crate::error::{Error, Result};
use crate::source::object::{read_small_unless, Small};
use crate::store::Remote;

/// Where the records lie, inside the folder.
const RECORDS: &str = ".cache/fastload";

/// What [`fetch`] did with one object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetched {
    /// The copy there is current (the store said "not modified").
    Kept,
    /// The object was read (this many bytes) and its copy written.
    Written(u64),
    /// There is no such object (a copy fastload left of it is removed).
    Missing,
    /// The object has this many bytes, more than the cap; nothing was read or written.
    TooLarge(u64),
}

fn record_name(rel: &str) -> String {
    format!("{RECORDS}/{rel}.json")
}

/// The copy of the object `path` of `remote` at `dest/rel` (`rel` a plain relative name, checked
/// by the caller), fetched unless the one there is current; an object of more than `max_bytes`
/// is not read.
pub async fn fetch(
    remote: &Remote,
    path: &object_store::path::Path,
    dest: &Path,
    rel: &str,
    max_bytes: u64,
) -> Result<Fetched> {
    let uri = remote.uri_of(path);
    let known = known_etag(dest, rel, &uri);
    let small = match read_small_unless(remote, path, max_bytes, known).await {
        Err(Error::NotFound { .. }) => {
            forget(dest, rel);
            return Ok(Fetched::Missing);
        }
        other => other?,
    };
    let (bytes, etag) = match small {
        Small::Unchanged => return Ok(Fetched::Kept),
        Small::TooLarge { size } => return Ok(Fetched::TooLarge(size)),
        Small::Read { bytes, etag } => (bytes, etag),
    };
    inside::write(dest, rel, &bytes)?;
    match etag {
        Some(etag) => {
            let record = Record {
                uri,
                size: bytes.len() as u64,
                etag: Some(etag),
                sha256: Some(hex(&super::entry::sha256(&bytes))),
            };
            let text = serde_json::to_vec_pretty(&record).expect("a record serializes");
            inside::write(dest, &record_name(rel), &text)?;
        }
        // Nothing to ask the store with next time: the copy is fetched again then.
        None => inside::remove(dest, &record_name(rel)),
    }
    Ok(Fetched::Written(bytes.len() as u64))
}

/// The ETag the copy `dest/rel` of `uri` was fetched at, when its record says so and the file
/// still holds the bytes the record describes (writers racing on one name may leave a file and a
/// record of two versions: such a copy is fetched again, never kept on the wrong ETag).
fn known_etag(dest: &Path, rel: &str, uri: &str) -> Option<String> {
    let mut text = Vec::new();
    inside::open(dest, &record_name(rel))?
        .take(64 << 10)
        .read_to_end(&mut text)
        .ok()?;
    let record: Record = serde_json::from_slice(&text).ok()?;
    let (etag, want) = (record.etag?, record.sha256?);
    let mut file = inside::open(dest, rel)?;
    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
    let mut buf = vec![0u8; 1 << 16];
    let mut size = 0u64;
    loop {
        match file.read(&mut buf).ok()? {
            0 => break,
            n => {
                ctx.update(&buf[..n]);
                size += n as u64;
            }
        }
    }
    let current = record.uri == uri && record.size == size;
    (current && hex(ctx.finish().as_ref()) == want).then_some(etag)
}

/// Removes `dest/rel` when fastload put it there (it has a record): its object is gone.
fn forget(dest: &Path, rel: &str) {
    let record = record_name(rel);
    if inside::open(dest, &record).is_some() {
        inside::remove(dest, rel);
        inside::remove(dest, &record);
    }
}

/// The files directly in `dest` that fastload fetched there (they have a record), sorted.
pub fn fetched_names(dest: &Path) -> Vec<String> {
    let records = dest.join(RECORDS);
    if !std::fs::symlink_metadata(&records).is_ok_and(|m| m.is_dir()) {
        return Vec::new();
    }
    let Ok(entries) = std::fs::read_dir(&records) else {
        return Vec::new();
    };
    let mut names: Vec<String> = entries
        .filter_map(|e| e.ok())
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .filter_map(|e| {
            e.file_name()
                .to_str()?
                .strip_suffix(".json")
                .map(String::from)
        })
        .collect();
    names.sort();
    names
}

/// Removes the files fastload fetched directly into `dest` that are not in `keep` (their objects
/// are gone, or no longer pulled).
pub fn prune(dest: &Path, keep: &[String]) {
    for name in fetched_names(dest) {
        if !keep.contains(&name) {
            forget(dest, &name);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::path::Path as Key;
    use object_store::{ObjectStoreExt, PutPayload};
    use std::sync::Arc;

    async fn put(store: &InMemory, name: &str, data: &'static [u8]) {
        let key = Key::from(format!("m/{name}"));
        store
            .put(&key, PutPayload::from_static(data))
            .await
            .unwrap();
    }

    fn remote(store: Arc<InMemory>) -> Remote {
        Remote {
            store,
            path: Key::from("m"),
            uri: "memory:///m/".into(),
            is_prefix: true,
            retry: Default::default(),
            multipart: None,
        }
    }

    #[tokio::test]
    async fn copies_are_kept_while_current_and_fetched_again_when_not() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path();
        let store = Arc::new(InMemory::new());
        put(&store, "config.json", b"{\"v\": 1}").await;
        let remote = remote(store.clone());
        let key = Key::from("m/config.json");
        let fetch = |max| fetch(&remote, &key, dest, "config.json", max);
        assert_eq!(fetch(100).await.unwrap(), Fetched::Written(8));
        assert_eq!(fetch(100).await.unwrap(), Fetched::Kept);
        assert_eq!(fetched_names(dest), ["config.json"]);
        // Changed on disk: fetched again, whatever the store says.
        std::fs::write(dest.join("config.json"), b"edited").unwrap();
        assert_eq!(fetch(100).await.unwrap(), Fetched::Written(8));
        assert_eq!(
            std::fs::read(dest.join("config.json")).unwrap(),
            b"{\"v\": 1}"
        );
        // Changed in the store: fetched again.
        put(&store, "config.json", b"{\"v\": 2}").await;
        assert_eq!(fetch(100).await.unwrap(), Fetched::Written(8));
        assert_eq!(
            std::fs::read(dest.join("config.json")).unwrap(),
            b"{\"v\": 2}"
        );
        // A current copy is kept whatever the cap; a new one over it is not read.
        assert_eq!(fetch(3).await.unwrap(), Fetched::Kept);
        let elsewhere = dir.path().join("elsewhere");
        let large = super::fetch(&remote, &key, &elsewhere, "config.json", 3).await;
        assert_eq!(large.unwrap(), Fetched::TooLarge(8));
        assert!(!elsewhere.exists());
        // Gone from the store: the copy and its record go too; a file of the user's stays.
        std::fs::write(dest.join("mine.json"), b"{}").unwrap();
        store.delete(&key).await.unwrap();
        assert_eq!(fetch(100).await.unwrap(), Fetched::Missing);
        assert!(!dest.join("config.json").exists());
        assert!(fetched_names(dest).is_empty());
        assert!(dest.join("mine.json").exists());
    }

    #[tokio::test]
    async fn prune_removes_only_fastloads_copies_not_kept() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path();
        let store = Arc::new(InMemory::new());
        let remote = remote(store.clone());
        for name in ["a.json", "b.json"] {
            put(&store, name, b"{}").await;
            let key = Key::from(format!("m/{name}"));
            fetch(&remote, &key, dest, name, 100).await.unwrap();
        }
        std::fs::write(dest.join("mine.json"), b"{}").unwrap();
        prune(dest, &["a.json".to_string()]);
        assert!(dest.join("a.json").exists() && dest.join("mine.json").exists());
        assert!(!dest.join("b.json").exists());
        assert_eq!(fetched_names(dest), ["a.json"]);
    }
}
