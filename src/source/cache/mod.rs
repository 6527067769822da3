//! A local cache that fills while streaming: each block a remote source reads is also written to
//! a local file at its offset; once every byte is there (and verified), the file is published
//! atomically, and a later load of the same object reads the local copy.
//!
//! Remote sources say who they are with [`crate::source::Source::cache_identity`]; [`wrap`],
//! called only by the opening code (`open_all` in source/open.rs), replaces each source that has
//! a verified copy with a local source, or wraps it in a filling source. Objects from the Hugging Face Hub
//! ([`CacheIdentity::hub`]) are cached in the Hugging Face cache ([`layout`]), so that
//! `huggingface_hub`, transformers and vLLM find them; everything else under the fastload cache
//! directory ([`default_dir`]). The small files beside a checkpoint (config, tokenizer) are
//! copies of the same kind kept under their own names in a folder libraries read ([`named`]),
//! with the same record of what they copy.

use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use futures_util::future::BoxFuture;

use crate::error::Result;
use crate::options::{CacheChoice, LoadOptions};
use crate::source::hub::layout;
use crate::source::identity::{CacheIdentity, Digest};
use crate::source::Source;
use entry::Entry;
use fill::FillingSource;

pub mod crc;
pub mod entry;
mod fill;
// The small files beside a checkpoint are fetched for the Python integrations only.
#[cfg(any(feature = "python", test))]
mod inside;
#[cfg(any(feature = "python", test))]
pub mod named;
pub mod verify;

/// What the tests of the cache's decorators share.
#[cfg(test)]
mod testing {
    use std::sync::Arc;

    use crate::error::Result;
    use crate::source::testing::Bytes;
    use crate::source::Source;

    /// An in-memory file named `mem://x`.
    pub fn mem(data: Vec<u8>) -> Arc<dyn Source> {
        Arc::new(Bytes {
            name: "mem://x".into(),
            data,
        })
    }

    /// Reads `source`'s `(offset, length)` pieces, in order.
    pub async fn read_all(source: &dyn Source, pieces: &[(usize, usize)]) -> Result<()> {
        for &(at, len) in pieces {
            let mut buf = vec![0u8; len];
            source.read_into(at as u64, &mut buf).await?;
        }
        Ok(())
    }
}

/// A cache decorator around a source ([`FillingSource`], [`verify::VerifyingSource`]): it reads
/// through its inner source and works on each block read (writes the copy, hashes it). As a
/// [`Source`] it is its inner source but for `read_into` (the block is read, then handed to
/// [`Decorator::after_read`]) and `cache_identity` ([`Decorator::identity`]).
trait Decorator: Send + Sync + fmt::Debug {
    fn inner(&self) -> &dyn Source;

    /// Works on the bytes just read at `offset`; its error is the read's.
    fn after_read(&self, offset: u64, bytes: &[u8]) -> Result<()>;

    /// Called when the inner source failed to read a block (its error is the read's).
    fn read_failed(&self) {}

    /// The [`Source::cache_identity`] of the decorated source: by default its inner source's.
    fn identity(&self) -> Option<CacheIdentity> {
        self.inner().cache_identity()
    }
}

impl<D: Decorator> Source for D {
    fn name(&self) -> &str {
        self.inner().name()
    }

    fn size(&self) -> u64 {
        self.inner().size()
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            if let Err(e) = self.inner().read_into(offset, dst).await {
                self.read_failed();
                return Err(e);
            }
            // Writing or hashing an 8 MiB block blocks this thread for a few ms (fresh page-cache
            // pages, sha256): the worker's other tasks (reads waiting on the network) move to
            // another thread meanwhile. benches/cache_bench.py on a busy 2-core VM: a filling
            // load took 2.7-3.5x a plain remote one writing inline, 1.9-2.3x with this (within
            // noise).
            match tokio::runtime::Handle::try_current() {
                Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
                    tokio::task::block_in_place(|| self.after_read(offset, dst))
                }
                _ => self.after_read(offset, dst),
            }
        })
    }

    fn reads_block(&self) -> bool {
        self.inner().reads_block()
    }

    fn read_cost(&self) -> u64 {
        self.inner().read_cost()
    }

    fn stored_checksum(&self) -> Option<crate::source::identity::StoredChecksum> {
        self.inner().stored_checksum()
    }

    fn cache_identity(&self) -> Option<CacheIdentity> {
        self.identity()
    }

    fn version(&self) -> Option<String> {
        self.inner().version()
    }
}

/// Whether and where to cache.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CacheSettings {
    /// The fastload cache directory; `None`: caching is off.
    pub dir: Option<PathBuf>,
    /// The Hugging Face cache ([`layout::hub_cache_root`]) for Hub objects.
    pub hub_root: PathBuf,
    /// Whether objects without a copy are filled (`false`: copies are read, none written; a
    /// rank of a distributed load reads a share of each object, never a whole one).
    pub fill: bool,
    /// `verify=True`: the sha256 of every object whose store gives one (Hub LFS files) is
    /// checked, wherever its bytes come from (the network, the HF cache, a cached copy).
    pub verify: bool,
    /// The load's peers (`peers=`, `FASTLOAD_PEERS`): decided with the cache, applied by the
    /// same opener ([`crate::source::open::open_all`]).
    pub peers: crate::source::peer::PeerSettings,
}

impl CacheSettings {
    /// No caching: nothing is written, and only Hub files already in the Hugging Face cache
    /// (downloaded by huggingface_hub or an earlier load) are read from it, as huggingface_hub
    /// reads them.
    pub fn off() -> CacheSettings {
        CacheSettings {
            hub_root: layout::hub_cache_root(),
            ..CacheSettings::default()
        }
    }

    /// Caching into `dir`, Hub objects into the HF cache the environment names.
    pub fn at(dir: PathBuf) -> CacheSettings {
        CacheSettings {
            dir: Some(dir),
            hub_root: layout::hub_cache_root(),
            fill: true,
            ..CacheSettings::default()
        }
    }

    /// The cache settings of a load with `options`: its choice, else `FASTLOAD_CACHE`, else off
    /// ([`LoadOptions::cache_choice`]).
    pub fn for_load(options: &LoadOptions) -> Result<CacheSettings> {
        let (choice, verify) = options.cache_choice()?;
        let mut settings = match choice {
            CacheChoice::Off => CacheSettings::off(),
            CacheChoice::Default => CacheSettings::at(default_dir()),
            CacheChoice::Dir(dir) => CacheSettings::at(dir),
        };
        settings.verify = verify;
        settings.peers = crate::source::peer::PeerSettings::resolve(
            options.peers.clone(),
            options.peer_token.clone(),
        )?;
        Ok(settings)
    }

    pub fn enabled(&self) -> bool {
        self.dir.is_some()
    }
}

/// The fastload cache directory when none is named: `$XDG_CACHE_HOME/fastload`, else
/// `~/.cache/fastload`.
pub fn default_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()) {
        Some(dir) => PathBuf::from(dir).join("fastload"),
        None => dirs::home_dir()
            .unwrap_or_else(|| PathBuf::from("/"))
            .join(".cache")
            .join("fastload"),
    }
}

/// `source` checked against the whole-object checksum its store reported
/// ([`Source::stored_checksum`]): a CRC by [`crc::CrcSource`], a sha256 or MD5 by
/// [`verify::VerifyingSource`]. An object whose store keeps none, or one that cannot be checked
/// from the bytes alone (S3's composite checksum of a multipart upload's parts), is read
/// unchecked, with a note on stderr saying so.
fn by_stored_checksum(source: Arc<dyn Source>) -> Arc<dyn Source> {
    let note = |why: String| {
        let message = format!("{}: not verified: {why}", source.name());
        eprintln!("fastload: note: {}", crate::error::scrub(&message));
    };
    let Some(want) = source.stored_checksum() else {
        if source.cache_identity().is_some() {
            note("its store reports no checksum of the whole object".into());
        }
        return source;
    };
    if let Some(crc) = crc::CrcSource::new(source.clone(), &want) {
        return Arc::new(crc);
    }
    if let Some(digest) = verify::VerifyingSource::stored(source.clone(), &want) {
        return Arc::new(digest);
    }
    if let crate::source::identity::StoredChecksum::Composite { algorithm, parts } = &want {
        note(format!(
            "its store keeps a composite {algorithm} of its {parts} upload parts, which needs \
             the parts' sizes to check"
        ));
    }
    source
}

/// Each source with an identity becomes a local source when a verified copy is cached, or a
/// filling source when caching is on (and no other process is filling that object: then it is
/// read from the network only); others are returned as they are. With caching off, only Hub
/// files are looked up (in the Hugging Face cache), and nothing is filled.
///
/// Objects with a known sha256 are hashed while they stream when they fill a copy (a mismatch
/// fails the read and nothing is published) or when `settings.verify` is on (Hub files outside
/// LFS too, by their git blob id); with `verify`, a cached copy is hashed whole before it is
/// used, and one that does not match is removed and the object read from the network.
pub fn wrap(sources: Vec<Arc<dyn Source>>, settings: &CacheSettings) -> Vec<Arc<dyn Source>> {
    let run = Arc::new(Run::default());
    sources
        .into_iter()
        .map(|source| {
            let identity = source.cache_identity();
            // A fill checks a sha256 as it streams (a git blob id when it publishes the copy);
            // `verify` checks either as every read streams.
            let checked = |source: Arc<dyn Source>, always: bool| -> Arc<dyn Source> {
                match identity.as_ref().and_then(CacheIdentity::digest) {
                    Some(want @ Digest::Sha256(_)) if always || settings.verify => {
                        Arc::new(verify::VerifyingSource::new(source, &want))
                    }
                    Some(want @ Digest::GitBlob(_)) if settings.verify => {
                        Arc::new(verify::VerifyingSource::new(source, &want))
                    }
                    // Objects: the checksum their store keeps, asked for by `verify`.
                    None if settings.verify => by_stored_checksum(source),
                    _ => source,
                }
            };
            let Some(entry) = identity
                .as_ref()
                .filter(|id| settings.enabled() || id.hub.is_some())
                .and_then(|id| Entry::new(id, settings))
            else {
                return checked(source, false);
            };
            if entry.is_cached() && (!settings.verify || entry.copy_matches(&run)) {
                if let Ok(local) = crate::source::local::LocalFile::open(&entry.path) {
                    entry.complete_hub_links();
                    COUNTERS.hits.fetch_add(1, Ordering::Relaxed);
                    return Arc::new(local) as Arc<dyn Source>;
                }
            }
            if !settings.enabled() || run.disabled() || !settings.fill {
                return checked(source, false);
            }
            // The fill's bytes are checked as they stream: a mismatch is an error of the read,
            // before the copy could be published.
            match FillingSource::start(checked(source.clone(), true), entry, run.clone()) {
                Some(filling) => Arc::new(filling) as Arc<dyn Source>,
                None => checked(source, false),
            }
        })
        .collect()
}

/// The published copy of the object `identity` names, once the copies being published are (a
/// fill that just completed): `None` when caching is off or there is none.
pub fn published_copy(
    identity: &CacheIdentity,
    settings: &CacheSettings,
) -> Option<Arc<dyn Source>> {
    if !settings.enabled() {
        return None;
    }
    wait_published();
    let entry = Entry::new(identity, settings)?;
    if !entry.is_cached() {
        return None;
    }
    let local = crate::source::local::LocalFile::open(&entry.path).ok()?;
    Some(Arc::new(local))
}

/// Stores a whole small object read outside the block pipeline (an index file) under the same
/// rules as filled files. Failures only warn: the load has its bytes already.
pub fn put_whole(identity: &CacheIdentity, bytes: &[u8], settings: &CacheSettings) {
    if !settings.enabled() || identity.size != bytes.len() as u64 {
        return;
    }
    let Some(entry) = Entry::new(identity, settings) else {
        return;
    };
    if entry.is_cached() {
        return;
    }
    let run = Run::default();
    let _lock = match fill::try_lock(&entry.lock) {
        Ok(Some(lock)) => lock,
        Ok(None) => return,
        Err(e) => return run.disable(&entry.unusable(&e)),
    };
    let folder = entry.partial.parent().map(std::fs::create_dir_all);
    let written = folder
        .unwrap_or(Ok(()))
        .and_then(|()| std::fs::write(&entry.partial, bytes))
        .and_then(|()| std::fs::File::open(&entry.partial));
    match written {
        Ok(file) => match entry.verify_and_publish(&file) {
            Ok(()) => {
                COUNTERS.published.fetch_add(1, Ordering::Relaxed);
            }
            Err(why) => run.warn(&format!("{}: not cached: {why}", identity.uri)),
        },
        Err(e) => {
            let _ = std::fs::remove_file(&entry.partial);
            let e = std::io::Error::new(
                e.kind(),
                format!("cannot write {}: {e}", entry.partial.display()),
            );
            run.disable(&entry.unusable(&e));
        }
    }
}

/// What one load's caching shares across its sources: once writing fails (a full disk), the
/// load stops caching, with one warning.
#[derive(Debug, Default)]
pub(crate) struct Run {
    disabled: OnceLock<String>,
}

impl Run {
    fn disabled(&self) -> bool {
        self.disabled.get().is_some()
    }

    /// Stops caching for this load; the first reason is printed, later ones are not.
    fn disable(&self, reason: &str) {
        if self.disabled.set(reason.to_string()).is_ok() {
            self.warn(&format!("local cache off for this load: {reason}"));
            *COUNTERS.disabled_reason.lock().unwrap() = Some(reason.to_string());
        }
    }

    /// A warning on stderr: caching never fails a load, whose bytes came from the network.
    pub(crate) fn warn(&self, message: &str) {
        // Scrubbed of known credentials, as every message that leaves fastload.
        eprintln!("fastload: warning: {}", crate::error::scrub(message));
    }

    fn add_filled(&self, bytes: u64) {
        COUNTERS.filled_bytes.fetch_add(bytes, Ordering::Relaxed);
    }

    fn add_published(&self) {
        COUNTERS.published.fetch_add(1, Ordering::Relaxed);
    }
}

/// What the cache did in this process, for `fastload.cache_stats()`.
#[cfg(feature = "python")]
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Objects read from a cached copy.
    pub hits: u64,
    /// Bytes written into copies being filled.
    pub filled_bytes: u64,
    /// Copies verified and published.
    pub published: u64,
    /// Why caching was last turned off for a load (a full disk), if it was.
    pub disabled_reason: Option<String>,
}

struct Counters {
    hits: AtomicU64,
    filled_bytes: AtomicU64,
    published: AtomicU64,
    disabled_reason: Mutex<Option<String>>,
}

static COUNTERS: Counters = Counters {
    hits: AtomicU64::new(0),
    filled_bytes: AtomicU64::new(0),
    published: AtomicU64::new(0),
    disabled_reason: Mutex::new(None),
};

/// Copies being verified and published, on threads of their own.
static PUBLISHING: Mutex<Vec<std::thread::JoinHandle<()>>> = Mutex::new(Vec::new());

fn publishing(thread: std::thread::JoinHandle<()>) {
    let mut pending = PUBLISHING.lock().unwrap();
    pending.retain(|t| !t.is_finished());
    pending.push(thread);
}

/// Waits until every copy filled so far is verified and published (or dropped). A load does not
/// wait for its copies' fsync and hash; a process that exits before they finish leaves partial
/// files that the next load replaces (Python waits at exit: `fastload/__init__.py`).
pub fn wait_published() {
    let pending = std::mem::take(&mut *PUBLISHING.lock().unwrap());
    for thread in pending {
        let _ = thread.join();
    }
}

/// The process's cache counters so far, once the copies being published are published.
#[cfg(feature = "python")]
pub fn stats() -> CacheStats {
    wait_published();
    CacheStats {
        hits: COUNTERS.hits.load(Ordering::Relaxed),
        filled_bytes: COUNTERS.filled_bytes.load(Ordering::Relaxed),
        published: COUNTERS.published.load(Ordering::Relaxed),
        disabled_reason: COUNTERS.disabled_reason.lock().unwrap().clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::source::identity::HubLocation;
    use futures_util::future::BoxFuture;

    /// An in-memory object that says who it is, as remote sources do.
    #[derive(Debug)]
    struct Remote {
        data: Vec<u8>,
        identity: CacheIdentity,
    }

    impl Source for Remote {
        fn name(&self) -> &str {
            &self.identity.uri
        }
        fn size(&self) -> u64 {
            self.data.len() as u64
        }
        fn read_into<'a>(
            &'a self,
            offset: u64,
            dst: &'a mut [u8],
        ) -> BoxFuture<'a, crate::Result<()>> {
            Box::pin(async move {
                let at = offset as usize;
                dst.copy_from_slice(&self.data[at..at + dst.len()]);
                Ok(())
            })
        }
        fn cache_identity(&self) -> Option<CacheIdentity> {
            Some(self.identity.clone())
        }
    }

    fn hub_object(data: &[u8], path_in_repo: &str) -> CacheIdentity {
        let sha = entry::hex(&entry::sha256(data));
        CacheIdentity {
            uri: format!("hf://org/name@{}/{path_in_repo}", "c".repeat(40)),
            size: data.len() as u64,
            etag: Some(format!("\"{sha}\"")),
            sha256: Some(sha.clone()),
            hub: Some(HubLocation {
                repo_type: "model".into(),
                repo_id: "org/name".into(),
                commit: "c".repeat(40),
                revision: Some("main".into()),
                path_in_repo: path_in_repo.into(),
                blob_id: sha,
            }),
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn hub_objects_fill_the_hugging_face_cache_and_are_read_from_it_next_time() {
        let dir = tempfile::tempdir().unwrap();
        let settings = CacheSettings {
            dir: Some(dir.path().join("fastload")),
            hub_root: dir.path().join("hub"),
            fill: true,
            verify: false,
            ..Default::default()
        };
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let identity = hub_object(&data, "sub/m.safetensors");
        let remote = Arc::new(Remote {
            data: data.clone(),
            identity: identity.clone(),
        });
        let wrapped = wrap(vec![remote.clone()], &settings).remove(0);
        assert!(wrapped.local_path().is_none(), "nothing cached yet");
        // Out of order, overlapping, as a pipeline's blocks and the header probe arrive.
        for (at, len) in [(60_000, 40_000), (0, 1000), (500, 30_000), (30_000, 30_000)] {
            let mut buf = vec![0u8; len];
            wrapped.read_into(at as u64, &mut buf).await.unwrap();
            assert_eq!(buf, data[at..at + len]);
        }
        drop(wrapped);
        tokio::task::spawn_blocking(wait_published).await.unwrap();
        let repo = layout::repo_path(&settings.hub_root, "model", "org/name");
        let hub = identity.hub.as_ref().unwrap();
        let link = layout::snapshot_path(&repo, &hub.commit, &hub.path_in_repo);
        assert_eq!(std::fs::read(&link).unwrap(), data);
        assert_eq!(layout::read_ref(&repo, "main"), Some(hub.commit.clone()));
        let again = wrap(vec![remote], &settings);
        assert_eq!(
            again[0].local_path(),
            Some(layout::blob_path(&repo, &hub.blob_id).as_path())
        );

        // A whole small file (an index) through put_whole, into the same layout.
        let index = br#"{"weight_map": {}}"#;
        let index_id = hub_object(index, "model.safetensors.index.json");
        put_whole(&index_id, index, &settings);
        let hub = index_id.hub.as_ref().unwrap();
        let link = layout::snapshot_path(&repo, &hub.commit, &hub.path_in_repo);
        assert_eq!(std::fs::read(link).unwrap(), index);
    }
}
