//! Building a store from a URI, options and the environment (boto3-like for S3).

use std::collections::HashSet;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::http::HttpBuilder;
use object_store::{ClientConfigKey, ObjectStore, ObjectStoreScheme};
use url::Url;

use super::aws_profile;
use super::azure::azure_builder;
use super::errors::*;
use super::gcs::gcs_builder;
use super::retry::RetrySettings;
use super::*;
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
            .with_retry(retry.request_config())
            .build()
            .map(|s| Arc::new(s) as Arc<dyn ObjectStore>),
        ObjectStoreScheme::GoogleCloudStorage => gcs_builder(uri, &store_options, &env)?
            .with_retry(retry.request_config())
            .build()
            .map(|s| Arc::new(s) as _),
        ObjectStoreScheme::MicrosoftAzure => azure_builder(uri, &store_options, &env)?
            .with_retry(retry.request_config())
            .build()
            .map(|s| Arc::new(s) as _),
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
            b.with_retry(retry.request_config())
                .build()
                .map(|s| Arc::new(s) as _)
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
        retry,
    })
}

pub(super) fn env_pairs<'a>(
    env: &'a [(String, String)],
    prefix: &'a str,
) -> impl Iterator<Item = (String, &'a str)> + 'a {
    env.iter()
        .filter(move |(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.as_str()))
}

pub(super) fn parse_key<K: std::str::FromStr>(scheme: &str, key: &str) -> Result<K> {
    let examples = match scheme {
        "gs" => {
            "endpoint (alias of base_url), service_account, service_account_key, \
             application_credentials, bearer_token, skip_signature"
        }
        "az" => {
            "account_name, access_key, endpoint, sas_token, bearer_token, use_emulator, \
             skip_signature, connection_string"
        }
        "http" => "allow_http, allow_invalid_certificates",
        _ => {
            "endpoint, region, access_key_id, secret_access_key, session_token, \
             skip_signature, virtual_hosted_style_request"
        }
    };
    key.to_ascii_lowercase().parse::<K>().map_err(|_| {
        Error::option(
            format!("storage_options[{key:?}]"),
            format!(
                "not a {scheme}:// option (see object_store's config keys, e.g. {examples}; \
                 and for every scheme allow_http, timeout, connect_timeout, max_retries, \
                 retry_timeout, min_rate and min_rate_window)"
            ),
        )
    })
}

/// Pulls our own retry keys out of the options and gives bare-number timeouts a unit; the rest
/// go to object_store as they are.
pub(super) fn split_retry_options(
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

pub(super) fn is_true(v: &str) -> bool {
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
    let mut profile = None;
    for (k, v) in options {
        if k.eq_ignore_ascii_case("profile") {
            profile = Some(v.as_str());
            continue;
        }
        let key = parse_key::<AmazonS3ConfigKey>("s3", k)?;
        explicit.insert(key);
        b = b.with_config(key, v);
    }
    let has_credentials = |b: &AmazonS3Builder| {
        let has = |key: AmazonS3ConfigKey| b.get_config_value(&key).is_some();
        has(AmazonS3ConfigKey::AccessKeyId)
            || has(AmazonS3ConfigKey::SecretAccessKey)
            || has(AmazonS3ConfigKey::WebIdentityTokenFile)
            || has(AmazonS3ConfigKey::ContainerCredentialsRelativeUri)
            || has(AmazonS3ConfigKey::ContainerCredentialsFullUri)
    };
    let from_env = has_credentials(&b);
    b = aws_profile::apply(b, env, profile, from_env, &mut explicit)?;
    let has_credentials = has_credentials(&b);
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
pub(super) fn endpoint_with_bucket(endpoint: &str, bucket: &str) -> String {
    match endpoint.split_once("://") {
        Some((scheme, rest)) if !bucket.is_empty() && !rest.starts_with(&format!("{bucket}.")) => {
            format!("{scheme}://{bucket}.{rest}")
        }
        _ => endpoint.to_string(),
    }
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
