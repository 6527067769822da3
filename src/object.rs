//! Object storage (s3://, gs://, az://, http(s)://) over the `object_store` crate: URI and option
//! parsing with boto3-like `AWS_*` environment handling, shard discovery under a prefix (index file
//! first), and ranged reads streamed straight into a caller's buffer, resuming cut-off bodies.
//!
//! Errors: a missing object is [`Error::NotFound`]; everything else (missing bucket, refused
//! connection, bad credentials, timeouts) is [`Error::Io`] with a message that names the URI and has
//! configured secrets and server-echoed request details scrubbed out.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::io;
use std::sync::{Arc, Mutex, Once};
use std::time::Duration;

use futures_util::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::path::Path;
use object_store::{
    BackoffConfig, ClientConfigKey, GetOptions, GetRange, ObjectStore, ObjectStoreExt,
    ObjectStoreScheme, RetryConfig,
};
use url::Url;

use crate::error::{Error, Result};
use crate::format::{self, Header};
use crate::source::INDEX_FILE;

/// Schemes served by this module (`file://` and plain paths stay on the local fast path).
const SCHEMES: &[&str] = &[
    "s3", "s3a", "gs", "az", "azure", "abfs", "abfss", "adl", "http", "https",
];

/// HTTP client defaults, applied before the environment and the options (which can override them):
/// - `timeout` covers a whole request, body included (object_store's default is 30 s): sized for
///   8 MiB blocks on slow, shared links (about 70 KB/s per stream);
/// - `read_timeout`: no byte for this long means a stalled connection, and the read is resumed;
/// - `connect_timeout`: a dead or filtered endpoint fails fast.
const CLIENT_DEFAULTS: &[(ClientConfigKey, &str)] = &[
    (ClientConfigKey::Timeout, "120s"),
    (ClientConfigKey::ReadTimeout, "30s"),
    (ClientConfigKey::ConnectTimeout, "5s"),
];
/// Requests retried by object_store (5xx, 429, SlowDown, connection errors): bounded in count and
/// time so that a dead endpoint fails in seconds, not minutes.
const MAX_RETRIES: usize = 6;
const RETRY_TIMEOUT: Duration = Duration::from_secs(60);
/// Body resumptions in a row that bring no new byte before a read gives up.
const MAX_STALLED_RESUMES: u32 = 5;
/// First bytes fetched for a header: one request covers the headers of typical shards.
const HEADER_PROBE: u64 = 256 * 1024;
/// HEAD requests in flight when sizes cannot be listed.
const HEAD_CONCURRENCY: usize = 16;

/// An opened object-store URI: the store, the key or prefix inside it, and the URI for messages.
#[derive(Debug, Clone)]
pub struct Remote {
    pub store: Arc<dyn ObjectStore>,
    /// The object key, or the prefix when the URI names a "directory".
    pub path: Path,
    /// The user's URI without credentials, query or fragment: use it in messages.
    pub uri: String,
    /// The URI ended with `/` or named a bucket root, so it can only be a prefix.
    pub is_prefix: bool,
}

impl Remote {
    /// The URI of an object of this store, for messages (`s3://bucket/prefix/name`).
    pub fn uri_of(&self, path: &Path) -> String {
        if path == &self.path {
            return self.uri.clone();
        }
        let uri = self.uri.trim_end_matches('/');
        let own = self.path.as_ref();
        match uri.strip_suffix(own) {
            Some(base) if own.is_empty() => format!("{base}/{path}"),
            Some(base) => format!("{base}{path}"),
            None => {
                let rel = path.as_ref().strip_prefix(own).unwrap_or(path.as_ref());
                format!("{uri}/{}", rel.trim_start_matches('/'))
            }
        }
    }
}

/// True for URIs that this module handles.
pub fn is_remote(uri: &str) -> bool {
    uri.split_once("://")
        .is_some_and(|(scheme, _)| SCHEMES.contains(&scheme.to_ascii_lowercase().as_str()))
}

/// Parses `uri` and builds its store. `options` are object_store configuration keys for the
/// scheme (`endpoint`, `region`, `access_key_id`, `skip_signature`, `timeout`, ...) plus
/// `max_retries` and `retry_timeout` (seconds); they override the environment.
pub fn open(uri: &str, options: &[(String, String)]) -> Result<Remote> {
    open_with_env(uri, options, std::env::vars())
}

/// [`open`] with the environment given explicitly (tests pass their own).
pub fn open_with_env(
    uri: &str,
    options: &[(String, String)],
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Remote> {
    let env: Vec<(String, String)> = env.into_iter().collect();
    let shown = redact_uri(uri);
    let url = Url::parse(uri).map_err(|e| unsupported(&shown, format!("not a valid URL: {e}")))?;
    if !is_remote(uri) {
        return Err(unsupported(&shown, "not an object-store URL"));
    }
    let (scheme, path) = ObjectStoreScheme::parse(&url)
        .map_err(|e| unsupported(&shown, clean_message(&e.to_string())))?;
    remember_secrets(options, &env);
    install_crypto();
    let (retry, store_options) = split_retry_options(options)?;
    let built = match scheme {
        ObjectStoreScheme::AmazonS3 => s3_builder(uri, &store_options, &env)?
            .with_retry(retry)
            .build()
            .map(|s| Arc::new(s) as Arc<dyn ObjectStore>),
        ObjectStoreScheme::GoogleCloudStorage => {
            let mut b = GoogleCloudStorageBuilder::new().with_url(uri);
            for (k, v) in CLIENT_DEFAULTS {
                b = b.with_config(GoogleConfigKey::Client(*k), *v);
            }
            if let Some((_, path)) = env.iter().find(|(k, _)| k == "SERVICE_ACCOUNT") {
                b = b.with_service_account_path(path);
            }
            for (k, v) in env_pairs(&env, "GOOGLE_") {
                if let Ok(key) = k.parse() {
                    b = b.with_config(key, v);
                }
            }
            for (k, v) in &store_options {
                b = b.with_config(parse_key::<GoogleConfigKey>("gs", k)?, v);
            }
            b.with_retry(retry).build().map(|s| Arc::new(s) as _)
        }
        ObjectStoreScheme::MicrosoftAzure => {
            let mut b = MicrosoftAzureBuilder::new().with_url(uri);
            for (k, v) in CLIENT_DEFAULTS {
                b = b.with_config(AzureConfigKey::Client(*k), *v);
            }
            for (k, v) in env_pairs(&env, "AZURE_") {
                if let Ok(key) = k.parse() {
                    b = b.with_config(key, v);
                }
            }
            if let Some((_, endpoint)) = env.iter().find(|(k, _)| k == "IDENTITY_ENDPOINT") {
                b = b.with_msi_endpoint(endpoint);
            }
            for (k, v) in &store_options {
                b = b.with_config(parse_key::<AzureConfigKey>("az", k)?, v);
            }
            b.with_retry(retry).build().map(|s| Arc::new(s) as _)
        }
        ObjectStoreScheme::Http => {
            let base = &url[..url::Position::BeforePath];
            let mut b = HttpBuilder::new().with_url(base);
            for (k, v) in CLIENT_DEFAULTS {
                b = b.with_config(*k, *v);
            }
            if url.scheme() == "http" {
                b = b.with_config(ClientConfigKey::AllowHttp, "true");
            }
            for (k, v) in &store_options {
                b = b.with_config(parse_key::<ClientConfigKey>("http", k)?, v);
            }
            b.with_retry(retry).build().map(|s| Arc::new(s) as _)
        }
        _ => return Err(unsupported(&shown, "not an object-store URL")),
    };
    let store = built.map_err(|e| build_error(&shown, e))?;
    let is_prefix = url.path().ends_with('/') || path.as_ref().is_empty();
    Ok(Remote {
        store,
        path,
        uri: shown,
        is_prefix,
    })
}

fn env_pairs<'a>(
    env: &'a [(String, String)],
    prefix: &'a str,
) -> impl Iterator<Item = (String, &'a str)> + 'a {
    env.iter()
        .filter(move |(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.as_str()))
}

fn parse_key<K: std::str::FromStr>(scheme: &str, key: &str) -> Result<K> {
    key.to_ascii_lowercase().parse::<K>().map_err(|_| {
        Error::option(
            format!("storage_options[{key:?}]"),
            format!(
                "not a {scheme}:// option (see object_store's config keys, e.g. endpoint, region, \
                 access_key_id, secret_access_key, session_token, skip_signature, \
                 virtual_hosted_style_request, allow_http, timeout, connect_timeout; \
                 plus max_retries and retry_timeout)"
            ),
        )
    })
}

/// Pulls our own retry keys out of the options and gives bare-number timeouts a unit; the rest
/// go to object_store as they are.
fn split_retry_options(
    options: &[(String, String)],
) -> Result<(RetryConfig, Vec<(String, String)>)> {
    let mut retry = RetryConfig {
        backoff: BackoffConfig {
            init_backoff: Duration::from_millis(100),
            max_backoff: Duration::from_secs(8),
            base: 2.0,
        },
        max_retries: MAX_RETRIES,
        retry_timeout: RETRY_TIMEOUT,
    };
    let mut rest = Vec::new();
    for (k, v) in options {
        match k.to_ascii_lowercase().as_str() {
            "max_retries" => {
                retry.max_retries = v.trim().parse().map_err(|_| {
                    Error::option(
                        "storage_options[\"max_retries\"]",
                        "expected a whole number",
                    )
                })?;
            }
            "retry_timeout" => {
                let secs: f64 = v
                    .trim()
                    .trim_end_matches('s')
                    .parse()
                    .ok()
                    .filter(|s: &f64| s.is_finite() && *s >= 0.0)
                    .ok_or_else(|| {
                        Error::option(
                            "storage_options[\"retry_timeout\"]",
                            "expected seconds, e.g. \"30\"",
                        )
                    })?;
                retry.retry_timeout = Duration::from_secs_f64(secs);
            }
            // Bare numbers are seconds (object_store wants a unit: "30s").
            key if key.ends_with("timeout") => match v.trim().parse::<f64>() {
                Ok(secs) if secs.is_finite() && secs >= 0.0 => {
                    rest.push((k.clone(), format!("{}ms", (secs * 1000.0).round() as u64)))
                }
                _ => rest.push((k.clone(), v.clone())),
            },
            _ => rest.push((k.clone(), v.clone())),
        }
    }
    Ok((retry, rest))
}

fn is_true(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}

/// The S3 builder: our client defaults, `AWS_*` variables as boto3 reads them, then `options`.
/// - `AWS_ENDPOINT_URL` (or `_S3`) set: path-style requests, plain http allowed when it is http://;
///   `virtual_hosted_style_request=true` puts the bucket in the endpoint's host instead.
/// - no endpoint: virtual-hosted requests to AWS unless the bucket name has dots (as boto3 does).
/// - no credentials and `AWS_EC2_METADATA_DISABLED=true`: an error now, instead of a request to
///   the instance-metadata address.
pub(crate) fn s3_builder(
    uri: &str,
    options: &[(String, String)],
    env: &[(String, String)],
) -> Result<AmazonS3Builder> {
    let mut b = AmazonS3Builder::new().with_url(uri);
    for (k, v) in CLIENT_DEFAULTS {
        b = b.with_config(AmazonS3ConfigKey::Client(*k), *v);
    }
    let mut explicit = HashSet::new();
    let mut metadata_disabled = false;
    for (k, v) in env_pairs(env, "AWS_") {
        if k == "aws_ec2_metadata_disabled" {
            metadata_disabled = is_true(v);
        } else if let Ok(key) = k.parse::<AmazonS3ConfigKey>() {
            explicit.insert(key);
            b = b.with_config(key, v);
        }
    }
    for (k, v) in options {
        let key = parse_key::<AmazonS3ConfigKey>("s3", k)?;
        explicit.insert(key);
        b = b.with_config(key, v);
    }
    let has = |key: AmazonS3ConfigKey| b.get_config_value(&key).is_some();
    let has_credentials = has(AmazonS3ConfigKey::AccessKeyId)
        || has(AmazonS3ConfigKey::SecretAccessKey)
        || has(AmazonS3ConfigKey::WebIdentityTokenFile)
        || has(AmazonS3ConfigKey::ContainerCredentialsRelativeUri)
        || has(AmazonS3ConfigKey::ContainerCredentialsFullUri);
    let unsigned = b
        .get_config_value(&AmazonS3ConfigKey::SkipSignature)
        .is_some_and(|v| is_true(&v));
    if !has_credentials && !unsigned && metadata_disabled {
        return Err(Error::Io {
            path: redact_uri(uri),
            source: io::Error::new(
                io::ErrorKind::PermissionDenied,
                "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the instance \
                 metadata service is disabled by AWS_EC2_METADATA_DISABLED), or pass \
                 storage_options={\"skip_signature\": \"true\"} for a public bucket",
            ),
        });
    }
    // Only s3:// URLs get these defaults; https://...amazonaws.com URLs carry their own style.
    let bucket = match Url::parse(uri) {
        Ok(url) if matches!(url.scheme(), "s3" | "s3a") => url.host_str().unwrap_or("").to_string(),
        _ => return Ok(b),
    };
    let endpoint = b
        .get_config_value(&AmazonS3ConfigKey::S3Endpoint)
        .or_else(|| b.get_config_value(&AmazonS3ConfigKey::Endpoint));
    let virtual_key = AmazonS3ConfigKey::VirtualHostedStyleRequest;
    let http_key = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);
    match &endpoint {
        Some(endpoint) => {
            if endpoint.starts_with("http://") && !explicit.contains(&http_key) {
                b = b.with_allow_http(true);
            }
            let virtual_hosted = b
                .get_config_value(&virtual_key)
                .is_some_and(|v| is_true(&v));
            if virtual_hosted {
                let with_bucket = endpoint_with_bucket(endpoint, &bucket);
                // Both keys, so that AWS_ENDPOINT_URL_S3 (which wins in object_store) agrees.
                b = b
                    .with_config(AmazonS3ConfigKey::Endpoint, &with_bucket)
                    .with_config(AmazonS3ConfigKey::S3Endpoint, with_bucket);
            }
        }
        None => {
            if !explicit.contains(&virtual_key) {
                b = b.with_virtual_hosted_style_request(!bucket.contains('.'));
            }
        }
    }
    Ok(b)
}

/// `http://host:port` + bucket → `http://bucket.host:port`, unless the host already starts with it.
fn endpoint_with_bucket(endpoint: &str, bucket: &str) -> String {
    match endpoint.split_once("://") {
        Some((scheme, rest)) if !bucket.is_empty() && !rest.starts_with(&format!("{bucket}.")) => {
            format!("{scheme}://{bucket}.{rest}")
        }
        _ => endpoint.to_string(),
    }
}

/// reqwest runs rustls without a built-in provider (the `ring` one is installed here), which keeps
/// the aws-lc C build out of the crate.
fn install_crypto() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        // Err only means another provider is already installed, which is fine.
        let _ = rustls::crypto::ring::default_provider().install_default();
    });
}

/// Every `*.safetensors` directly under the remote's prefix, or exactly the files that its
/// `model.safetensors.index.json` names, in a stable order, with their sizes.
pub async fn list_safetensors(remote: &Remote) -> Result<Vec<(Path, u64)>> {
    let index = remote.path.clone().join(INDEX_FILE);
    match get_small(remote, &index).await {
        Ok(bytes) => return from_index(remote, &index, &bytes).await,
        Err(Error::NotFound { .. }) => {}
        Err(e) => return Err(e),
    }
    let listing = list_dir(remote, &remote.path).await?;
    let mut files: Vec<(Path, u64)> = listing
        .into_iter()
        .filter(|(p, _)| p.extension() == Some("safetensors"))
        .collect();
    if files.is_empty() {
        return Err(Error::NotFound {
            path: format!("{} (no .safetensors objects under this prefix)", remote.uri),
        });
    }
    files.sort();
    Ok(files)
}

/// Turns the remote's URI into the objects to load: a prefix is listed, a `.json` is read as an
/// index, anything else is one object (or, when no such object exists, a prefix without its `/`).
pub async fn resolve(remote: &Remote) -> Result<Vec<(Path, u64)>> {
    if remote.is_prefix {
        return list_safetensors(remote).await;
    }
    if remote.path.extension() == Some("json") {
        let bytes = get_small(remote, &remote.path).await?;
        return from_index(remote, &remote.path, &bytes).await;
    }
    match head(remote, &remote.path).await {
        Ok(size) => Ok(vec![(remote.path.clone(), size)]),
        Err(Error::NotFound { path }) => match list_safetensors(remote).await {
            Err(Error::NotFound { .. }) => Err(Error::NotFound { path }),
            // Name what the user asked for, not the index probed for it.
            Err(Error::Io { source, .. }) => Err(Error::Io { path, source }),
            other => other,
        },
        Err(e) => Err(e),
    }
}

/// Size of one object.
pub async fn head(remote: &Remote, path: &Path) -> Result<u64> {
    remote
        .store
        .head(path)
        .await
        .map(|m| m.size)
        .map_err(|e| storage_error(&remote.uri_of(path), e))
}

/// Reads and validates the header of a `size`-byte object: one request for typical shards, a
/// second one only for headers over 256 KiB.
pub async fn read_header(remote: &Remote, path: &Path, size: u64) -> Result<Header> {
    let name = remote.uri_of(path);
    let mut probe = vec![0u8; size.min(HEADER_PROBE) as usize];
    read_range_into(remote.store.as_ref(), path, 0, &mut probe, &name).await?;
    let n = format::header_len(&probe, size).map_err(|e| Error::format(&name, e.0))?;
    let end = (format::PREFIX_LEN + n) as usize;
    if end > probe.len() {
        let have = probe.len();
        probe.resize(end, 0);
        read_range_into(
            remote.store.as_ref(),
            path,
            have as u64,
            &mut probe[have..],
            &name,
        )
        .await?;
    }
    format::parse_header(&probe[format::PREFIX_LEN as usize..end], size)
        .map_err(|e| Error::format(&name, e.0))
}

/// Reads `dst.len()` bytes at `offset` with one ranged GET, copying each body chunk into `dst` as
/// it arrives. A body that breaks off is resumed from the first missing byte (object_store already
/// retried the request itself); [`MAX_STALLED_RESUMES`] resumptions in a row without progress end
/// it. A body longer than asked for, an object shorter than the range, or an object that changed
/// (ETag) between resumptions is an error.
pub async fn read_range_into(
    store: &dyn ObjectStore,
    path: &Path,
    offset: u64,
    dst: &mut [u8],
    uri: &str,
) -> Result<()> {
    let end = offset
        .checked_add(dst.len() as u64)
        .ok_or_else(|| Error::option("range", format!("offset {offset} overflows")))?;
    let mut done = 0usize;
    let mut stalled = 0u32;
    let mut etag: Option<String> = None;
    let mut backoff = Duration::from_millis(50);
    while done < dst.len() {
        let start = offset + done as u64;
        let options = GetOptions {
            range: Some(GetRange::Bounded(start..end)),
            ..Default::default()
        };
        let result = store
            .get_opts(path, options)
            .await
            .map_err(|e| storage_error(uri, e))?;
        if result.range != (start..end) {
            return Err(io_error(
                uri,
                io::ErrorKind::UnexpectedEof,
                format!(
                    "object is {} bytes, cannot read bytes {offset}..{end} (did it change while loading?)",
                    result.meta.size
                ),
            ));
        }
        match (&etag, &result.meta.e_tag) {
            (Some(a), Some(b)) if a != b => {
                return Err(io_error(
                    uri,
                    io::ErrorKind::InvalidData,
                    "object changed while it was being read (ETag differs)",
                ))
            }
            (None, Some(b)) => etag = Some(b.clone()),
            _ => {}
        }
        let before = done;
        let mut body = result.into_stream();
        let mut cut = None;
        while let Some(chunk) = body.next().await {
            match chunk {
                Ok(chunk) => {
                    let room = dst.len() - done;
                    if chunk.len() > room {
                        return Err(io_error(
                            uri,
                            io::ErrorKind::InvalidData,
                            format!(
                                "server sent more than the {} bytes asked for at offset {offset}",
                                dst.len()
                            ),
                        ));
                    }
                    dst[done..done + chunk.len()].copy_from_slice(&chunk);
                    done += chunk.len();
                }
                Err(e) => {
                    cut = Some(storage_error(uri, e));
                    break;
                }
            }
        }
        if done == dst.len() {
            break;
        }
        stalled = if done > before { 0 } else { stalled + 1 };
        if stalled >= MAX_STALLED_RESUMES {
            return Err(cut.unwrap_or_else(|| {
                io_error(
                    uri,
                    io::ErrorKind::UnexpectedEof,
                    format!(
                        "body ended after {done} of {} bytes at offset {offset}, {MAX_STALLED_RESUMES} times",
                        dst.len()
                    ),
                )
            }));
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(5));
    }
    Ok(())
}

/// GET of a small object (an index file) into memory.
async fn get_small(remote: &Remote, path: &Path) -> Result<Vec<u8>> {
    let name = remote.uri_of(path);
    let result = remote
        .store
        .get_opts(path, GetOptions::default())
        .await
        .map_err(|e| storage_error(&name, e))?;
    if result.meta.size > format::MAX_HEADER_LEN {
        return Err(Error::format(&name, "index file is over 100 MB"));
    }
    let mut out = Vec::with_capacity(result.meta.size as usize);
    let mut body = result.into_stream();
    while let Some(chunk) = body.next().await {
        out.extend_from_slice(&chunk.map_err(|e| storage_error(&name, e))?);
    }
    Ok(out)
}

/// Objects directly under `prefix` with their sizes.
async fn list_dir(remote: &Remote, prefix: &Path) -> Result<Vec<(Path, u64)>> {
    let prefix = (!prefix.as_ref().is_empty()).then_some(prefix);
    let listing = remote
        .store
        .list_with_delimiter(prefix)
        .await
        .map_err(|e| storage_error(&remote.uri, e))?;
    Ok(listing
        .objects
        .into_iter()
        .map(|m| (m.location, m.size))
        .collect())
}

/// The files an index names (relative to the index's folder), sized by one listing of that folder
/// or, where the store cannot list (plain HTTP), by HEAD requests.
async fn from_index(remote: &Remote, index: &Path, bytes: &[u8]) -> Result<Vec<(Path, u64)>> {
    let name = remote.uri_of(index);
    let value: serde_json::Value = serde_json::from_slice(bytes)
        .map_err(|e| Error::format(&name, format!("index is not valid JSON: {e}")))?;
    let map = value
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| Error::format(&name, "index has no \"weight_map\" object"))?;
    let dir: Path = {
        let parts: Vec<_> = index.parts().collect();
        Path::from_iter(parts[..parts.len().saturating_sub(1)].iter().cloned())
    };
    let mut files = BTreeSet::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| {
            Error::format(
                &name,
                format!("weight_map entry for {tensor:?} is not a file name"),
            )
        })?;
        let rel = Path::parse(file).map_err(|e| {
            Error::format(
                &name,
                format!("weight_map names an invalid file {file:?}: {e}"),
            )
        })?;
        files.insert(Path::from_iter(dir.parts().chain(rel.parts())));
    }
    let listed: HashMap<Path, u64> = match list_dir(remote, &dir).await {
        Ok(objects) => objects.into_iter().collect(),
        Err(_) => HashMap::new(),
    };
    let sizes: Vec<Result<(Path, u64)>> = futures_util::stream::iter(files)
        .map(|p| {
            let known = listed.get(&p).copied();
            async move {
                match known {
                    Some(size) => Ok((p, size)),
                    None => head(remote, &p).await.map(|size| (p, size)),
                }
            }
        })
        .buffered(HEAD_CONCURRENCY)
        .collect()
        .await;
    sizes.into_iter().collect()
}

// ---- errors -------------------------------------------------------------------------------

fn unsupported(uri: &str, message: impl Into<String>) -> Error {
    Error::UnsupportedUri {
        uri: uri.to_string(),
        message: message.into(),
    }
}

fn io_error(uri: &str, kind: io::ErrorKind, message: impl Into<String>) -> Error {
    Error::Io {
        path: uri.to_string(),
        source: io::Error::new(kind, scrub(&message.into())),
    }
}

fn build_error(uri: &str, e: object_store::Error) -> Error {
    io_error(
        uri,
        io::ErrorKind::InvalidInput,
        format!("cannot configure the store: {}", clean_message(&chain(&e))),
    )
}

/// Maps an object_store error for `uri`: a missing object is [`Error::NotFound`]; a missing bucket
/// or container, and every other failure, is [`Error::Io`].
pub fn storage_error(uri: &str, e: object_store::Error) -> Error {
    let text = chain(&e);
    let detail = clean_message(&text);
    let (kind, message) = match &e {
        object_store::Error::NotFound { .. } => {
            const NO_BUCKET: &[&str] =
                &["NoSuchBucket", "ContainerNotFound", "bucket does not exist"];
            if !NO_BUCKET.iter().any(|m| text.contains(m)) {
                return Error::NotFound {
                    path: uri.to_string(),
                };
            }
            (
                io::ErrorKind::NotFound,
                format!("bucket or container not found ({detail})"),
            )
        }
        object_store::Error::PermissionDenied { .. }
        | object_store::Error::Unauthenticated { .. } => (
            io::ErrorKind::PermissionDenied,
            format!("access denied: check the credentials and their rights ({detail})"),
        ),
        _ if text.contains("timed out") || text.contains("Timeout") => {
            (io::ErrorKind::TimedOut, detail)
        }
        _ => (io::ErrorKind::Other, detail),
    };
    // Constructed directly: `Error::io` would turn kind NotFound (a missing bucket) into NotFound.
    Error::Io {
        path: uri.to_string(),
        source: io::Error::new(kind, scrub(&message)),
    }
}

/// The error and its sources, without repeating what an outer message already quotes.
fn chain(e: &dyn std::error::Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        source = s.source();
    }
    out
}

/// Replaces an XML error body (which can echo the request, signature details included) by its
/// `Code: Message`, and keeps messages to a readable length.
fn clean_message(text: &str) -> String {
    let tag = |name: &str| {
        let open = format!("<{name}>");
        let start = text.find(&open)? + open.len();
        let len = text[start..].find(&format!("</{name}>"))?;
        Some(text[start..start + len].to_string())
    };
    let mut out = match text.find("<?xml").or_else(|| text.find("<Error>")) {
        Some(at) => {
            let summary = match (tag("Code"), tag("Message")) {
                (Some(c), Some(m)) => format!("{c}: {m}"),
                (Some(c), None) => c,
                _ => "(XML error body)".to_string(),
            };
            format!("{}{summary}", &text[..at])
        }
        None => text.to_string(),
    };
    let trimmed = out.trim_end_matches([':', ' ']).len();
    out.truncate(trimmed);
    if out.len() > 2000 {
        let mut cut = 2000;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// Values of credential-like options and variables seen by [`open`], scrubbed from messages.
static SECRETS: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn is_secret_key(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    let names_a_file = ["file", "path", "uri", "url"]
        .iter()
        .any(|m| key.contains(m));
    !names_a_file
        && ["secret", "token", "key", "password", "sas", "credential"]
            .iter()
            .any(|m| key.contains(m))
}

fn remember_secrets(options: &[(String, String)], env: &[(String, String)]) {
    let cloud_env = env.iter().filter(|(k, _)| {
        k.starts_with("AWS_") || k.starts_with("AZURE_") || k.starts_with("GOOGLE_")
    });
    let mut secrets = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    for (k, v) in options.iter().chain(cloud_env) {
        // Short values would scrub ordinary words (and "true" is no secret).
        if is_secret_key(k) && v.len() >= 8 && !secrets.contains(v) {
            secrets.push(v.clone());
        }
    }
}

fn scrub(text: &str) -> String {
    let secrets = SECRETS.lock().unwrap_or_else(|e| e.into_inner());
    secrets
        .iter()
        .fold(text.to_string(), |t, s| t.replace(s.as_str(), "***"))
}

/// The URI without user info, query or fragment (a presigned query holds credentials).
pub fn redact_uri(uri: &str) -> String {
    match Url::parse(uri) {
        Ok(mut url) => {
            let _ = url.set_username("");
            let _ = url.set_password(None);
            url.set_query(None);
            url.set_fragment(None);
            url.to_string()
        }
        Err(_) => uri.split(['?', '#']).next().unwrap_or(uri).to_string(),
    }
}

#[cfg(test)]
mod tests {
    use std::fmt;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use futures_util::stream::BoxStream;
    use object_store::memory::InMemory;
    use object_store::{
        CopyOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
        PutMultipartOptions, PutOptions, PutPayload, PutResult,
    };

    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn opts(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        env(pairs)
    }

    fn s3(uri: &str, o: &[(&str, &str)], e: &[(&str, &str)]) -> Result<AmazonS3Builder> {
        s3_builder(uri, &opts(o), &env(e))
    }

    fn value(b: &AmazonS3Builder, key: AmazonS3ConfigKey) -> Option<String> {
        b.get_config_value(&key)
    }

    const KEYS: &[(&str, &str)] = &[
        ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
        (
            "AWS_SECRET_ACCESS_KEY",
            "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
        ),
    ];

    #[test]
    fn recognises_remote_schemes() {
        for uri in [
            "s3://b/k",
            "S3://b/k",
            "s3a://b/k",
            "gs://b/k",
            "az://c/k",
            "abfs://c/k",
            "abfss://c@a.dfs.core.windows.net/k",
            "http://h/x",
            "https://h/x",
        ] {
            assert!(is_remote(uri), "{uri}");
        }
        for uri in [
            "/tmp/x",
            "x.safetensors",
            "file:///tmp/x",
            "memory:///x",
            "ftp://h/x",
            "",
        ] {
            assert!(!is_remote(uri), "{uri}");
        }
    }

    #[test]
    fn endpoint_means_path_style_and_http_when_http() {
        let mut e = KEYS.to_vec();
        e.push(("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"));
        let b = s3("s3://models/llama/", &[], &e).unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Endpoint).as_deref(),
            Some("http://127.0.0.1:9000")
        );
        assert_eq!(
            value(&b, AmazonS3ConfigKey::VirtualHostedStyleRequest).as_deref(),
            Some("false")
        );
        let http = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);
        assert_eq!(value(&b, http).as_deref(), Some("true"));
        // An explicit allow_http=false wins over the inference.
        let b = s3("s3://models/x", &[("allow_http", "false")], &e).unwrap();
        assert_eq!(value(&b, http).as_deref(), Some("false"));
        // Client defaults are in place and options override them.
        let timeout = AmazonS3ConfigKey::Client(ClientConfigKey::Timeout);
        assert_eq!(value(&b, timeout).as_deref(), Some("120s"));
        let b = s3("s3://models/x", &[("timeout", "5s")], &e).unwrap();
        assert_eq!(value(&b, timeout).as_deref(), Some("5s"));
        let (_, rest) = split_retry_options(&opts(&[("connect_timeout", "1.5")])).unwrap();
        assert_eq!(rest, opts(&[("connect_timeout", "1500ms")]));
        // https endpoints stay https-only.
        e.pop();
        e.push(("AWS_ENDPOINT_URL", "https://minio.example"));
        let b = s3("s3://models/x", &[], &e).unwrap();
        assert_ne!(value(&b, http).as_deref(), Some("true"));
    }

    #[test]
    fn virtual_hosted_is_opt_in_with_an_endpoint() {
        let mut e = KEYS.to_vec();
        e.push(("AWS_ENDPOINT_URL", "http://s3.local:9000/"));
        let o = [("virtual_hosted_style_request", "true")];
        let b = s3("s3://models/x", &o, &e).unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Endpoint).as_deref(),
            Some("http://models.s3.local:9000/")
        );
        assert_eq!(
            value(&b, AmazonS3ConfigKey::VirtualHostedStyleRequest).as_deref(),
            Some("true")
        );
        // An endpoint that already names the bucket is left alone.
        let e2 = [
            KEYS[0],
            KEYS[1],
            ("AWS_ENDPOINT_URL", "http://models.s3.local"),
        ];
        let b = s3("s3://models/x", &o, &e2).unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Endpoint).as_deref(),
            Some("http://models.s3.local")
        );
    }

    #[test]
    fn aws_without_endpoint_is_virtual_hosted_unless_the_bucket_has_dots() {
        let b = s3("s3://models/x", &[], KEYS).unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::VirtualHostedStyleRequest).as_deref(),
            Some("true")
        );
        let b = s3("s3://my.models/x", &[], KEYS).unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::VirtualHostedStyleRequest).as_deref(),
            Some("false")
        );
        let b = s3(
            "s3://models/x",
            &[("virtual_hosted_style_request", "false")],
            KEYS,
        )
        .unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::VirtualHostedStyleRequest).as_deref(),
            Some("false")
        );
    }

    #[test]
    fn region_and_credentials_come_from_env_and_options_win() {
        let e = [
            KEYS[0],
            KEYS[1],
            ("AWS_DEFAULT_REGION", "eu-west-1"),
            ("AWS_REGION", "us-west-2"),
            ("AWS_SESSION_TOKEN", "session-token-value"),
        ];
        let b = s3("s3://b/x", &[], &e).unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Region).as_deref(),
            Some("us-west-2")
        );
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Token).as_deref(),
            Some("session-token-value")
        );
        let b = s3(
            "s3://b/x",
            &[],
            &[KEYS[0], KEYS[1], ("AWS_DEFAULT_REGION", "eu-west-1")],
        )
        .unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Region).as_deref(),
            Some("eu-west-1")
        );
        let b = s3(
            "s3://b/x",
            &[("region", "ap-south-1"), ("access_key_id", "OTHER")],
            &e,
        )
        .unwrap();
        assert_eq!(
            value(&b, AmazonS3ConfigKey::Region).as_deref(),
            Some("ap-south-1")
        );
        assert_eq!(
            value(&b, AmazonS3ConfigKey::AccessKeyId).as_deref(),
            Some("OTHER")
        );
    }

    #[test]
    fn disabled_metadata_without_credentials_fails_before_any_request() {
        let err = s3("s3://b/x", &[], &[("AWS_EC2_METADATA_DISABLED", "true")]).unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        let text = err.to_string();
        assert!(
            text.contains("s3://b/x") && text.contains("AWS_ACCESS_KEY_ID"),
            "{text}"
        );
        let aws_url = "https://models.s3.eu-west-1.amazonaws.com/x";
        assert!(s3(aws_url, &[], &[("AWS_EC2_METADATA_DISABLED", "true")]).is_err());
        // Anonymous access needs no credentials.
        let o = [("skip_signature", "true")];
        assert!(s3("s3://b/x", &o, &[("AWS_EC2_METADATA_DISABLED", "true")]).is_ok());
        assert!(s3(
            "s3://b/x",
            &[],
            &[KEYS[0], KEYS[1], ("AWS_EC2_METADATA_DISABLED", "1")]
        )
        .is_ok());
    }

    #[test]
    fn unknown_options_are_rejected_with_their_name() {
        let err = s3("s3://b/x", &[("endpiont", "http://x")], KEYS).unwrap_err();
        assert!(matches!(err, Error::InvalidOption { .. }), "{err}");
        assert!(err.to_string().contains("endpiont"), "{err}");
        let err =
            open_with_env("s3://b/x", &opts(&[("max_retries", "many")]), env(KEYS)).unwrap_err();
        assert!(err.to_string().contains("max_retries"), "{err}");
    }

    #[test]
    fn open_parses_keys_prefixes_and_redacts() {
        let e = env(&[KEYS[0], KEYS[1], ("AWS_ENDPOINT_URL", "http://127.0.0.1:1")]);
        let r = open_with_env("s3://models/llama/model.safetensors", &[], e.clone()).unwrap();
        assert_eq!(r.path.as_ref(), "llama/model.safetensors");
        assert!(!r.is_prefix);
        let r = open_with_env("s3://models/llama/", &[], e.clone()).unwrap();
        assert_eq!(r.path.as_ref(), "llama");
        assert!(r.is_prefix);
        assert_eq!(
            r.uri_of(&Path::from("llama/a.safetensors")),
            "s3://models/llama/a.safetensors"
        );
        let r = open_with_env("s3://models", &[], e.clone()).unwrap();
        assert!(r.is_prefix);
        assert_eq!(
            r.uri_of(&Path::from("a.safetensors")),
            "s3://models/a.safetensors"
        );
        let r = open_with_env(
            "https://user:pw@example.com/m/x.safetensors?sig=abc",
            &[],
            e,
        )
        .unwrap();
        assert_eq!(r.uri, "https://example.com/m/x.safetensors");
        assert_eq!(r.path.as_ref(), "m/x.safetensors");
        let r = open_with_env("http://127.0.0.1:1/dir/", &[], env(&[])).unwrap();
        assert!(r.is_prefix);
        assert_eq!(r.path.as_ref(), "dir");
        let anon = opts(&[("skip_signature", "true")]);
        let r = open_with_env("gs://bucket/m/x.safetensors", &anon, env(&[])).unwrap();
        assert_eq!(r.path.as_ref(), "m/x.safetensors");
        // Azure needs an account: a configuration error that names the URI, not a panic.
        let err = open_with_env("az://container/x", &[], env(&[])).unwrap_err();
        assert!(err.to_string().contains("az://container/x"), "{err}");
        assert!(matches!(
            open_with_env("ftp://h/x", &[], env(&[])),
            Err(Error::UnsupportedUri { .. })
        ));
    }

    #[test]
    fn messages_drop_xml_bodies_and_secrets() {
        remember_secrets(
            &opts(&[("secret_access_key", "very-secret-value-123")]),
            &[],
        );
        let raw =
            "Server returned 403: <?xml version=\"1.0\"?><Error><Code>SignatureDoesNotMatch</Code>\
                   <Message>bad sig</Message><StringToSign>x</StringToSign></Error>";
        assert_eq!(
            clean_message(raw),
            "Server returned 403: SignatureDoesNotMatch: bad sig"
        );
        assert_eq!(scrub("key very-secret-value-123 leaked"), "key *** leaked");
        assert!(!is_secret_key("aws_web_identity_token_file"));
        assert!(is_secret_key("AWS_SESSION_TOKEN"));
    }

    // ---- reads and listings against an in-memory store ----------------------------------

    fn data(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 7 + i / 251) as u8).collect()
    }

    async fn memory(files: &[(&str, Vec<u8>)]) -> Arc<InMemory> {
        let store = Arc::new(InMemory::new());
        for (name, bytes) in files {
            store
                .put(&Path::from(*name), PutPayload::from(bytes.clone()))
                .await
                .unwrap();
        }
        store
    }

    fn remote(store: Arc<dyn ObjectStore>, path: &str, is_prefix: bool) -> Remote {
        Remote {
            store,
            path: Path::from(path),
            uri: format!("s3://bucket/{path}{}", if is_prefix { "/" } else { "" }),
            is_prefix,
        }
    }

    #[tokio::test]
    async fn reads_ranges_exactly() {
        let bytes = data(100_000);
        let store = memory(&[("m.safetensors", bytes.clone())]).await;
        let path = Path::from("m.safetensors");
        let mut dst = vec![0u8; 30_000];
        read_range_into(store.as_ref(), &path, 12_345, &mut dst, "s3://b/m")
            .await
            .unwrap();
        assert_eq!(dst, bytes[12_345..42_345]);
        read_range_into(store.as_ref(), &path, 0, &mut [], "s3://b/m")
            .await
            .unwrap();
        // Past the end: the object is shorter than the range.
        let err = read_range_into(store.as_ref(), &path, 90_000, &mut dst, "s3://b/m")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains("s3://b/m"), "{err}");
        let err = read_range_into(
            store.as_ref(),
            &Path::from("nope"),
            0,
            &mut dst,
            "s3://b/nope",
        )
        .await
        .unwrap_err();
        assert!(
            matches!(err, Error::NotFound { ref path } if path == "s3://b/nope"),
            "{err}"
        );
    }

    /// Cuts the first `cuts` bodies after `keep` bytes (then errors), or pads every body.
    #[derive(Debug)]
    struct Flaky {
        inner: InMemory,
        keep: usize,
        cuts: AtomicUsize,
        pad: bool,
        gets: AtomicUsize,
    }

    impl Flaky {
        fn new(inner: InMemory, keep: usize, cuts: usize, pad: bool) -> Self {
            Flaky {
                inner,
                keep,
                cuts: AtomicUsize::new(cuts),
                pad,
                gets: AtomicUsize::new(0),
            }
        }
    }

    impl fmt::Display for Flaky {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            write!(f, "Flaky")
        }
    }

    #[async_trait::async_trait]
    impl ObjectStore for Flaky {
        async fn put_opts(
            &self,
            location: &Path,
            payload: PutPayload,
            opts: PutOptions,
        ) -> object_store::Result<PutResult> {
            self.inner.put_opts(location, payload, opts).await
        }

        async fn put_multipart_opts(
            &self,
            location: &Path,
            opts: PutMultipartOptions,
        ) -> object_store::Result<Box<dyn MultipartUpload>> {
            self.inner.put_multipart_opts(location, opts).await
        }

        async fn get_opts(
            &self,
            location: &Path,
            options: GetOptions,
        ) -> object_store::Result<GetResult> {
            self.gets.fetch_add(1, Ordering::SeqCst);
            let r = self.inner.get_opts(location, options).await?;
            let (meta, range, attributes) = (r.meta.clone(), r.range.clone(), r.attributes.clone());
            let body = r.bytes().await?;
            let cut = self
                .cuts
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok();
            let chunks: Vec<object_store::Result<_>> = if cut {
                let keep = self.keep.min(body.len());
                vec![
                    Ok(body.slice(..keep)),
                    Err(object_store::Error::Generic {
                        store: "flaky",
                        source: "connection reset by peer".into(),
                    }),
                ]
            } else if self.pad {
                vec![Ok(body), Ok(bytes::Bytes::from_static(b"extra"))]
            } else {
                vec![Ok(body)]
            };
            Ok(GetResult {
                payload: GetResultPayload::Stream(futures_util::stream::iter(chunks).boxed()),
                meta,
                range,
                attributes,
                extensions: Default::default(),
            })
        }

        fn delete_stream(
            &self,
            locations: BoxStream<'static, object_store::Result<Path>>,
        ) -> BoxStream<'static, object_store::Result<Path>> {
            self.inner.delete_stream(locations)
        }

        fn list(
            &self,
            prefix: Option<&Path>,
        ) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
            self.inner.list(prefix)
        }

        async fn list_with_delimiter(
            &self,
            prefix: Option<&Path>,
        ) -> object_store::Result<ListResult> {
            self.inner.list_with_delimiter(prefix).await
        }

        async fn copy_opts(
            &self,
            from: &Path,
            to: &Path,
            options: CopyOptions,
        ) -> object_store::Result<()> {
            self.inner.copy_opts(from, to, options).await
        }
    }

    async fn flaky(bytes: &[u8], keep: usize, cuts: usize, pad: bool) -> Flaky {
        let inner = InMemory::new();
        inner
            .put(&Path::from("m"), PutPayload::from(bytes.to_vec()))
            .await
            .unwrap();
        Flaky::new(inner, keep, cuts, pad)
    }

    #[tokio::test]
    async fn resumes_cut_off_bodies_from_where_they_stopped() {
        let bytes = data(50_000);
        let store = flaky(&bytes, 7_000, 3, false).await;
        let mut dst = vec![0u8; 40_000];
        read_range_into(&store, &Path::from("m"), 5_000, &mut dst, "s3://b/m")
            .await
            .unwrap();
        assert_eq!(dst, bytes[5_000..45_000]);
        assert_eq!(
            store.gets.load(Ordering::SeqCst),
            4,
            "3 cut bodies, then the rest"
        );
    }

    #[tokio::test]
    async fn gives_up_when_resuming_makes_no_progress() {
        let store = flaky(&data(1000), 0, usize::MAX, false).await;
        let mut dst = vec![0u8; 500];
        let started = std::time::Instant::now();
        let err = read_range_into(&store, &Path::from("m"), 0, &mut dst, "s3://b/m")
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Io { .. }), "{err}");
        assert!(err.to_string().contains("connection reset"), "{err}");
        assert_eq!(
            store.gets.load(Ordering::SeqCst),
            MAX_STALLED_RESUMES as usize
        );
        assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[tokio::test]
    async fn rejects_bodies_longer_than_asked() {
        let store = flaky(&data(1000), 0, 0, true).await;
        let mut dst = vec![0u8; 100];
        let err = read_range_into(&store, &Path::from("m"), 0, &mut dst, "s3://b/m")
            .await
            .unwrap_err();
        assert!(err.to_string().contains("more than"), "{err}");
    }

    fn index(files: &[(&str, &str)]) -> Vec<u8> {
        let map: serde_json::Map<String, serde_json::Value> = files
            .iter()
            .map(|(t, f)| (t.to_string(), serde_json::Value::from(*f)))
            .collect();
        serde_json::to_vec(&serde_json::json!({"metadata": {}, "weight_map": map})).unwrap()
    }

    #[tokio::test]
    async fn lists_safetensors_directly_under_a_prefix_sorted() {
        let store = memory(&[
            ("m/b.safetensors", data(10)),
            ("m/a.safetensors", data(20)),
            ("m/notes.txt", data(5)),
            ("m/sub/c.safetensors", data(5)),
            ("other/d.safetensors", data(5)),
        ])
        .await;
        let r = remote(store.clone(), "m", true);
        let got = list_safetensors(&r).await.unwrap();
        assert_eq!(
            got,
            vec![
                (Path::from("m/a.safetensors"), 20),
                (Path::from("m/b.safetensors"), 10)
            ]
        );
        // Without the trailing slash, a name that is no object is tried as a prefix.
        assert_eq!(
            resolve(&remote(store.clone(), "m", false)).await.unwrap(),
            got
        );
        let one = resolve(&remote(store.clone(), "m/b.safetensors", false))
            .await
            .unwrap();
        assert_eq!(one, vec![(Path::from("m/b.safetensors"), 10)]);
        let err = resolve(&remote(store.clone(), "nothing", false))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::NotFound { ref path } if path == "s3://bucket/nothing"),
            "{err}"
        );
        let err = list_safetensors(&remote(store, "empty", true))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::NotFound { .. }), "{err}");
    }

    #[tokio::test]
    async fn honours_the_index_and_names_missing_shards() {
        let idx = index(&[
            ("w1", "s-2.safetensors"),
            ("w2", "s-1.safetensors"),
            ("w3", "s-2.safetensors"),
        ]);
        let store = memory(&[
            ("m/model.safetensors.index.json", idx.clone()),
            ("m/s-1.safetensors", data(11)),
            ("m/s-2.safetensors", data(22)),
            ("m/stray.safetensors", data(33)),
        ])
        .await;
        let want = vec![
            (Path::from("m/s-1.safetensors"), 11),
            (Path::from("m/s-2.safetensors"), 22),
        ];
        assert_eq!(
            list_safetensors(&remote(store.clone(), "m", true))
                .await
                .unwrap(),
            want
        );
        let direct = remote(store.clone(), "m/model.safetensors.index.json", false);
        assert_eq!(resolve(&direct).await.unwrap(), want);

        let idx = index(&[("w1", "s-1.safetensors"), ("w2", "gone.safetensors")]);
        let store = memory(&[
            ("m/model.safetensors.index.json", idx),
            ("m/s-1.safetensors", data(11)),
        ])
        .await;
        let err = list_safetensors(&remote(store, "m", true))
            .await
            .unwrap_err();
        assert!(
            matches!(err, Error::NotFound { ref path } if path == "s3://bucket/m/gone.safetensors"),
            "{err}"
        );

        let store = memory(&[(
            "m/model.safetensors.index.json",
            b"{\"weight_map\": 3}".to_vec(),
        )])
        .await;
        let err = list_safetensors(&remote(store, "m", true))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{err}");
        let idx = index(&[("w1", "../escape.safetensors")]);
        let store = memory(&[("m/model.safetensors.index.json", idx)]).await;
        let err = list_safetensors(&remote(store, "m", true))
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{err}");
    }

    #[tokio::test]
    async fn reads_headers_in_one_or_two_requests() {
        let header = |pad: usize| {
            let json = format!(
                "{{\"t\":{{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4]}}{}}}",
                " ".repeat(pad)
            );
            let mut file = (json.len() as u64).to_le_bytes().to_vec();
            file.extend_from_slice(json.as_bytes());
            file.extend_from_slice(&[1, 2, 3, 4]);
            file
        };
        for pad in [0usize, 300_000] {
            let file = header(pad);
            let store = memory(&[("h.safetensors", file.clone())]).await;
            let r = remote(store, "h.safetensors", false);
            let h = read_header(&r, &r.path, file.len() as u64).await.unwrap();
            assert_eq!(h.tensors.len(), 1);
        }
        let store = memory(&[(
            "bad.safetensors",
            b"\xff\xff\xff\xff\xff\xff\xff\x7f{}".to_vec(),
        )])
        .await;
        let r = remote(store, "bad.safetensors", false);
        let err = read_header(&r, &r.path, 10).await.unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{err}");
        let err = read_header(&r, &r.path, 0).await.unwrap_err();
        assert!(matches!(err, Error::Format { .. }), "{err}");
    }
}
