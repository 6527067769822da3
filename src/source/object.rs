//! Objects behind `object_store` (s3://, gs://, az://, http(s)://) as sources: listing and
//! configuration live in [`crate::object`]; each read is one ranged GET that resumes a body cut
//! off midway, with object_store's retries for failed requests.

use std::sync::Arc;

use futures_util::future::BoxFuture;
use object_store::path::Path;
use object_store::ObjectStore;

use super::Source;
use crate::cache::CacheIdentity;
use crate::error::Result;
use crate::object::RetrySettings;

/// One object of a store.
#[derive(Debug)]
pub struct RemoteObject {
    name: String,
    store: Arc<dyn ObjectStore>,
    path: Path,
    size: u64,
    retry: RetrySettings,
    /// The ETag the listing reported, for the local cache.
    etag: Option<String>,
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
        }
    }

    /// The same object, known by `etag` (the local cache keeps its copy while the ETag holds).
    pub fn with_etag(mut self, etag: Option<String>) -> RemoteObject {
        self.etag = etag;
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
        Box::pin(crate::object::read_range_into(
            self.store.as_ref(),
            &self.path,
            offset,
            dst,
            &self.name,
            &self.retry,
        ))
    }

    fn cache_identity(&self) -> Option<CacheIdentity> {
        // A query (a presigned URL's signature) changes between loads of the same object.
        let uri = self.name.split(['?', '#']).next().unwrap_or(&self.name);
        Some(CacheIdentity {
            uri: uri.to_string(),
            size: self.size,
            etag: self.etag.clone(),
            sha256: None,
            hub: None,
        })
    }
}

/// Lists what an object-store URI names (a prefix, an index, one object): one source per object.
pub fn open(uri: &str, storage_options: &[(String, String)]) -> Result<Vec<Arc<dyn Source>>> {
    let remote = crate::object::open(uri, storage_options)?;
    let objects = crate::runtime::block_on(uri, crate::object::resolve(&remote))?;
    Ok(objects
        .into_iter()
        .map(|found| {
            let name = remote.uri_of(&found.path);
            let (store, retry) = (remote.store.clone(), remote.retry.clone());
            let object = RemoteObject::new(name, store, found.path, found.size, retry);
            Arc::new(object.with_etag(found.etag)) as Arc<dyn Source>
        })
        .collect())
}
