//! `fastload serve URI...`: serves checkpoints (local folders, or anything fastload reads, filled
//! into the local cache as they are served) to peers over HTTP range requests, by the peer
//! protocol of docs/peers.md:
//! - [`manifest`]: the files, found once at start, each with the identity its origin pinned,
//!   looked up by exact name (no request path reaches the file system);
//! - [`routes`] and [`ranges`]: the endpoints, single ranges, bodies in bounded chunks;
//! - [`auth`]: the bearer token (constant-time) and the bind rule;
//! - [`metrics`]: bytes and answers per client, `/metrics` and progress on stderr;
//! - [`hold`]: `--hold`, the files in (page-locked) host memory;
//! - [`listen`]: TCP or TLS, HTTP/1.1 and HTTP/2, until SIGTERM/SIGINT.

use std::io::Write as _;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use clap::Args;

use crate::error::{Error, Result};
use crate::source::cache::{self, CacheSettings};
use crate::source::Source;
use crate::uri::{kind, Kind};
use manifest::{Catalog, Checkpoint, Content, Identity, Served};

pub mod auth;
mod hold;
mod listen;
pub mod manifest;
mod metrics;
mod pin;
pub mod ranges;
mod routes;

/// The port a serve listens on unless told otherwise.
pub const DEFAULT_PORT: u16 = 8471;

#[derive(Args)]
pub struct ServeArgs {
    /// What to serve: local folders or files, or any URI fastload reads (s3://, gs://, az://,
    /// http(s)://, hf://org/repo[@rev]); remote ones are filled into the local cache
    /// (FASTLOAD_CACHE, else the default cache folder; Hub files into the Hugging Face cache)
    #[arg(value_name = "URI", required = true)]
    uris: Vec<String>,
    /// The address to listen on; one other machines reach needs a token or --no-auth
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1")]
    bind: String,
    /// The port to listen on; 0 picks a free one (the "serving on" line says which)
    #[arg(long, value_name = "N", default_value_t = DEFAULT_PORT)]
    port: u16,
    /// A file whose first line is the bearer token clients must send [default:
    /// $FASTLOAD_PEER_TOKEN]
    #[arg(long, value_name = "FILE")]
    token_file: Option<String>,
    /// Serve without a token on an address other machines reach
    #[arg(long)]
    no_auth: bool,
    /// Keep every served file in host memory (page-locked where a CUDA driver is), read whole
    /// before serving starts, so that answers never wait on a disk
    #[arg(long)]
    hold: bool,
    /// Serve HTTPS with this PEM certificate chain (with --tls-key)
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<String>,
    /// The PEM private key of --tls-cert
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<String>,
    /// The name peers ask for a checkpoint by ([A-Za-z0-9._-]+), one per URI in order
    /// [default: the URI's last path segment]
    #[arg(long = "name", value_name = "NAME")]
    names: Vec<String>,
    /// A storage option KEY=VALUE for the URIs' stores (as storage_options= in Python),
    /// repeatable
    #[arg(long = "option", value_name = "KEY=VALUE")]
    options: Vec<String>,
}

/// Runs a serve until SIGTERM or SIGINT.
pub fn run(args: ServeArgs) -> Result<()> {
    let token = auth::load(args.token_file.as_deref())?;
    let ip: IpAddr =
        args.bind.trim().parse().map_err(|_| {
            Error::option("--bind", format!("{:?} is not an IP address", args.bind))
        })?;
    auth::check_bind(ip, token.as_ref(), args.no_auth)?;
    if args.names.len() > args.uris.len() {
        return Err(Error::option("--name", "more names than URIs"));
    }
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(listen::tls(cert, key)?),
        _ => None,
    };
    let storage_options = storage_options(&args.options)?;
    let settings = cache_settings()?;
    let mut checkpoints = Vec::new();
    for (i, uri) in args.uris.iter().enumerate() {
        let name = args.names.get(i).cloned();
        checkpoints.push(checkpoint(uri, name, &storage_options, &settings)?);
    }
    let catalog = Arc::new(Catalog::new(checkpoints)?);
    let runtime = crate::runtime::try_get()?;
    runtime.block_on(prepare(&catalog, args.hold, &settings))?;
    let shared = Arc::new(routes::Shared {
        catalog,
        token,
        metrics: Arc::default(),
    });
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(SocketAddr::new(ip, args.port))
            .await
            .map_err(|e| Error::io(format!("{ip} port {}", args.port), e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| Error::io("listener", e))?;
        let stop = listen::stop_signals()?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, "serving on {scheme}://{addr}");
        let _ = out.flush();
        drop(out);
        let progress = tokio::spawn(metrics::progress(
            shared.metrics.clone(),
            Duration::from_secs(10),
        ));
        listen::run(listener, routes::router(shared), tls, stop).await;
        progress.abort();
        eprintln!("fastload serve: stopped");
        Ok(())
    })
}

/// `--option KEY=VALUE` pairs.
fn storage_options(pairs: &[String]) -> Result<Vec<(String, String)>> {
    pairs
        .iter()
        .map(|pair| {
            let (k, v) = pair.split_once('=').ok_or_else(|| {
                Error::option("storage_options", format!("{pair:?} is not KEY=VALUE"))
            })?;
            Ok((k.trim().to_string(), v.to_string()))
        })
        .collect()
}

/// Where remote files are filled: FASTLOAD_CACHE when it is set (`off` reads through, filling
/// nothing), else the default cache folder; the rest (peers included) as a load's settings.
fn cache_settings() -> Result<CacheSettings> {
    let mut settings = CacheSettings::for_load(&crate::options::LoadOptions::default())?;
    if std::env::var_os(crate::options::ENV_CACHE).is_none() {
        settings.dir = Some(cache::default_dir());
        settings.fill = true;
    }
    Ok(settings)
}

/// The files `uri` names, each with its origin's identity, remote ones behind the cache.
fn checkpoint(
    uri: &str,
    name: Option<String>,
    storage_options: &[(String, String)],
    settings: &CacheSettings,
) -> Result<Checkpoint> {
    let listing = crate::copy::list(uri, storage_options)?;
    let local = kind(uri) == Kind::Local;
    let mut files = Vec::new();
    let (rels, sources): (Vec<String>, Vec<Arc<dyn Source>>) = listing
        .items
        .into_iter()
        .filter(|item| {
            let ok = crate::format::check_inside(&item.rel).is_ok();
            if !ok {
                eprintln!(
                    "fastload serve: note: {:?} is left out: not a name peers can ask for",
                    item.rel
                );
            }
            ok
        })
        .map(|item| (item.rel, item.source))
        .unzip();
    // Each object pinned by a HEAD, its version id too (a listing names none): serve/pin.rs.
    let (sources, versions): (Vec<_>, Vec<_>) =
        if kind(uri) == Kind::ObjectStore && pin::wanted(uri) {
            pin::head_all(uri, &rels, listing.single, storage_options)?
                .into_iter()
                .unzip()
        } else {
            sources.into_iter().map(|s| (s, None)).unzip()
        };
    let identities: Vec<_> = sources.iter().map(|s| s.cache_identity()).collect();
    // A serve's own peers (FASTLOAD_PEERS): a chain, or a cache daemon in front of the origin.
    let peers = crate::source::peer::ask(&settings.peers, &[uri.to_string()], storage_options)?;
    let sources = crate::source::peer::wrap(sources, peers)?;
    for (((rel, source), id), version) in rels
        .into_iter()
        .zip(cache::wrap(sources, settings))
        .zip(identities)
        .zip(versions)
    {
        let (identity, origin_uri) = match (&id, local) {
            (Some(id), _) => (Identity::of(id, version), Some(id.uri.clone())),
            (None, true) => (local_identity(source.as_ref())?, file_url(source.as_ref())),
            (None, false) => (
                Identity {
                    size: source.size(),
                    ..Identity::default()
                },
                None,
            ),
        };
        files.push(Arc::new(Served::new(rel, identity, origin_uri, source)));
    }
    Ok(Checkpoint {
        name: name.unwrap_or_else(|| manifest::default_name(uri)),
        origin: origin(uri, listing.single, &identities_hub(&files)),
        files,
    })
}

/// The Hub commit the files were read at, if they are a Hub repo's.
fn identities_hub(files: &[Arc<Served>]) -> Option<String> {
    files.iter().find_map(|f| {
        let hub = f.cache.as_ref()?.hub.as_ref()?;
        Some(format!("hf://{}@{}", hub.repo_id, hub.commit))
    })
}

/// The checkpoint's origin: its folder's `file://` URL, its object-store URI (a prefix with a
/// trailing `/`), or `hf://org/repo@<commit>`.
fn origin(uri: &str, single: bool, hub: &Option<String>) -> Option<String> {
    match kind(uri) {
        Kind::Hub => hub.clone(),
        Kind::ObjectStore => {
            let bare = uri.split(['?', '#']).next().unwrap_or(uri);
            let bare = crate::store::redact_uri(bare);
            Some(if single || bare.ends_with('/') {
                bare
            } else {
                format!("{bare}/")
            })
        }
        Kind::Local => {
            let path = std::path::absolute(crate::uri::local_path(uri)).ok()?;
            let url = if single {
                url::Url::from_file_path(&path)
            } else {
                url::Url::from_directory_path(&path)
            };
            url.ok().map(String::from)
        }
        // A serve of another serve's checkpoint (`peer://`): that serve is no origin.
        Kind::Peer => None,
    }
}

fn file_url(source: &dyn Source) -> Option<String> {
    let path = std::path::absolute(source.local_path()?).ok()?;
    url::Url::from_file_path(path).ok().map(String::from)
}

/// A local file with no origin is its content: its sha256, read once at start.
fn local_identity(source: &dyn Source) -> Result<Identity> {
    let size = source.size();
    let sha = crate::runtime::block_on(source.name(), async {
        let mut hash = ring::digest::Context::new(&ring::digest::SHA256);
        let mut buf = vec![0u8; ranges::CHUNK as usize];
        for (at, len) in ranges::chunks(0, size) {
            source.read_into(at, &mut buf[..len]).await?;
            hash.update(&buf[..len]);
        }
        Ok(hash.finish())
    })?;
    let hex: String = sha.as_ref().iter().map(|b| format!("{b:02x}")).collect();
    Ok(Identity {
        sha256: Some(hex),
        size,
        ..Identity::default()
    })
}

/// Before serving: with `hold`, every file read whole into host memory; otherwise remote files
/// start filling the cache in the background (each is served through its origin meanwhile).
async fn prepare(catalog: &Arc<Catalog>, hold: bool, settings: &CacheSettings) -> Result<()> {
    if !hold {
        let files: Vec<_> = catalog.files().cloned().collect();
        let settings = settings.clone();
        tokio::spawn(async move {
            for f in files {
                fill(f, &settings).await;
            }
        });
        return Ok(());
    }
    let engine = hold::engine();
    let mut page_locked = false;
    for f in catalog.files() {
        let Content::Source(source) = f.content() else {
            continue;
        };
        let held = hold::Held::read(source.as_ref(), engine.as_deref()).await?;
        page_locked = held.page_locked;
        f.set_held(Content::Held(Arc::new(held)));
    }
    let (n, bytes) = catalog.held();
    let kind = if page_locked { "page-locked" } else { "host" };
    eprintln!(
        "fastload serve: holding {n} files ({:.3} GB) in {kind} memory",
        bytes as f64 / 1e9
    );
    Ok(())
}

/// Bytes per read of a background fill, and reads in flight.
const FILL_PIECE: u64 = 8 << 20;
const FILL_READS: usize = 8;

/// Reads a remote file whole through its filling source, then serves its published copy.
async fn fill(served: Arc<Served>, settings: &CacheSettings) {
    use futures_util::stream::{self, StreamExt, TryStreamExt};
    let Content::Source(source) = served.content() else {
        return;
    };
    if served.is_held() || served.cache.is_none() || !settings.enabled() {
        return;
    }
    let pieces = (0..served.size).step_by(FILL_PIECE as usize).map(|at| {
        let source = source.clone();
        let len = (served.size - at).min(FILL_PIECE) as usize;
        async move {
            let mut buf = vec![0u8; len];
            source.read_into(at, &mut buf).await
        }
    });
    let filled = stream::iter(pieces)
        .buffer_unordered(FILL_READS)
        .try_collect::<Vec<()>>()
        .await;
    if let Err(e) = filled {
        let message = crate::error::scrub(&e.to_string());
        eprintln!(
            "fastload serve: {}: not filled ({message}); served from its origin",
            served.path
        );
        return;
    }
    drop(source);
    let (identity, settings) = (served.cache.clone(), settings.clone());
    let copy =
        tokio::task::spawn_blocking(move || cache::published_copy(identity.as_ref()?, &settings))
            .await;
    if let Ok(Some(copy)) = copy {
        served.set_held(Content::Source(copy));
    }
}
