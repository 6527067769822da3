//! Peers: another location of the same pinned object (peer protocol v1, docs/peers.md). A load
//! with `peers=` still opens and pins every file at its origin; then each peer's manifest is
//! fetched once, and a file whose origin URI and canonical identity
//! ([`super::identity::canonical_identity`]) a peer lists is read from that peer through the one
//! resumable read ([`super::remote::read_range`]). A peer that errors, stalls (the stall rule),
//! answers 409 (another version) or sends another identity is dropped for the rest of the load,
//! and the read goes on at the byte it reached from the next peer or the origin, with the
//! origin's pin: no landed byte is read again.

use std::io;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::future::BoxFuture;
use futures_util::{StreamExt, TryStreamExt};
use serde::Deserialize;

use super::identity::{canonical_identity, CacheIdentity, StoredChecksum};
use super::remote::{
    io_error, read_range_from, Answer, Pin, RangedGet, Response, RetrySettings, Version,
};
use super::Source;
use crate::error::{Error, Result};
use crate::options::Secret;

mod uri;
pub use uri::open_uri;

/// The environment variables of the two options.
pub const ENV_PEERS: &str = "FASTLOAD_PEERS";
pub const ENV_PEER_TOKEN: &str = "FASTLOAD_PEER_TOKEN";

/// How long a peer's manifest may take: a peer that does not answer at once is not worth waiting
/// for, the origin is there.
const MANIFEST_TIMEOUT: Duration = Duration::from_secs(3);

/// The peers of one load and the token they take.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PeerSettings {
    /// Base URLs, `http://host:port` or `https://host:port`.
    pub peers: Vec<String>,
    pub token: Option<Secret>,
}

impl PeerSettings {
    /// The caller's peers and token, else `FASTLOAD_PEERS` (comma-separated) and
    /// `FASTLOAD_PEER_TOKEN`.
    pub fn resolve(peers: Option<Vec<String>>, token: Option<Secret>) -> Result<PeerSettings> {
        let (peers, named) = match peers {
            Some(p) => (p, "peers"),
            None => {
                let var = std::env::var(ENV_PEERS).unwrap_or_default();
                (var.split(',').map(str::to_string).collect(), ENV_PEERS)
            }
        };
        let peers = peers
            .iter()
            .map(|p| p.trim())
            .filter(|p| !p.is_empty())
            .map(|p| base_url(p).map_err(|e| Error::option(named, e)))
            .collect::<Result<Vec<_>>>()?;
        let token = token.or_else(|| {
            std::env::var(ENV_PEER_TOKEN)
                .ok()
                .filter(|t| !t.is_empty())
                .map(|t| Secret(t.into()))
        });
        if let Some(token) = &token {
            // Scrubbed from every message, as the stores' keys are.
            crate::error::remember_secret(token.0.as_str());
        }
        Ok(PeerSettings { peers, token })
    }

    pub fn enabled(&self) -> bool {
        !self.peers.is_empty()
    }
}

/// A peer as its base URL: `host:port` is `http://host:port`; `http(s)://host:port` as given.
pub fn base_url(peer: &str) -> std::result::Result<String, String> {
    let url = if peer.contains("://") {
        peer.trim_end_matches('/').to_string()
    } else {
        format!("http://{}", peer.trim_end_matches('/'))
    };
    let wrong = || format!("{peer:?} is not a peer: give host:port or https://host:port");
    let parsed = url::Url::parse(&url).map_err(|_| wrong())?;
    let path_empty = parsed.path().is_empty() || parsed.path() == "/";
    let bare = parsed.query().is_none() && parsed.username().is_empty();
    if !matches!(parsed.scheme(), "http" | "https") || parsed.host().is_none() || !path_empty {
        return Err(wrong());
    }
    if !bare || parsed.port_or_known_default().is_none() {
        return Err(wrong());
    }
    Ok(url)
}

/// A serve's manifest (`GET /v1/manifest`), as far as a client reads it.
#[derive(Clone, Debug, Deserialize)]
pub struct Manifest {
    pub checkpoints: Vec<Checkpoint>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct Checkpoint {
    pub name: String,
    #[serde(default)]
    pub origin: Option<String>,
    pub files: Vec<FileEntry>,
}

#[derive(Clone, Debug, Deserialize)]
pub struct FileEntry {
    pub path: String,
    pub size: u64,
    pub identity: IdentityFields,
    #[serde(default)]
    pub origin_uri: Option<String>,
}

#[derive(Clone, Debug, Default, Deserialize)]
pub struct IdentityFields {
    #[serde(default)]
    pub sha256: Option<String>,
    #[serde(default)]
    pub etag: Option<String>,
    #[serde(default)]
    pub version: Option<String>,
}

impl FileEntry {
    /// Its canonical identity string.
    pub fn canonical(&self) -> String {
        let id = &self.identity;
        canonical_identity(
            id.sha256.as_deref(),
            id.etag.as_deref(),
            id.version.as_deref(),
            self.size,
        )
    }

    /// Whether this entry's bytes are those of the origin object the client pinned as
    /// `identity`: the same canonical identity, or, where the client pinned no version id (a
    /// listing gives none) but a strong ETag, the same but for the version id the serve pinned by
    /// its HEAD: the ETag and size the client's own origin reads check name the same bytes.
    fn stands_for(&self, identity: &str) -> bool {
        if self.canonical() == identity {
            return true;
        }
        let id = &self.identity;
        let etag = Version {
            etag: id.etag.clone(),
            ..Version::default()
        };
        let versionless = canonical_identity(None, id.etag.as_deref(), None, self.size);
        id.sha256.is_none() && etag.strong_etag().is_some() && versionless == identity
    }

    /// Whether this entry is the origin object `uri`: the same `origin_uri`, or for a Hub
    /// checkpoint (origin `hf://org/repo@commit`) the same repo, commit and path.
    fn is_origin(&self, checkpoint: &Checkpoint, uri: &str) -> bool {
        if self.origin_uri.as_deref() == Some(uri) {
            return true;
        }
        match checkpoint.origin.as_deref() {
            Some(origin) if origin.starts_with("hf://") => {
                format!("{}/{}", origin.trim_end_matches('/'), self.path) == uri
            }
            _ => false,
        }
    }
}

/// Where one file is on one peer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Location {
    /// Index of the peer in the load's peer list.
    pub peer: usize,
    /// `{base}/v1/files/{NAME}/{path}`.
    pub url: String,
    /// The canonical identity the peer lists it under: what requests ask for and answers must
    /// carry.
    pub identity: String,
}

/// Every peer (in the order given) whose manifest lists the origin object `uri` under an
/// identity that stands for `identity` ([`FileEntry::stands_for`]).
pub fn locate(manifests: &[(usize, String, Manifest)], uri: &str, identity: &str) -> Vec<Location> {
    let mut found = Vec::new();
    for (peer, base, manifest) in manifests {
        let hit = manifest.checkpoints.iter().find_map(|c| {
            c.files
                .iter()
                .find(|f| f.is_origin(c, uri) && f.stands_for(identity))
                .map(|f| (file_url(base, &c.name, &f.path), f.canonical()))
        });
        if let Some((url, identity)) = hit {
            found.push(Location {
                peer: *peer,
                url,
                identity,
            });
        }
    }
    found
}

/// The URL of file `path` of checkpoint `name` on the serve at `base`.
pub fn file_url(base: &str, name: &str, path: &str) -> String {
    let path: Vec<String> = path.split('/').map(encode).collect();
    format!("{base}/v1/files/{}/{}", encode(name), path.join("/"))
}

/// A path segment percent-encoded (names are `[A-Za-z0-9._-]+`; paths may hold more).
fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'.' | b'_' | b'-' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The peers of one load: their manifests (fetched once) and which were dropped.
#[derive(Debug)]
pub struct PeerSet {
    settings: PeerSettings,
    client: reqwest::Client,
    dropped: Vec<AtomicBool>,
    /// The stall rule of peer reads: the load's, with one slow window or one cut without a new
    /// byte enough to drop the peer.
    retry: RetrySettings,
    /// Bytes read from peers, and from origins after a peer was dropped or found none.
    pub from_peers: AtomicU64,
}

impl PeerSet {
    /// The peers `settings` names, the stall rule taken from `retry`.
    pub fn new(settings: PeerSettings, retry: &RetrySettings) -> Result<PeerSet> {
        let client = peer_client()?;
        let mut retry = retry.clone();
        retry.max_stalled_resumes = 1;
        retry.max_retries = 0;
        Ok(PeerSet {
            dropped: settings
                .peers
                .iter()
                .map(|_| AtomicBool::new(false))
                .collect(),
            settings,
            client,
            retry,
            from_peers: AtomicU64::new(0),
        })
    }

    /// Each peer's manifest that could be fetched (a peer that fails is dropped).
    pub async fn manifests(&self) -> Vec<(usize, String, Manifest)> {
        let asks = self
            .settings
            .peers
            .iter()
            .enumerate()
            .map(|(i, base)| async move {
                match self.manifest(base).await {
                    Ok(m) => Some((i, base.clone(), m)),
                    Err(e) => {
                        self.drop_peer(i, &e);
                        None
                    }
                }
            });
        futures_util::future::join_all(asks)
            .await
            .into_iter()
            .flatten()
            .collect()
    }

    async fn manifest(&self, base: &str) -> Result<Manifest> {
        let url = format!("{base}/v1/manifest");
        let request = self
            .authorized(self.client.get(&url))
            .timeout(MANIFEST_TIMEOUT);
        let response = request
            .send()
            .await
            .map_err(|e| io_error(base, io::ErrorKind::ConnectionRefused, e.to_string()))?;
        let status = response.status();
        if !status.is_success() {
            return Err(io_error(
                base,
                io::ErrorKind::PermissionDenied,
                format!("the peer answered {status} to its manifest"),
            ));
        }
        let body = response
            .bytes()
            .await
            .map_err(|e| io_error(base, io::ErrorKind::InvalidData, e.to_string()))?;
        serde_json::from_slice(&body)
            .map_err(|e| io_error(base, io::ErrorKind::InvalidData, format!("manifest: {e}")))
    }

    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.settings.token {
            Some(token) => request.bearer_auth(token.0.as_str()),
            None => request,
        }
    }

    fn is_dropped(&self, peer: usize) -> bool {
        self.dropped[peer].load(Ordering::Relaxed)
    }

    /// Drops `peer` for the rest of the load; `why` is said once, on stderr with the progress
    /// lines' prefix (the load goes on, so it is no error).
    fn drop_peer(&self, peer: usize, why: &Error) {
        if !self.dropped[peer].swap(true, Ordering::Relaxed) {
            let base = &self.settings.peers[peer];
            eprintln!(
                "fastload: peer {base} dropped, reading on from the next peer or the origin: {why}"
            );
        }
    }
}

/// The process's client for peers.
fn peer_client() -> Result<reqwest::Client> {
    crate::store::install_crypto();
    crate::store::clients::peer_client(|| {
        reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .connect_timeout(Duration::from_secs(2))
            .read_timeout(Duration::from_secs(30))
            .user_agent(concat!("fastload/", env!("CARGO_PKG_VERSION")))
            .build()
    })
    .map_err(|e| Error::Internal {
        message: format!("building the peers' HTTP client: {e}"),
    })
}

/// The peers' manifests being fetched (one request each, on the process runtime) while the
/// origins are opened and pinned: the two wait on different machines, so a load with peers
/// waits for the slower of them, not for both in turn. Dropped unused, the requests stop.
pub struct Asked {
    set: Arc<PeerSet>,
    manifests: tokio::task::JoinHandle<Vec<(usize, String, Manifest)>>,
}

impl Drop for Asked {
    fn drop(&mut self) {
        self.manifests.abort();
    }
}

/// Starts fetching the manifests of the peers `settings` names, where any of `uris` is read from
/// an origin a peer may hold (an object store, the Hub); `None` otherwise.
pub fn ask(
    settings: &PeerSettings,
    uris: &[String],
    storage_options: &[(String, String)],
) -> Result<Option<Asked>> {
    use crate::uri::{kind, Kind};
    let remote = uris
        .iter()
        .any(|u| matches!(kind(u), Kind::ObjectStore | Kind::Hub));
    if !settings.enabled() || !remote {
        return Ok(None);
    }
    let (retry, _) = crate::store::split_retry_options(storage_options)?;
    let set = Arc::new(PeerSet::new(settings.clone(), &retry)?);
    let manifests = crate::runtime::try_get()?.spawn({
        let set = set.clone();
        async move { set.manifests().await }
    });
    Ok(Some(Asked { set, manifests }))
}

/// Wraps every source that a peer holds with the same identity (one manifest fetch per peer
/// for the whole load, [`ask`]ed before the origins were opened); the others are returned as
/// they are.
pub fn wrap(sources: Vec<Arc<dyn Source>>, asked: Option<Asked>) -> Result<Vec<Arc<dyn Source>>> {
    let Some(mut asked) = asked else {
        return Ok(sources);
    };
    if sources.iter().all(|s| s.cache_identity().is_none()) {
        return Ok(sources);
    }
    let set = asked.set.clone();
    let manifests = crate::runtime::block_on("peers", async {
        (&mut asked.manifests).await.map_err(|e| Error::Internal {
            message: format!("fetching the peers' manifests: {e}"),
        })
    })?;
    Ok(sources
        .into_iter()
        .map(|source| {
            let Some((uri, identity)) = content_identity(source.as_ref()) else {
                return source;
            };
            let locations = locate(&manifests, &uri, &identity);
            if locations.is_empty() {
                return source;
            }
            let gets = locations
                .into_iter()
                .map(|l| {
                    let peer = l.peer;
                    let get = PeerGet::new(l, set.clone());
                    (peer, Box::new(get) as Box<dyn RangedGet>)
                })
                .collect();
            Arc::new(PeerSource::new(source, set.clone(), gets)) as Arc<dyn Source>
        })
        .collect())
}

/// The origin URI (without a query) and canonical identity of a remote source.
fn content_identity(source: &dyn Source) -> Option<(String, String)> {
    let id = source.cache_identity()?;
    let canonical = source.content_identity()?;
    Some((id.uri, canonical))
}

/// Requests of one file on one peer.
#[derive(Debug)]
struct PeerGet {
    location: Location,
    identity: String,
    set: Arc<PeerSet>,
}

impl PeerGet {
    fn new(location: Location, set: Arc<PeerSet>) -> PeerGet {
        PeerGet {
            identity: location.identity.clone(),
            location,
            set,
        }
    }

    async fn request(&self, range: Range<u64>) -> Result<Answer> {
        let url = &self.location.url;
        let request = self
            .set
            .client
            .get(url)
            .header("Range", format!("bytes={}-{}", range.start, range.end - 1))
            .header("Accept-Encoding", "identity")
            .header("X-Fastload-Identity", &self.identity);
        let response = self
            .set
            .authorized(request)
            .send()
            .await
            .map_err(|e| io_error(url, io::ErrorKind::ConnectionAborted, e.to_string()))?;
        let status = response.status().as_u16();
        let fail = |kind, m: String| Err(io_error(url, kind, m));
        if status == 409 {
            return fail(
                io::ErrorKind::NotFound,
                "409: the peer holds another version".into(),
            );
        }
        let sent = response
            .headers()
            .get("X-Fastload-Identity")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("");
        if sent != self.identity {
            return fail(
                io::ErrorKind::InvalidData,
                format!("the peer sent identity {sent:?}, not {:?}", self.identity),
            );
        }
        let served = match status {
            206 => content_range(response.headers()).unwrap_or(0..0),
            _ => {
                return fail(
                    io::ErrorKind::InvalidData,
                    format!("the peer answered {status}"),
                )
            }
        };
        let owned = url.clone();
        let body = response
            .bytes_stream()
            .map_err(move |e| io_error(&owned, io::ErrorKind::ConnectionAborted, e.to_string()))
            .boxed();
        Ok(Answer::Bytes(Response {
            range: served,
            size: None,
            version: Default::default(),
            body,
        }))
    }
}

/// `bytes a-b/n` as `a..b+1`.
fn content_range(headers: &reqwest::header::HeaderMap) -> Option<Range<u64>> {
    let v = headers.get("Content-Range")?.to_str().ok()?;
    let (range, _) = v.strip_prefix("bytes ")?.split_once('/')?;
    let (a, b) = range.split_once('-')?;
    let (a, b): (u64, u64) = (a.trim().parse().ok()?, b.trim().parse().ok()?);
    Some(a..b.checked_add(1)?)
}

impl RangedGet for PeerGet {
    fn get<'a>(
        &'a self,
        range: Range<u64>,
        _pin: &'a super::remote::Version,
    ) -> BoxFuture<'a, Result<Answer>> {
        Box::pin(self.request(range))
    }
}

/// A remote source that peers also hold: read from the first peer not dropped, the rest of a
/// read from the next one or the origin when a peer fails.
struct PeerSource {
    origin: Arc<dyn Source>,
    set: Arc<PeerSet>,
    /// The peers that hold it, in the order given, each with its requests.
    gets: Vec<(usize, Box<dyn RangedGet>)>,
    /// The peers' responses, pinned like any remote object's.
    pin: Pin,
}

impl std::fmt::Debug for PeerSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PeerSource")
            .field("origin", &self.origin)
            .field("peers", &self.gets.iter().map(|g| g.0).collect::<Vec<_>>())
            .finish()
    }
}

impl PeerSource {
    fn new(
        origin: Arc<dyn Source>,
        set: Arc<PeerSet>,
        gets: Vec<(usize, Box<dyn RangedGet>)>,
    ) -> PeerSource {
        let size = origin.size();
        PeerSource {
            origin,
            set,
            gets,
            pin: Pin::new(Some(size), None),
        }
    }

    async fn read(&self, offset: u64, dst: &mut [u8]) -> Result<()> {
        let mut done = 0usize;
        for (peer, get) in &self.gets {
            if done == dst.len() {
                break;
            }
            if self.set.is_dropped(*peer) {
                continue;
            }
            let mut landed = 0usize;
            let start = offset + done as u64;
            let name = self.origin.name();
            let out = read_range_from(
                get.as_ref(),
                &self.pin,
                name,
                start,
                &mut dst[done..],
                &self.set.retry,
                &mut landed,
            )
            .await;
            done += landed;
            self.set
                .from_peers
                .fetch_add(landed as u64, Ordering::Relaxed);
            match out {
                Ok(()) => return Ok(()),
                Err(e) => self.set.drop_peer(*peer, &e),
            }
        }
        if done < dst.len() {
            self.origin
                .read_into(offset + done as u64, &mut dst[done..])
                .await?;
        }
        Ok(())
    }
}

impl Source for PeerSource {
    fn name(&self) -> &str {
        self.origin.name()
    }

    fn size(&self) -> u64 {
        self.origin.size()
    }

    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.read(offset, dst))
    }

    fn cache_identity(&self) -> Option<CacheIdentity> {
        self.origin.cache_identity()
    }

    fn content_identity(&self) -> Option<String> {
        self.origin.content_identity()
    }

    fn stored_checksum(&self) -> Option<StoredChecksum> {
        self.origin.stored_checksum()
    }

    fn version(&self) -> Option<String> {
        self.origin.version()
    }
}

#[cfg(test)]
mod tests;
