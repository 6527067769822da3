//! Finding the shards under a URI: a prefix listing, an index file, or one object.

use std::collections::HashMap;

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore};

use super::*;
use crate::bounded::{Capped, Whole, MAX_WHOLE_READ};
use crate::error::{Error, Result};
use crate::format::{check_folder, index_shard_names, FormatError, INDEX_FILE};
use crate::store::*;

/// One object found under a URI: where, how large, and its validators as the store reported
/// them (the local cache tells a changed object from its copy by the ETag; every read is pinned
/// to them all).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Found {
    pub path: Path,
    pub size: u64,
    pub etag: Option<String>,
    /// The version id (a HEAD's `x-amz-version-id`, GCS's generation); listings give none.
    pub version: Option<String>,
    /// Last-Modified, RFC 3339 to the second ([`super::read::stamp`]).
    pub last_modified: Option<String>,
    /// The ETag is in the form the server sends with its bytes (it came from a HEAD's header,
    /// not a listing's body), so the first read may send it as `If-Match`.
    pub headed: bool,
}

impl Found {
    /// An object as a listing reports it.
    fn of(meta: object_store::ObjectMeta) -> Found {
        let v = super::read::version_of(&meta);
        Found {
            path: meta.location,
            size: meta.size,
            etag: meta.e_tag,
            version: v.version,
            last_modified: v.last_modified,
            headed: false,
        }
    }

    /// An object as a HEAD reports it.
    fn headed(meta: object_store::ObjectMeta) -> Found {
        Found {
            headed: true,
            ..Found::of(meta)
        }
    }

    /// What the reads of this object are pinned to.
    pub fn validators(&self) -> crate::source::remote::Version {
        crate::source::remote::Version {
            etag: self.etag.clone(),
            version: self.version.clone(),
            last_modified: self.last_modified.clone(),
        }
    }
}

/// Every `*.safetensors` directly under the remote's prefix (one whole checkpoint:
/// [`check_folder`]), or exactly the files that its `model.safetensors.index.json` names, in a
/// stable order, with their sizes. Where the store lists, the index probe and the listing are
/// asked at once: one round trip to the store whether an index is there or not (the listing
/// sizes an index's shards too).
pub async fn list_safetensors(remote: &Remote) -> Result<Vec<Found>> {
    let index = remote.path.clone().join(INDEX_FILE);
    let probe = get_small(remote, &index);
    let (probed, listing) = if lists(remote) {
        let (probed, listing) = futures_util::join!(probe, list_dir(remote, &remote.path));
        (probed, Some(listing))
    } else {
        (probe.await, None)
    };
    match probed {
        Ok(bytes) => {
            let listed = listing.and_then(|l| l.ok());
            return from_index_listed(remote, &index, &bytes, listed).await;
        }
        Err(Error::NotFound { .. }) => {}
        Err(e) => return Err(e),
    }
    let listing = match listing {
        Some(listing) => listing?,
        None => list_dir(remote, &remote.path).await?,
    };
    let mut files: Vec<Found> = listing
        .into_iter()
        .filter(|f| f.path.extension() == Some("safetensors"))
        .collect();
    if files.is_empty() {
        return Err(Error::NotFound {
            path: format!("{} (no .safetensors objects under this prefix)", remote.uri),
        });
    }
    files.sort();
    let names: Vec<&str> = files.iter().filter_map(|f| f.path.filename()).collect();
    check_folder(&names).map_err(|e| Error::format(&remote.uri, e))?;
    Ok(files)
}

/// Turns the remote's URI into the objects to load: a prefix is listed, a `.json` is read as an
/// index, anything else is one object (or, when no such object exists, a prefix without its `/`).
pub async fn resolve(remote: &Remote) -> Result<Vec<Found>> {
    if remote.is_prefix {
        return list_safetensors(remote).await;
    }
    if remote.path.extension() == Some("json") {
        let bytes = get_small(remote, &remote.path).await?;
        return from_index(remote, &remote.path, &bytes).await;
    }
    match head(remote, &remote.path).await {
        Ok(found) => Ok(vec![found]),
        // A plain HTTP server cannot list (object_store would try WebDAV): the 404 is the answer.
        Err(Error::NotFound { path }) if !lists(remote) => Err(Error::NotFound { path }),
        Err(Error::NotFound { path }) => match list_safetensors(remote).await {
            Err(Error::NotFound { .. }) => Err(Error::NotFound { path }),
            // Name what the user asked for, not the index probed for it.
            Err(Error::Io { source, .. }) => Err(Error::Io { path, source }),
            other => other,
        },
        Err(e) => Err(e),
    }
}

/// Whether the store can list a prefix (every store but plain http(s)://).
fn lists(remote: &Remote) -> bool {
    crate::uri::store(&remote.uri) != Some(crate::uri::Store::Http)
}

/// Size and ETag of one object.
pub async fn head(remote: &Remote, path: &Path) -> Result<Found> {
    super::read::head_or_first_byte(remote.store.as_ref(), path)
        .await
        .map(Found::headed)
        .map_err(|e| storage_error(&remote.uri_of(path), e))
}

/// GET of a small object (an index file) into memory, up to the cap on bodies read whole.
pub(super) async fn get_small(remote: &Remote, path: &Path) -> Result<Vec<u8>> {
    get_capped(remote, path, Whole::Index, MAX_WHOLE_READ).await
}

/// Every object directly under the remote's key taken as a folder (`s3://bucket/model` and
/// `s3://bucket/model/` list the same), with sizes, in name order; none is an empty list.
pub async fn list_folder(remote: &Remote) -> Result<Vec<Found>> {
    let mut found = list_dir(remote, &remote.path).await?;
    found.sort();
    Ok(found)
}

async fn get_capped(remote: &Remote, path: &Path, what: Whole, limit: u64) -> Result<Vec<u8>> {
    let name = remote.uri_of(path);
    let result = remote
        .store
        .get_opts(path, GetOptions::default())
        .await
        .map_err(|e| storage_error(&name, e))?;
    // Capped by the listed size, and again while the body streams (it may send more).
    let mut out = Capped::with_limit(&name, what, Some(result.meta.size), limit)?;
    let mut body = result.into_stream();
    while let Some(chunk) = body.next().await {
        out.push(&chunk.map_err(|e| storage_error(&name, e))?)?;
    }
    Ok(out.finish())
}

/// Objects directly under `prefix` with their sizes.
pub(super) async fn list_dir(remote: &Remote, prefix: &Path) -> Result<Vec<Found>> {
    let prefix = (!prefix.as_ref().is_empty()).then_some(prefix);
    let listing = remote
        .store
        .list_with_delimiter(prefix)
        .await
        .map_err(|e| storage_error(&remote.uri, e))?;
    Ok(listing.objects.into_iter().map(Found::of).collect())
}

/// The files an index names (relative to the index's folder), sized by one listing of that folder
/// or, where the store cannot list (plain HTTP), by HEAD requests.
pub(super) async fn from_index(remote: &Remote, index: &Path, bytes: &[u8]) -> Result<Vec<Found>> {
    // A plain HTTP server cannot list: object_store would ask WebDAV's PROPFIND, which such
    // servers refuse (501, 405) and object_store retries as a server error, for seconds.
    let listed = match lists(remote) {
        true => list_dir(remote, &parent(index)).await.ok(),
        false => None,
    };
    from_index_listed(remote, index, bytes, listed).await
}

/// The folder an object is in.
fn parent(path: &Path) -> Path {
    let parts: Vec<_> = path.parts().collect();
    Path::from_iter(parts[..parts.len().saturating_sub(1)].iter().cloned())
}

/// The files an index names, sized by `listed` (the objects of the index's folder, where it could
/// be listed), the others by a HEAD each.
async fn from_index_listed(
    remote: &Remote,
    index: &Path,
    bytes: &[u8],
    listed: Option<Vec<Found>>,
) -> Result<Vec<Found>> {
    let name = remote.uri_of(index);
    let dir = parent(index);
    let mut files = Vec::new();
    for file in index_shard_names(bytes).map_err(|e| Error::format(&name, e))? {
        let rel = Path::parse(&file).map_err(|e| {
            let (file, reason) = (file.clone(), e.to_string());
            Error::format(&name, FormatError::IndexInvalidPath { file, reason })
        })?;
        files.push(Path::from_iter(dir.parts().chain(rel.parts())));
    }
    let listed: HashMap<Path, Found> = listed
        .unwrap_or_default()
        .into_iter()
        .map(|f| (f.path.clone(), f))
        .collect();
    let sizes: Vec<Result<Found>> = futures_util::stream::iter(files)
        .map(|p| {
            let known = listed.get(&p).cloned();
            async move {
                match known {
                    Some(found) => Ok(found),
                    None => head(remote, &p).await,
                }
            }
        })
        .buffered(HEAD_CONCURRENCY)
        .collect()
        .await;
    sizes.into_iter().collect()
}

/// Every object under the remote's key taken as a folder, at any depth, in name order (a copy's
/// source listing); none is an empty list.
pub async fn list_tree(remote: &Remote) -> Result<Vec<Found>> {
    use futures_util::TryStreamExt;
    let prefix = (!remote.path.as_ref().is_empty()).then_some(&remote.path);
    let mut found: Vec<Found> = remote
        .store
        .list(prefix)
        .map_ok(Found::of)
        .try_collect()
        .await
        .map_err(|e| storage_error(&remote.uri, e))?;
    found.sort();
    Ok(found)
}
