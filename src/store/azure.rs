//! The `az://` builder: object_store's Azure Blob client, configured the ways Azure tools are.

use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::ClientConfigKey;

use super::errors::remember_secret;
use super::keys::{env_pairs, parse_key, var, CLIENT_DEFAULTS};
use crate::error::{Error, Result};

/// The Azure CLI's and SDKs' variable for a whole connection string.
const CONNECTION_STRING_VAR: &str = "AZURE_STORAGE_CONNECTION_STRING";
/// The option that takes a connection string.
const CONNECTION_STRING_OPTION: &str = "connection_string";

/// The Azure builder: our client defaults, then the environment, then `options`.
/// - Environment, lowest first: `AZURE_STORAGE_CONNECTION_STRING`; the Azure CLI's
///   `AZURE_STORAGE_ACCOUNT` and `AZURE_STORAGE_KEY`; object_store's `AZURE_*` names
///   (`AZURE_STORAGE_ACCOUNT_NAME`, `AZURE_STORAGE_ACCOUNT_KEY`, `AZURE_STORAGE_ENDPOINT`,
///   `AZURE_STORAGE_SAS_TOKEN`, `AZURE_STORAGE_USE_EMULATOR`, ...); `IDENTITY_ENDPOINT`.
/// - Options: object_store's keys plus `connection_string`.
/// - An `http://` endpoint allows plain http unless `allow_http` says otherwise (as for S3).
pub(crate) fn azure_builder(
    uri: &str,
    options: &[(String, String)],
    env: &[(String, String)],
) -> Result<MicrosoftAzureBuilder> {
    let mut b = MicrosoftAzureBuilder::new().with_url(uri);
    for (k, v) in CLIENT_DEFAULTS {
        b = b.with_config(AzureConfigKey::Client(*k), *v);
    }
    let var = |name: &str| var(env, name);
    if let Some(cs) = var(CONNECTION_STRING_VAR) {
        for (key, v) in connection_string(cs, CONNECTION_STRING_VAR)? {
            b = b.with_config(key, v);
        }
    }
    for (name, key) in [
        ("AZURE_STORAGE_ACCOUNT", AzureConfigKey::AccountName),
        ("AZURE_STORAGE_KEY", AzureConfigKey::AccessKey),
    ] {
        if let Some(v) = var(name) {
            b = b.with_config(key, v);
        }
    }
    let http_key = AzureConfigKey::Client(ClientConfigKey::AllowHttp);
    let mut http_set = false;
    for (k, v) in env_pairs(env, "AZURE_") {
        if let Ok(key) = k.parse::<AzureConfigKey>() {
            http_set |= key == http_key;
            b = b.with_config(key, v);
        }
    }
    if let Some(endpoint) = var("IDENTITY_ENDPOINT") {
        b = b.with_msi_endpoint(endpoint);
    }
    for (k, v) in options {
        if k.eq_ignore_ascii_case(CONNECTION_STRING_OPTION) {
            let name = format!("storage_options[{k:?}]");
            for (key, v) in connection_string(v, &name)? {
                b = b.with_config(key, v);
            }
            continue;
        }
        let key = parse_key::<AzureConfigKey>("az", k)?;
        http_set |= key == http_key;
        b = b.with_config(key, v);
    }
    if let Some(endpoint) = b.get_config_value(&AzureConfigKey::Endpoint) {
        // object_store appends `/container/blob` as path segments: a trailing `/` would double.
        let endpoint = endpoint.trim_end_matches('/').to_string();
        if endpoint.starts_with("http://") && !http_set {
            b = b.with_allow_http(true);
        }
        b = b.with_endpoint(endpoint);
    }
    Ok(b)
}

/// The settings of an Azure Storage connection string
/// (`DefaultEndpointsProtocol=https;AccountName=..;AccountKey=..;BlobEndpoint=..;EndpointSuffix=..`,
/// `SharedAccessSignature=..`, or `UseDevelopmentStorage=true` for Azurite). Other services'
/// endpoints are ignored. `source` names the variable or option in errors, never its value.
pub(super) fn connection_string(text: &str, source: &str) -> Result<Vec<(AzureConfigKey, String)>> {
    let mut fields = Vec::new();
    for part in text.split(';').map(str::trim).filter(|p| !p.is_empty()) {
        let Some((k, v)) = part.split_once('=') else {
            return Err(Error::option(
                source,
                "not an Azure connection string: expected Key=Value pairs separated by ';'",
            ));
        };
        fields.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let get = |name: &str| {
        fields
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.clone())
    };
    let mut out = Vec::new();
    if get("usedevelopmentstorage").is_some_and(|v| v.eq_ignore_ascii_case("true")) {
        out.push((AzureConfigKey::UseEmulator, "true".to_string()));
    }
    let account = get("accountname");
    if let Some(account) = &account {
        out.push((AzureConfigKey::AccountName, account.clone()));
    }
    if let Some(key) = get("accountkey") {
        remember_secret(&key);
        out.push((AzureConfigKey::AccessKey, key));
    }
    if let Some(sas) = get("sharedaccesssignature") {
        remember_secret(&sas);
        out.push((AzureConfigKey::SasKey, sas));
    }
    let protocol = get("defaultendpointsprotocol");
    let suffix = get("endpointsuffix");
    match (get("blobendpoint"), &account) {
        (Some(endpoint), _) => out.push((AzureConfigKey::Endpoint, endpoint)),
        (None, Some(account)) if protocol.is_some() || suffix.is_some() => {
            let protocol = protocol.as_deref().unwrap_or("https");
            let suffix = suffix.as_deref().unwrap_or("core.windows.net");
            out.push((
                AzureConfigKey::Endpoint,
                format!("{protocol}://{account}.blob.{suffix}"),
            ));
        }
        _ => {}
    }
    Ok(out)
}
