//! A small file kept beside a checkpoint (config, tokenizer), fetched again only when it changed:
//! a GET with `If-None-Match` on the ETag of the copy the caller holds, answered either by the
//! store's "not modified" or by the current bytes and their ETag. An object over the caller's cap
//! is reported by its size, unread, so that a file nobody requires can be skipped.

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore};

use crate::bounded::{Capped, Whole};
use crate::error::Result;
use crate::store::{storage_error, Remote};

/// What a conditional fetch of a small object found.
#[derive(Debug, PartialEq, Eq)]
pub enum Small {
    /// The object's bytes and ETag (when the store gives one).
    Read {
        bytes: Vec<u8>,
        etag: Option<String>,
    },
    /// The copy with the ETag the caller gave is current.
    Unchanged,
    /// The object has `size` bytes, more than the cap; nothing was read.
    TooLarge { size: u64 },
}

/// The object at `path`, unless its ETag is still `known` (then [`Small::Unchanged`]) or it has
/// more than `max_bytes` (then [`Small::TooLarge`], its body not read). A body that sends more than
/// it claimed stops at the cap with an error naming the object.
pub async fn read_small_unless(
    remote: &Remote,
    path: &Path,
    max_bytes: u64,
    known: Option<String>,
) -> Result<Small> {
    let name = remote.uri_of(path);
    let options = GetOptions {
        if_none_match: known,
        ..GetOptions::default()
    };
    let result = match remote.store.get_opts(path, options).await {
        Ok(result) => result,
        Err(object_store::Error::NotModified { .. }) => return Ok(Small::Unchanged),
        Err(e) => return Err(storage_error(&name, e)),
    };
    let size = result.meta.size;
    if size > max_bytes {
        return Ok(Small::TooLarge { size });
    }
    let etag = result.meta.e_tag.clone();
    let mut out = Capped::with_limit(&name, Whole::Body, Some(size), max_bytes)?;
    let mut body = result.into_stream();
    while let Some(chunk) = body.next().await {
        out.push(&chunk.map_err(|e| storage_error(&name, e))?)?;
    }
    Ok(Small::Read {
        bytes: out.finish(),
        etag,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use object_store::memory::InMemory;
    use object_store::{ObjectStoreExt, PutPayload};
    use std::sync::Arc;

    async fn remote_with(data: &'static [u8]) -> Remote {
        let store = InMemory::new();
        store
            .put(&Path::from("m/config.json"), PutPayload::from_static(data))
            .await
            .unwrap();
        Remote {
            store: Arc::new(store),
            path: Path::from("m"),
            uri: "memory:///m/".into(),
            is_prefix: true,
            retry: Default::default(),
            multipart: None,
        }
    }

    #[tokio::test]
    async fn reads_then_answers_unchanged_for_the_same_etag() {
        let r = remote_with(b"{}").await;
        let path = Path::from("m/config.json");
        let Small::Read { bytes, etag } = read_small_unless(&r, &path, 10, None).await.unwrap()
        else {
            panic!("not read")
        };
        assert_eq!(bytes, b"{}");
        let etag = etag.expect("InMemory gives ETags");
        let again = read_small_unless(&r, &path, 10, Some(etag)).await.unwrap();
        assert_eq!(again, Small::Unchanged);
        let other = read_small_unless(&r, &path, 10, Some("\"other\"".into()));
        assert!(matches!(other.await.unwrap(), Small::Read { .. }));
        let big = read_small_unless(&r, &path, 1, None).await.unwrap();
        assert_eq!(big, Small::TooLarge { size: 2 });
        let missing = read_small_unless(&r, &Path::from("m/none"), 10, None).await;
        assert!(matches!(missing, Err(crate::Error::NotFound { .. })));
    }
}
