//! The `s3://` builder: object_store's S3 client configured as boto3 and the AWS CLI configure
//! theirs. Keys from the options, then the environment, then the profile (aws_profile.rs); any
//! other way to credentials through the AWS CLI's chain (aws_credentials.rs).

use std::collections::HashSet;
use std::io;
use std::sync::Arc;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::ClientConfigKey;
use url::Url;

use super::aws_credentials::{Chain, Sources};
use super::aws_profile;
use super::errors::redact_uri;
use super::keys::{env_pairs, is_true, parse_key, var, CLIENT_DEFAULTS};
use crate::error::{Error, Result};

/// The S3 builder: our client defaults, `AWS_*` variables as boto3 reads them, then `options`.
/// - `AWS_ENDPOINT_URL` (or `_S3`) set: path-style requests, plain http allowed when it is http://;
///   `virtual_hosted_style_request=true` puts the bucket in the endpoint's host instead.
/// - no endpoint: virtual-hosted requests to AWS unless the bucket name has dots (as boto3 does).
/// - no keys: the AWS CLI's credential chain (aws_credentials.rs); with nothing for it to run
///   and `AWS_EC2_METADATA_DISABLED=true`, an error now instead.
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
    // Keys object_store uses as they are: static ones, a web identity, and container
    // credentials named in the options (the environment's go through the chain, below).
    let has_keys = |b: &AmazonS3Builder| {
        let has = |key: AmazonS3ConfigKey| b.get_config_value(&key).is_some();
        has(AmazonS3ConfigKey::AccessKeyId)
            || has(AmazonS3ConfigKey::SecretAccessKey)
            || has(AmazonS3ConfigKey::WebIdentityTokenFile)
    };
    let container_option = explicit_in(options).any(|key| {
        matches!(
            key,
            AmazonS3ConfigKey::ContainerCredentialsRelativeUri
                | AmazonS3ConfigKey::ContainerCredentialsFullUri
        )
    });
    let container_env = CONTAINER_VARS.iter().any(|name| var(env, name).is_some());
    let from_env = has_keys(&b) || container_option || container_env;
    let (with_profile, flow) = aws_profile::apply(b, env, profile, from_env, &mut explicit)?;
    b = with_profile;
    let unsigned = b
        .get_config_value(&AmazonS3ConfigKey::SkipSignature)
        .is_some_and(|v| is_true(&v));
    if !has_keys(&b) && !container_option && !unsigned {
        if metadata_disabled && !container_env && flow.is_none() {
            return Err(no_credentials(uri));
        }
        let named = profile
            .or_else(|| var(env, "AWS_PROFILE").filter(|p| !p.is_empty()))
            .or_else(|| var(env, "AWS_DEFAULT_PROFILE").filter(|p| !p.is_empty()));
        let chain = Chain::new(Sources {
            profile: profile.map(str::to_string),
            region: b
                .get_config_value(&AmazonS3ConfigKey::Region)
                .or_else(|| b.get_config_value(&AmazonS3ConfigKey::DefaultRegion)),
            metadata_endpoint: b
                .get_config_value(&AmazonS3ConfigKey::MetadataEndpoint)
                .or_else(|| var(env, "AWS_EC2_METADATA_SERVICE_ENDPOINT").map(str::to_string)),
            flow,
            container: container_env,
            profile_shown: named.map_or("AWS_PROFILE or default".to_string(), |p| format!("{p:?}")),
        });
        b = b.with_credentials(Arc::new(chain));
    }
    Ok(s3_addressing(uri, b, &explicit))
}

/// The variables of ECS and EKS Pod Identity container credentials.
const CONTAINER_VARS: &[&str] = &[
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
];

/// The S3 keys the options set (they were checked already).
fn explicit_in(options: &[(String, String)]) -> impl Iterator<Item = AmazonS3ConfigKey> + '_ {
    options
        .iter()
        .filter_map(|(k, _)| k.to_ascii_lowercase().parse::<AmazonS3ConfigKey>().ok())
}

fn no_credentials(uri: &str) -> Error {
    Error::Io {
        path: redact_uri(uri),
        source: io::Error::new(
            io::ErrorKind::PermissionDenied,
            "no AWS credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (the instance \
             metadata service is disabled by AWS_EC2_METADATA_DISABLED), use a profile that has \
             credentials, or set the storage option skip_signature=true for a public bucket",
        ),
    }
}

/// Path-style or virtual-hosted requests, and plain http for an http:// endpoint.
fn s3_addressing(
    uri: &str,
    mut b: AmazonS3Builder,
    explicit: &HashSet<AmazonS3ConfigKey>,
) -> AmazonS3Builder {
    // Only s3:// URLs get these defaults; https://...amazonaws.com URLs carry their own style.
    let bucket = match Url::parse(uri) {
        Ok(url) if matches!(url.scheme(), "s3" | "s3a") => url.host_str().unwrap_or("").to_string(),
        _ => return b,
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
    b
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
