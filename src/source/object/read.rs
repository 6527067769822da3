//! Ranged reads of object_store objects: each request of [`crate::source::remote::read_range`],
//! the one resumable read, is a `get_opts` with the range and the pinned version (the version id
//! where the store has them, `If-Match` with the strong ETag, else `If-Unmodified-Since` with
//! the Last-Modified).

use chrono::{DateTime, SecondsFormat, Utc};
use futures_util::future::BoxFuture;
use futures_util::stream::{StreamExt, TryStreamExt};
use object_store::path::Path;
use object_store::{GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt};

use crate::error::Result;
use crate::source::remote::{self, Answer, Pin, RangedGet, Response, Version};
use crate::store::*;

/// One object of a store, as [`RangedGet`] sees it.
pub struct ObjectGet<'a> {
    pub store: &'a dyn ObjectStore,
    pub path: &'a Path,
    pub uri: &'a str,
}

/// A Last-Modified as pinned and compared: RFC 3339 to the second (a listing gives
/// milliseconds, a response's header seconds); `None` for object_store's stand-in for a missing
/// header (the epoch).
pub fn stamp(time: &DateTime<Utc>) -> Option<String> {
    (time.timestamp() != 0).then(|| time.to_rfc3339_opts(SecondsFormat::Secs, true))
}

/// What a HEAD, a listing or a response says about an object's version.
pub fn version_of(meta: &ObjectMeta) -> Version {
    Version {
        etag: meta.e_tag.clone(),
        version: meta.version.clone(),
        last_modified: stamp(&meta.last_modified),
    }
    .normalized()
}

impl RangedGet for ObjectGet<'_> {
    fn get<'a>(
        &'a self,
        range: std::ops::Range<u64>,
        pin: &'a Version,
    ) -> BoxFuture<'a, Result<Answer>> {
        Box::pin(async move {
            let if_match = pin.strong_etag().map(str::to_string);
            // Only where the store gives no strong ETag nor version id (the pin's Last-Modified
            // is there only then): Last-Modified is what is left to send.
            let if_unmodified_since = match (&if_match, &pin.version) {
                (None, None) => pin.last_modified.as_deref().and_then(|t| {
                    DateTime::parse_from_rfc3339(t)
                        .ok()
                        .map(|t| t.with_timezone(&Utc))
                }),
                _ => None,
            };
            let mut sent = Vec::new();
            if let Some(v) = &pin.version {
                sent.push(format!("version {v}"));
            }
            if let Some(e) = &if_match {
                sent.push(format!("If-Match: {e}"));
            }
            if let Some(t) = &if_unmodified_since {
                sent.push(format!(
                    "If-Unmodified-Since: {}",
                    t.format("%a, %d %b %Y %H:%M:%S GMT")
                ));
            }
            let options = GetOptions {
                range: Some(GetRange::Bounded(range)),
                if_match,
                if_unmodified_since,
                version: pin.version.clone(),
                ..Default::default()
            };
            let result = match self.store.get_opts(self.path, options).await {
                Ok(result) => result,
                Err(object_store::Error::Precondition { .. }) => {
                    return Ok(Answer::Refused {
                        sent: sent.join(" and "),
                    });
                }
                Err(e) => {
                    return match storage_error(self.uri, e) {
                        crate::Error::NotFound { .. } => Ok(Answer::Gone),
                        e => Err(e),
                    }
                }
            };
            let version = version_of(&result.meta);
            let uri = self.uri.to_string();
            Ok(Answer::Bytes(Response {
                range: result.range.clone(),
                size: Some(result.meta.size),
                version,
                body: result
                    .into_stream()
                    .map_err(move |e| storage_error(&uri, e))
                    .boxed(),
            }))
        })
    }

    fn head(&self) -> BoxFuture<'_, Result<Option<Version>>> {
        Box::pin(async move {
            match head_or_first_byte(self.store, self.path).await {
                Ok(meta) => Ok(Some(version_of(&meta))),
                Err(e) => Err(storage_error(self.uri, e)),
            }
        })
    }
}

/// The object's metadata from a HEAD or, where HEAD is refused (401, 403), from a GET of its
/// first byte: a presigned URL signs one method, GET, and S3 and GCS refuse a HEAD of it. The
/// GET's Content-Range gives the size and its headers the validators, as a HEAD's would.
pub async fn head_or_first_byte(
    store: &dyn ObjectStore,
    path: &Path,
) -> object_store::Result<ObjectMeta> {
    match store.head(path).await {
        Err(
            object_store::Error::PermissionDenied { .. }
            | object_store::Error::Unauthenticated { .. },
        ) => {
            let options = GetOptions {
                range: Some(GetRange::Bounded(0..1)),
                ..Default::default()
            };
            Ok(store.get_opts(path, options).await?.meta)
        }
        other => other,
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

// boilerplate: the parameters of read_range_into again, with the pin it takes
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
