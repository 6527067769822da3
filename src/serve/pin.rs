//! Pinning what a serve serves of an object store: a listing names no version id, while a
//! client that pins an object of a versioned bucket by a HEAD puts that id in the identity it
//! asks for. So the serve pins each listed object by a HEAD at start: its reads (filling its
//! cache, reading through to the origin) are of that version, and its manifest lists it.

use std::sync::Arc;

use object_store::path::Path;

use crate::error::Result;
use crate::source::object::{self, RemoteObject};
use crate::source::Source;

/// Whether the objects of `uri` are pinned by a HEAD: a store that keeps versions (S3, GCS,
/// Azure). A plain http(s) listing is made of HEADs already, and such servers keep no versions.
pub fn wanted(uri: &str) -> bool {
    crate::uri::store(uri) != Some(crate::uri::Store::Http)
}

/// An object as a HEAD found it, and the version id it pinned.
pub type Headed = (Arc<dyn Source>, Option<String>);

/// The objects `rels` (relative to the listed `uri`, as the listing gave them) as a HEAD finds
/// them now, each with the version id it pinned (`None` where the store keeps none).
pub fn head_all(
    uri: &str,
    rels: &[String],
    single: bool,
    storage_options: &[(String, String)],
) -> Result<Vec<Headed>> {
    use futures_util::stream::{self, StreamExt, TryStreamExt};

    let remote = crate::store::open(uri, storage_options)?;
    let paths: Vec<Path> = rels
        .iter()
        .map(|rel| match single {
            true => remote.path.clone(),
            false => Path::from_iter(
                remote.path.parts().chain(
                    Path::parse(rel)
                        .unwrap_or_else(|_| Path::from(rel.as_str()))
                        .parts(),
                ),
            ),
        })
        .collect();
    let remote = &remote;
    crate::runtime::block_on(uri, async move {
        stream::iter(paths)
            .map(|path| async move {
                let found = object::head(remote, &path).await?;
                let version = found.validators().identifying().version;
                let (store, retry) = (remote.store.clone(), remote.retry.clone());
                let name = remote.uri_of(&path);
                let source = RemoteObject::new(name, store, path, found.size, retry);
                let source: Arc<dyn Source> = Arc::new(source.pinned_to(&found));
                Ok::<_, crate::error::Error>((source, version))
            })
            .buffered(HEADS)
            .try_collect()
            .await
    })
}

/// HEADs in flight at start.
const HEADS: usize = 16;
