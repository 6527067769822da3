//! Ranged reads of object_store objects: each request of [`crate::source::remote::read_range`],
//! the one resumable read, is a `get_opts` with the range and the pinned version (`If-Match`
//! with the strong ETag, the version id where the store has them).

use futures_util::future::BoxFuture;
use futures_util::stream::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectStore};

use super::errors::*;
use crate::error::Result;
use crate::source::remote::RetrySettings;
use crate::source::remote::{self, Pin, RangedGet, Response, Version};

/// One object of a store, as [`RangedGet`] sees it.
pub struct ObjectGet<'a> {
    pub store: &'a dyn ObjectStore,
    pub path: &'a Path,
    pub uri: &'a str,
}

impl RangedGet for ObjectGet<'_> {
    fn get<'a>(
        &'a self,
        range: std::ops::Range<u64>,
        pin: &'a Version,
    ) -> BoxFuture<'a, Result<Response>> {
        Box::pin(async move {
            let options = GetOptions {
                range: Some(GetRange::Bounded(range)),
                if_match: pin.strong_etag().map(str::to_string),
                version: pin.version.clone(),
                ..Default::default()
            };
            let result = match self.store.get_opts(self.path, options).await {
                Ok(result) => result,
                Err(object_store::Error::Precondition { .. }) => {
                    let etag = pin.strong_etag().unwrap_or_default();
                    return Err(remote::changed(
                        self.uri,
                        format!("the store refused If-Match: {etag} with 412 Precondition Failed"),
                    ));
                }
                Err(e) => return Err(storage_error(self.uri, e)),
            };
            let version = Version {
                etag: result.meta.e_tag.clone(),
                version: result.meta.version.clone().filter(|v| v != "null"),
                last_modified: Some(result.meta.last_modified.to_rfc3339()),
            };
            let uri = self.uri.to_string();
            Ok(Response {
                range: result.range.clone(),
                size: Some(result.meta.size),
                version,
                body: result
                    .into_stream()
                    .map_err(move |e| storage_error(&uri, e))
                    .boxed(),
            })
        })
    }
}

/// Reads `dst.len()` bytes at `offset` with ranged GETs, copying each body chunk into `dst` as
/// it arrives and resuming a body that breaks off or stalls (the one resumable read,
/// [`remote::read_range`]); every request is pinned to the version the first one saw. A read of a
/// [`crate::source::object::RemoteObject`] shares its pin with every other read of the object.
pub async fn read_range_into(
    store: &dyn ObjectStore,
    path: &Path,
    offset: u64,
    dst: &mut [u8],
    uri: &str,
    retry: &RetrySettings,
) -> Result<()> {
    let pin = Pin::new(None, None);
    read_pinned(store, path, offset, dst, uri, retry, &pin).await
}

/// [`read_range_into`], pinned to `pin`.
pub async fn read_pinned(
    store: &dyn ObjectStore,
    path: &Path,
    offset: u64,
    dst: &mut [u8],
    uri: &str,
    retry: &RetrySettings,
    pin: &Pin,
) -> Result<()> {
    let get = ObjectGet { store, path, uri };
    remote::read_range(&get, pin, uri, offset, dst, retry).await
}
