//! Building a store from a URI, options and the environment: the top of src/store/'s
//! one-way flow. Parses the URI, takes our own retry options out, and hands the rest to the scheme's
//! builder (s3.rs, gcs.rs, azure.rs; plain HTTP here).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3ConfigKey;
use object_store::azure::AzureConfigKey;
use object_store::gcp::GoogleConfigKey;
use object_store::http::HttpBuilder;
use object_store::multipart::MultipartStore;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreScheme};
use url::Url;

use super::azure::azure_builder;
use super::checksums::{AwsSigning, AzureSigning, ChecksumConnector, StoreChecksums};
use super::errors::*;
use super::gcs::gcs_builder;
use super::keys::{parse_key, CLIENT_DEFAULTS};
use super::s3::s3_builder;
use super::*;

use super::clients::SharedStoreClients;
use super::retry::RetrySettings;
use crate::error::{Error, Result};
use crate::options::Size;

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
    let (scheme, path) = ObjectStoreScheme::parse(&url)
        .map_err(|e| unsupported(&shown, clean_message(&e.to_string())))?;
    // Which URIs are object-store URIs is `source::open`'s to say; object_store would also
    // open these two, which are not remote.
    if matches!(scheme, ObjectStoreScheme::Local | ObjectStoreScheme::Memory) {
        return Err(unsupported(&shown, "not an object-store URL"));
    }
    remember_secrets(options, &env);
    crate::error::remember_url_credentials(uri);
    install_crypto();
    let (retry, store_options) = split_retry_options(options)?;
    let config = retry.request_config();
    let built = match scheme {
        ObjectStoreScheme::AmazonS3 => build_s3(uri, &store_options, &env, config)?,
        ObjectStoreScheme::GoogleCloudStorage => build_gcs(uri, &store_options, &env, config)?,
        ObjectStoreScheme::MicrosoftAzure => build_azure(uri, &store_options, &env, config)?,
        ObjectStoreScheme::Http => build_http(&url, &store_options, config)?,
        _ => return Err(unsupported(&shown, "not an object-store URL")),
    };
    let (store, multipart) = built.map_err(|e| build_error(&shown, e))?;
    let is_prefix = url.path().ends_with('/') || path.as_ref().is_empty();
    Ok(Remote {
        store,
        path,
        uri: shown,
        is_prefix,
        retry,
        multipart,
    })
}

/// A built store and its multipart uploads (where its scheme has them), or object_store's
/// reason it could not be built; the `Err` around it is a refusal of our own (an option).
type Built = std::result::Result<(Arc<dyn ObjectStore>, Option<Multipart>), object_store::Error>;

fn build_s3(
    uri: &str,
    options: &[(String, String)],
    env: &[(String, String)],
    retry: object_store::RetryConfig,
) -> Result<Built> {
    let b = s3_builder(uri, options, env)?;
    let key = AmazonS3ConfigKey::Endpoint;
    let from = || endpoint_source(&key, options, env, &["AWS_"], "endpoint_url");
    check_store_endpoint(b.get_config_value(&key), from)?;
    let signing = Arc::new(AwsSigning::default());
    Ok(b.with_retry(retry)
        .with_http_connector(ChecksumConnector(StoreChecksums::S3(signing.clone())))
        .build()
        .map(|s| {
            let _ = signing.credentials.set(s.credentials().clone());
            let s = Arc::new(s);
            (
                s.clone() as Arc<dyn ObjectStore>,
                Some(Multipart(s as Arc<dyn MultipartStore>)),
            )
        }))
}

fn build_gcs(
    uri: &str,
    options: &[(String, String)],
    env: &[(String, String)],
    retry: object_store::RetryConfig,
) -> Result<Built> {
    let b = gcs_builder(uri, options, env)?;
    let key = GoogleConfigKey::BaseUrl;
    let from = || endpoint_source(&key, options, env, &["GOOGLE_"], "STORAGE_EMULATOR_HOST");
    check_store_endpoint(b.get_config_value(&key), from)?;
    Ok(b.with_retry(retry)
        .with_http_connector(ChecksumConnector(StoreChecksums::Gcs))
        .build()
        .map(|s| {
            let s = Arc::new(s);
            (
                s.clone() as Arc<dyn ObjectStore>,
                Some(Multipart(s as Arc<dyn MultipartStore>)),
            )
        }))
}

fn build_azure(
    uri: &str,
    options: &[(String, String)],
    env: &[(String, String)],
    retry: object_store::RetryConfig,
) -> Result<Built> {
    let b = azure_builder(uri, options, env)?;
    let key = AzureConfigKey::Endpoint;
    let from = || endpoint_source(&key, options, env, &["AZURE_"], "the connection string");
    check_store_endpoint(b.get_config_value(&key), from)?;
    let signing = Arc::new(AzureSigning::default());
    Ok(b.with_retry(retry)
        .with_http_connector(ChecksumConnector(StoreChecksums::Azure(signing.clone())))
        .build()
        .map(|s| {
            let _ = signing.credentials.set(s.credentials().clone());
            (Arc::new(s) as Arc<dyn ObjectStore>, None)
        }))
}

fn build_http(
    url: &Url,
    options: &[(String, String)],
    retry: object_store::RetryConfig,
) -> Result<Built> {
    // A presigned URL's query (its signature) must go with every request of the object:
    // object_store builds each request's URL from this base, keeping its query.
    let base = match url.query() {
        Some(query) => {
            crate::error::remember_secret(query);
            format!("{}?{query}", &url[..url::Position::BeforePath])
        }
        None => url[..url::Position::BeforePath].to_string(),
    };
    let mut b = HttpBuilder::new().with_url(base);
    for (k, v) in CLIENT_DEFAULTS {
        b = b.with_config(*k, *v);
    }
    if url.scheme() == "http" {
        b = b.with_config(ClientConfigKey::AllowHttp, "true");
    }
    for (k, v) in options {
        b = b.with_config(parse_key::<ClientConfigKey>("http", k)?, v);
    }
    Ok(b.with_retry(retry)
        .with_http_connector(SharedStoreClients)
        .build()
        .map(|s| (Arc::new(s) as Arc<dyn ObjectStore>, None)))
}

/// Checks the endpoint a builder ended up with, wherever it came from (`from` names that): a value
/// that is no http(s) URL with a host is a `ConfigError` now, where object_store would panic
/// building its first request ("request must be valid").
fn check_store_endpoint(value: Option<String>, from: impl FnOnce() -> String) -> Result<()> {
    let Some(value) = value else {
        return Ok(());
    };
    crate::error::remember_url_credentials(&value);
    crate::options::check_endpoint(&value)
        .map(|_| ())
        .map_err(|e| {
            let shown = redact_uri(&value);
            Error::option(from(), format!("{shown:?} is not a usable endpoint: {e}"))
        })
}

/// Which option or variable set a store's `key` (options win over the environment, the last
/// one over earlier ones); `otherwise` when neither did (a config file, a connection string).
fn endpoint_source<K: std::str::FromStr + PartialEq>(
    key: &K,
    options: &[(String, String)],
    env: &[(String, String)],
    prefixes: &[&str],
    otherwise: &str,
) -> String {
    let is_key = |k: &str| {
        let k = k.to_ascii_lowercase();
        k.parse::<K>().is_ok_and(|p| &p == key) || k == "endpoint"
    };
    if let Some((k, _)) = options.iter().rev().find(|(k, _)| is_key(k)) {
        return format!("storage_options[{k:?}]");
    }
    env.iter()
        .rev()
        .find(|(k, _)| prefixes.iter().any(|p| k.starts_with(p)) && is_key(k))
        .map(|(k, _)| k.clone())
        .unwrap_or_else(|| otherwise.to_string())
}

/// Pulls our own retry keys out of the options and gives bare-number timeouts a unit; the rest
/// go to object_store as they are.
pub fn split_retry_options(
    options: &[(String, String)],
) -> Result<(RetrySettings, Vec<(String, String)>)> {
    let mut retry = RetrySettings::default();
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
            "retry_timeout" => retry.retry_timeout = seconds("retry_timeout", v)?,
            "min_rate" => {
                let rate = v.trim();
                let rate = rate
                    .strip_suffix("/s")
                    .unwrap_or(rate)
                    .parse::<Size>()
                    .map_err(|e| {
                        Error::option(
                            "storage_options[\"min_rate\"]",
                            format!(
                                "{e}; expected bytes per second, e.g. \"16KiB\" (0: no minimum)"
                            ),
                        )
                    })?;
                retry.min_rate = rate.0;
            }
            "min_rate_window" => {
                retry.min_rate_window = seconds("min_rate_window", v)?;
                if retry.min_rate_window.is_zero() {
                    return Err(Error::option(
                        "storage_options[\"min_rate_window\"]",
                        "must be more than 0 seconds",
                    ));
                }
            }
            // Durations: bare numbers are seconds (object_store wants a unit: "30s"); anything
            // else must parse as object_store parses it (humantime), checked here so that a typo
            // is a ConfigError naming the option rather than a storage error at the first read.
            key if key.ends_with("timeout") || key.ends_with("interval") => {
                let bad = || {
                    Error::option(
                        format!("storage_options[{k:?}]"),
                        format!(
                            "{v:?} is not a duration: expected seconds (\"30\", \"2.5\") or a \
                             number with a unit (\"30s\", \"500ms\", \"2m\")"
                        ),
                    )
                };
                let value = match v.trim().parse::<f64>() {
                    Ok(secs) if secs.is_finite() && secs >= 0.0 => {
                        format!("{}ms", (secs * 1000.0).round() as u64)
                    }
                    Ok(_) => return Err(bad()),
                    Err(_) => {
                        humantime::parse_duration(v.trim()).map_err(|_| bad())?;
                        v.trim().to_string()
                    }
                };
                rest.push((k.clone(), value));
            }
            _ => rest.push((k.clone(), v.clone())),
        }
    }
    Ok((retry, rest))
}

/// A duration in seconds, as a number or with an `s`: "30", "2.5s".
fn seconds(key: &str, v: &str) -> Result<Duration> {
    v.trim()
        .trim_end_matches('s')
        .parse()
        .ok()
        .filter(|s: &f64| s.is_finite() && *s >= 0.0 && *s < 1e9)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            Error::option(
                format!("storage_options[{key:?}]"),
                "expected seconds, e.g. \"30\"",
            )
        })
}

/// reqwest runs rustls without a built-in provider (the `ring` one is installed here), which keeps
/// the aws-lc C build out of the crate.
/// Lock-free (a `Once` being run when the process forks stays locked in the child): two threads
/// may both try, and the second's `Err` only says a provider is already installed.
pub fn install_crypto() {
    static INSTALLED: AtomicBool = AtomicBool::new(false);
    if !INSTALLED.load(Ordering::Acquire) {
        let _ = rustls::crypto::ring::default_provider().install_default();
        INSTALLED.store(true, Ordering::Release);
    }
}
