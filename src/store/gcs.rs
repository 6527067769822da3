//! The `gs://` builder: object_store's GCS client pointed at Google or at an emulator.

use std::io;

use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};

use super::errors::redact_uri;
use super::keys::{env_pairs, is_true, parse_key, var, CLIENT_DEFAULTS};
use crate::error::{Error, Result};

/// The emulator variable of Google's own client libraries (Go, Python, Java).
const EMULATOR_VAR: &str = "STORAGE_EMULATOR_HOST";
/// google-auth's switch for "this is not a GCE machine": no metadata-server request.
const NO_METADATA_VAR: &str = "NO_GCE_CHECK";
/// Where object_store looks for `gcloud auth application-default login` credentials.
const ADC_FILE: &str = ".config/gcloud/application_default_credentials.json";

/// The GCS builder: our client defaults, then `STORAGE_EMULATOR_HOST`, `SERVICE_ACCOUNT` and the
/// `GOOGLE_*` variables (object_store's names: `GOOGLE_BASE_URL`, `GOOGLE_SERVICE_ACCOUNT[_KEY]`,
/// `GOOGLE_APPLICATION_CREDENTIALS`, `GOOGLE_BEARER_TOKEN`, `GOOGLE_SKIP_SIGNATURE`), then
/// `options`, where `endpoint` is an alias of `base_url` (the name the other schemes use).
/// - `STORAGE_EMULATOR_HOST=host:port` (http unless it names a scheme): that base URL and, with no
///   credentials configured, unsigned requests, as Google's client libraries do;
/// - no credentials at all and `NO_GCE_CHECK=true`: an error now, instead of a request to the
///   metadata server.
pub(crate) fn gcs_builder(
    uri: &str,
    options: &[(String, String)],
    env: &[(String, String)],
) -> Result<GoogleCloudStorageBuilder> {
    let mut b = GoogleCloudStorageBuilder::new().with_url(uri);
    for (k, v) in CLIENT_DEFAULTS {
        b = b.with_config(GoogleConfigKey::Client(*k), *v);
    }
    let var = |name: &str| var(env, name);
    let emulator = var(EMULATOR_VAR).filter(|v| !v.trim().is_empty());
    if let Some(host) = emulator {
        b = b.with_base_url(&emulator_url(host));
    }
    if let Some(path) = var("SERVICE_ACCOUNT") {
        b = b.with_service_account_path(path);
    }
    let mut skip_set = false;
    for (k, v) in env_pairs(env, "GOOGLE_") {
        if let Ok(key) = k.parse::<GoogleConfigKey>() {
            skip_set |= key == GoogleConfigKey::SkipSignature;
            b = b.with_config(key, v);
        }
    }
    for (k, v) in options {
        let key = match k.to_ascii_lowercase().as_str() {
            "endpoint" | "google_endpoint" => GoogleConfigKey::BaseUrl,
            _ => parse_key::<GoogleConfigKey>("gs", k)?,
        };
        skip_set |= key == GoogleConfigKey::SkipSignature;
        b = b.with_config(key, v);
    }
    // object_store appends `/bucket/key` to the base URL as it is.
    if let Some(base) = b.get_config_value(&GoogleConfigKey::BaseUrl) {
        b = b.with_base_url(base.trim_end_matches('/'));
    }
    let has = |key: GoogleConfigKey| b.get_config_value(&key).is_some();
    let has_credentials = has(GoogleConfigKey::ServiceAccount)
        || has(GoogleConfigKey::ServiceAccountKey)
        || has(GoogleConfigKey::ApplicationCredentials)
        || has(GoogleConfigKey::BearerToken);
    if emulator.is_some() && !has_credentials && !skip_set {
        b = b.with_skip_signature(true);
    }
    let unsigned = b
        .get_config_value(&GoogleConfigKey::SkipSignature)
        .is_some_and(|v| is_true(&v));
    let adc_file =
        var("HOME").is_some_and(|home| std::path::Path::new(home).join(ADC_FILE).exists());
    if !has_credentials && !unsigned && !adc_file && var(NO_METADATA_VAR).is_some_and(is_true) {
        return Err(Error::Io {
            path: redact_uri(uri),
            source: io::Error::new(
                io::ErrorKind::PermissionDenied,
                "no Google credentials: set GOOGLE_APPLICATION_CREDENTIALS or \
                 GOOGLE_SERVICE_ACCOUNT to a service-account file (the metadata server is off by \
                 NO_GCE_CHECK), or set the storage option skip_signature=true for a public \
                 bucket",
            ),
        });
    }
    Ok(b)
}

/// `host:port` → `http://host:port`; a value with a scheme stays as it is.
pub(super) fn emulator_url(host: &str) -> String {
    let host = host.trim().trim_end_matches('/');
    if host.contains("://") {
        host.to_string()
    } else {
        format!("http://{host}")
    }
}
