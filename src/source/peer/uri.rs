//! `peer://host:port/NAME[/path]`: loading straight from a serve that has no origin (a local
//! folder it serves): the manifest gives the files, their sizes and identities; each is pinned
//! to its identity, checked on every answer.

use std::sync::Arc;

use futures_util::future::BoxFuture;

use super::{base_url, file_url, FileEntry, Location, PeerGet, PeerSet, PeerSettings};
use crate::error::{Error, Result};
use crate::source::remote::{Pin, RetrySettings};
use crate::source::Source;

/// Opens `peer://host:port/NAME[/path]`: the files of checkpoint NAME on that serve (its
/// `.safetensors` files, or the one file or folder `path` names), each pinned to the identity
/// its manifest lists and checked on every response. The token is the load's `peer_token`; the
/// serve is reached over https where the load's `peers` list it so.
pub fn open_uri(
    uri: &str,
    settings: &PeerSettings,
    storage_options: &[(String, String)],
) -> Result<Vec<Arc<dyn Source>>> {
    let (authority, name, path) = parse_peer_uri(uri)?;
    let https = format!("https://{authority}");
    let base = match settings.peers.contains(&https) {
        true => https,
        false => format!("http://{authority}"),
    };
    let (mut retry, _) = crate::store::split_retry_options(storage_options)?;
    let wanted = PeerSettings {
        peers: vec![base.clone()],
        token: settings.token.clone(),
    };
    let set = Arc::new(PeerSet::new(wanted, &retry)?);
    retry.max_retries = 0;
    let manifest = crate::runtime::block_on(uri, {
        let (set, base) = (set.clone(), base.clone());
        async move { set.manifest(&base).await }
    })?;
    let checkpoint = manifest
        .checkpoints
        .iter()
        .find(|c| c.name == name)
        .ok_or_else(|| Error::NotFound {
            path: format!("{uri} (the serve has no checkpoint {name:?})"),
        })?;
    let mut files: Vec<&FileEntry> = checkpoint
        .files
        .iter()
        .filter(|f| match &path {
            Some(p) => f.path == *p || f.path.starts_with(&format!("{}/", p.trim_end_matches('/'))),
            None => true,
        })
        .filter(|f| path.as_deref() == Some(f.path.as_str()) || f.path.ends_with(".safetensors"))
        .collect();
    files.sort_by(|a, b| a.path.cmp(&b.path));
    if files.is_empty() {
        return Err(Error::NotFound {
            path: format!("{uri} (no such .safetensors file on the serve)"),
        });
    }
    Ok(files
        .into_iter()
        .map(|f| {
            let identity = f.canonical();
            let location = Location {
                peer: 0,
                url: file_url(&base, &checkpoint.name, &f.path),
                identity: identity.clone(),
            };
            Arc::new(ServedFile {
                name: format!("peer://{authority}/{}/{}", checkpoint.name, f.path),
                size: f.size,
                get: PeerGet::new(location, set.clone()),
                identity,
                pin: Pin::new(Some(f.size), None),
                retry: retry.clone(),
            }) as Arc<dyn Source>
        })
        .collect())
}

/// `peer://host:port/NAME[/path]` as its authority, NAME and path.
fn parse_peer_uri(uri: &str) -> Result<(String, String, Option<String>)> {
    let wrong = |why: &str| Error::UnsupportedUri {
        uri: uri.to_string(),
        message: format!("{why}: expected peer://host:port/NAME[/path]"),
    };
    let rest = uri
        .split_once("://")
        .map(|(_, r)| r)
        .ok_or_else(|| wrong("no scheme"))?;
    let (authority, tail) = rest.split_once('/').ok_or_else(|| wrong("no NAME"))?;
    base_url(authority).map_err(|_| wrong("not host:port"))?;
    let (name, path) = match tail.split_once('/') {
        Some((n, p)) if !p.trim_matches('/').is_empty() => (n, Some(p.trim_matches('/'))),
        Some((n, _)) => (n, None),
        None => (tail, None),
    };
    if name.is_empty() || path.is_some_and(|p| p.split('/').any(|s| s == ".." || s.is_empty())) {
        return Err(wrong("no NAME, or a path with '..' or '//'"));
    }
    Ok((
        authority.to_string(),
        name.to_string(),
        path.map(str::to_string),
    ))
}

/// A file of a serve loaded straight from it (`peer://`): no origin behind it.
#[derive(Debug)]
struct ServedFile {
    name: String,
    size: u64,
    get: PeerGet,
    identity: String,
    pin: Pin,
    retry: RetrySettings,
}

impl Source for ServedFile {
    fn name(&self) -> &str {
        &self.name
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(crate::source::remote::read_range(
            &self.get,
            &self.pin,
            &self.name,
            offset,
            dst,
            &self.retry,
        ))
    }

    fn content_identity(&self) -> Option<String> {
        Some(self.identity.clone())
    }

    fn version(&self) -> Option<String> {
        Some(format!("size {} {}", self.size, self.identity))
    }
}
