//! Objects behind `object_store` (s3://, gs://, az://, http(s)://) as sources: listing and
//! configuration live beside this file in [`super`]; each read is one ranged GET that resumes a
//! body cut off midway, with object_store's retries for failed requests.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use object_store::path::Path;
use object_store::ObjectStore;

use crate::error::Result;
use crate::source::identity::{CacheIdentity, StoredChecksum};
use crate::source::remote::Pin;
use crate::source::Source;
use crate::store::RetrySettings;

/// One object of a store.
#[derive(Debug)]
pub struct RemoteObject {
    name: String,
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
    retry: RetrySettings,
    /// The strong ETag the listing reported: it names the local cache's copy, and every read
    /// must find it (else the object changed since it was listed).
    etag: Option<String>,
    /// The version every read is pinned to: that ETag, else the one the first response brings.
    pin: Pin,
    /// The whole object's checksum as its store reported it (asked for by `verify=True`).
    checksum: Option<StoredChecksum>,
}

impl RemoteObject {
    /// The object at `path` of `store`, `size` bytes; `name` (its URI) is used in messages.
    /// Reads retry and resume as `retry` says.
    pub fn new(
        name: String,
        store: Arc<dyn ObjectStore>,
        path: Path,
        size: u64,
        retry: RetrySettings,
    ) -> RemoteObject {
        RemoteObject {
            name,
            store,
            path,
            size,
            retry,
            etag: None,
            pin: Pin::new(Some(size), None),
            checksum: None,
        }
    }

    /// The same object as it was listed or its HEAD said (`found`): the local cache keeps its
    /// copy while its strong ETag holds, and every read is pinned to all its validators.
    pub fn pinned_to(mut self, found: &super::Found) -> RemoteObject {
        let known = found.validators();
        self.etag = known.strong_etag().map(str::to_string);
        let pin = Pin::new(Some(self.size), Some(known));
        self.pin = if found.headed { pin.confirmed() } else { pin };
        self
    }
}

impl Source for RemoteObject {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(crate::source::object::read_pinned(
            self.store.as_ref(),
            &self.path,
            offset,
            dst,
            &self.name,
            &self.retry,
            &self.pin,
        ))
    }

    fn stored_checksum(&self) -> Option<StoredChecksum> {
        self.checksum.clone()
    }

    fn cache_identity(&self) -> Option<CacheIdentity> {
        // A query (a presigned URL's signature) changes between loads of the same object.
        let uri = self.name.split(['?', '#']).next().unwrap_or(&self.name);
        Some(CacheIdentity {
            uri: uri.to_string(),
            size: self.size,
            // Only a strong ETag names one content, and only the pinned one names the bytes
            // every read brings; without one the object is not cached.
            etag: self.etag.clone(),
            sha256: None,
            hub: None,
        })
    }

    fn content_identity(&self) -> Option<String> {
        // The validators every read is pinned to: the version id too.
        let pinned = self.pin.pinned();
        Some(crate::source::identity::canonical_identity(
            None,
            pinned.etag.as_deref(),
            pinned.version.as_deref(),
            self.size,
        ))
    }

    fn version(&self) -> Option<String> {
        // Everything pinned (the version id and Last-Modified too): the bytes every read brings.
        Some(format!(
            "size {} {}",
            self.size,
            self.pin.pinned().describe()
        ))
    }
}

/// Lists what an object-store URI names (a prefix, an index, one object): one source per object.
/// With `checksums` (`verify=True`), each object's stored checksum is asked for with a HEAD
/// ([`super::stored_checksum`], [`super::HEAD_CONCURRENCY`] at a time).
pub fn open_sources(
    uri: &str,
    storage_options: &[(String, String)],
    checksums: bool,
) -> Result<Vec<Arc<dyn Source>>> {
    use futures_util::stream::{self, StreamExt, TryStreamExt};

    let remote = crate::store::open(uri, storage_options)?;
    let objects = crate::runtime::block_on(uri, super::resolve(&remote))?;
    let objects: Vec<RemoteObject> = objects
        .into_iter()
        .map(|found| {
            let name = remote.uri_of(&found.path);
            let (store, retry) = (remote.store.clone(), remote.retry.clone());
            let object = RemoteObject::new(name, store, found.path.clone(), found.size, retry);
            object.pinned_to(&found)
        })
        .collect();
    // Plain http(s) servers keep no checksum fastload reads (and refuse a presigned URL's HEAD).
    let objects = if checksums && crate::uri::store(&remote.uri) != Some(crate::uri::Store::Http) {
        crate::runtime::block_on(uri, async {
            stream::iter(objects)
                .map(|mut object| async move {
                    object.checksum =
                        crate::store::stored_checksum(object.store.as_ref(), &object.path)
                            .await
                            .map_err(|e| crate::store::storage_error(&object.name, e))?;
                    Ok::<_, crate::error::Error>(object)
                })
                .buffered(super::HEAD_CONCURRENCY)
                .try_collect()
                .await
        })?
    } else {
        objects
    };
    Ok(objects
        .into_iter()
        .map(|o| Arc::new(o) as Arc<dyn Source>)
        .collect())
}
