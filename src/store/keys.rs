//! What every store's builder shares, at the bottom of src/store/: the HTTP client
//! defaults, reading variables out of an environment given as pairs, and option keys parsed into
//! object_store's config keys. Nothing here knows a cloud.

use object_store::ClientConfigKey;

use crate::error::{Error, Result};

/// HTTP client defaults, applied before the environment and the options (which can override them):
/// - `timeout` covers a whole request, body included (object_store's default is 30 s): sized for
///   8 MiB blocks on slow, shared links (about 70 KB/s per stream);
/// - `read_timeout`: no byte for this long means a stalled connection, and the read is resumed;
/// - `connect_timeout`: a dead or filtered endpoint fails fast;
/// - `pool_max_idle_per_host`, `pool_idle_timeout`: the idle connections a client keeps, as
///   `crate::store::clients` says (every store of a process with the same settings shares one
///   client).
pub(super) const CLIENT_DEFAULTS: &[(ClientConfigKey, &str)] = &[
    (ClientConfigKey::Timeout, "120s"),
    (ClientConfigKey::ReadTimeout, "30s"),
    (ClientConfigKey::ConnectTimeout, "5s"),
    (ClientConfigKey::PoolMaxIdlePerHost, "64"),
    (ClientConfigKey::PoolIdleTimeout, "10s"),
];

/// The value of `name` in `env`, if set.
pub(super) fn var<'a>(env: &'a [(String, String)], name: &str) -> Option<&'a str> {
    env.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
}

/// The variables starting with `prefix`, their names lower-cased (object_store's key spelling).
pub(super) fn env_pairs<'a>(
    env: &'a [(String, String)],
    prefix: &'a str,
) -> impl Iterator<Item = (String, &'a str)> + 'a {
    env.iter()
        .filter(move |(k, _)| k.starts_with(prefix))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.as_str()))
}

/// A `storage_options` key as object_store's config key for `scheme`; the error names the key
/// and lists examples of valid ones.
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
            "endpoint, region, access_key_id, secret_access_key, session_token, profile, \
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

/// Truthy as boto3 and the cloud SDKs read switches: 1, true, yes, on (any case).
pub(super) fn is_true(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "yes" | "on"
    )
}
