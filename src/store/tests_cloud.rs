//! gs:// and az:// configuration: emulators, custom endpoints, anonymous access, connection
//! strings. (Requests against real servers are tested from Python: tests/test_object_stores.py,
//! tests/test_gcs.py and tests/test_azure.py.)

use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::ClientConfigKey;

use super::azure::{azure_builder, connection_string};
use super::config::open_with_env;
use super::errors::scrub;
use super::gcs::{emulator_url, gcs_builder};
use crate::error::{Error, Result};

fn pairs(p: &[(&str, &str)]) -> Vec<(String, String)> {
    p.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn gcs(o: &[(&str, &str)], e: &[(&str, &str)]) -> Result<GoogleCloudStorageBuilder> {
    gcs_builder("gs://bucket/m/x.safetensors", &pairs(o), &pairs(e))
}

fn az(o: &[(&str, &str)], e: &[(&str, &str)]) -> Result<MicrosoftAzureBuilder> {
    azure_builder("az://models/m/x.safetensors", &pairs(o), &pairs(e))
}

const HTTP: AzureConfigKey = AzureConfigKey::Client(ClientConfigKey::AllowHttp);
const AZURITE_KEY: &str =
    "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw==";

#[test]
fn gcs_endpoint_is_an_alias_of_base_url_without_a_trailing_slash() {
    let b = gcs(&[("endpoint", "http://127.0.0.1:4443/")], &[]).unwrap();
    assert_value!(b, GoogleConfigKey::BaseUrl, "http://127.0.0.1:4443");
    // object_store's own name too, and it wins over the environment.
    let b = gcs(
        &[("base_url", "http://127.0.0.1:2")],
        &[("GOOGLE_BASE_URL", "http://127.0.0.1:1")],
    )
    .unwrap();
    assert_value!(b, GoogleConfigKey::BaseUrl, "http://127.0.0.1:2");
    // A base URL alone changes nothing about credentials.
    assert_value!(b, GoogleConfigKey::SkipSignature, "false");
}

#[test]
fn gcs_emulator_host_means_that_url_and_unsigned_requests() {
    let e = [("STORAGE_EMULATOR_HOST", "127.0.0.1:4443")];
    let b = gcs(&[], &e).unwrap();
    assert_value!(b, GoogleConfigKey::BaseUrl, "http://127.0.0.1:4443");
    assert_value!(b, GoogleConfigKey::SkipSignature, "true");
    // Credentials, or an explicit choice, are kept.
    let b = gcs(&[("bearer_token", "ya29.token-for-test")], &e).unwrap();
    assert_value!(b, GoogleConfigKey::SkipSignature, "false");
    let b = gcs(&[], &[e[0], ("GOOGLE_SKIP_SIGNATURE", "false")]).unwrap();
    assert_value!(b, GoogleConfigKey::SkipSignature, "false");
    assert_eq!(emulator_url("https://gcs.local:9/"), "https://gcs.local:9");
    assert_eq!(emulator_url(" localhost:4443 "), "http://localhost:4443");
}

#[test]
fn gcs_credentials_come_from_google_variables() {
    let b = gcs(
        &[],
        &[
            ("GOOGLE_SERVICE_ACCOUNT", "/tmp/sa.json"),
            ("GOOGLE_BUCKET", "ignored-url-wins"),
        ],
    )
    .unwrap();
    assert_value!(b, GoogleConfigKey::ServiceAccount, "/tmp/sa.json");
    let b = gcs(&[], &[("GOOGLE_APPLICATION_CREDENTIALS", "/tmp/adc.json")]).unwrap();
    assert_value!(b, GoogleConfigKey::ApplicationCredentials, "/tmp/adc.json");
}

#[test]
fn gcs_without_credentials_and_no_metadata_fails_before_any_request() {
    let e = [("NO_GCE_CHECK", "true"), ("HOME", "/nonexistent-home")];
    let err = gcs(&[], &e).unwrap_err();
    assert!(
        matches!(err, Error::Io { ref path, ref source }
            if path == "gs://bucket/m/x.safetensors"
                && source.kind() == std::io::ErrorKind::PermissionDenied),
        "{err}"
    );
    // The point is the advice: the message names what to set.
    assert!(
        err.to_string().contains("GOOGLE_APPLICATION_CREDENTIALS"),
        "{err}"
    );
    assert!(gcs(&[("skip_signature", "true")], &e).is_ok());
    assert!(gcs(&[("service_account_key", "{}")], &e).is_ok());
    assert!(
        gcs(&[], &[e[1]]).is_ok(),
        "the metadata server stays allowed"
    );
}

#[test]
fn gcs_and_azure_reject_unknown_options_by_name() {
    let err = gcs(&[("endpiont", "http://x")], &[]).unwrap_err();
    assert!(
        matches!(err, Error::InvalidOption { ref option, .. } if option.contains("\"endpiont\"")),
        "{err}"
    );
    // The message suggests the keys that do exist.
    assert!(err.to_string().contains("base_url"), "{err}");
    let err = az(&[("acount_name", "x")], &[]).unwrap_err();
    assert!(
        matches!(err, Error::InvalidOption { ref option, .. } if option.contains("\"acount_name\"")),
        "{err}"
    );
    assert!(err.to_string().contains("account_name"), "{err}");
}

#[test]
fn azure_http_endpoint_allows_http_unless_told_otherwise() {
    let o = [
        ("account_name", "acct"),
        ("access_key", AZURITE_KEY),
        ("endpoint", "http://127.0.0.1:10000/acct/"),
    ];
    let b = az(&o, &[]).unwrap();
    assert_value!(b, AzureConfigKey::Endpoint, "http://127.0.0.1:10000/acct");
    assert_value!(b, HTTP, "true");
    let b = az(&[o[0], o[1], o[2], ("allow_http", "false")], &[]).unwrap();
    assert_value!(b, HTTP, "false");
    let b = az(&[o[0], ("endpoint", "https://acct.example.net")], &[]).unwrap();
    assert_ne!(b.get_config_value(&HTTP).as_deref(), Some("true"));
    // The same through the environment.
    let b = az(
        &[],
        &[
            ("AZURE_STORAGE_ACCOUNT_NAME", "acct"),
            ("AZURE_STORAGE_ACCOUNT_KEY", AZURITE_KEY),
            ("AZURE_STORAGE_ENDPOINT", "http://127.0.0.1:1/acct"),
        ],
    )
    .unwrap();
    assert_value!(b, HTTP, "true");
    assert_value!(b, AzureConfigKey::AccountName, "acct");
}

#[test]
fn azure_cli_variables_and_object_store_names_agree() {
    let b = az(
        &[],
        &[
            ("AZURE_STORAGE_ACCOUNT", "cli"),
            ("AZURE_STORAGE_KEY", AZURITE_KEY),
        ],
    )
    .unwrap();
    assert_value!(b, AzureConfigKey::AccountName, "cli");
    assert_value!(b, AzureConfigKey::AccessKey, AZURITE_KEY);
    // object_store's names are more specific and win; options win over both.
    let b = az(
        &[("account_name", "opt")],
        &[
            ("AZURE_STORAGE_ACCOUNT", "cli"),
            ("AZURE_STORAGE_ACCOUNT_NAME", "os"),
        ],
    )
    .unwrap();
    assert_value!(b, AzureConfigKey::AccountName, "opt");
    let b = az(
        &[],
        &[
            ("AZURE_STORAGE_ACCOUNT", "cli"),
            ("AZURE_STORAGE_ACCOUNT_NAME", "os"),
        ],
    )
    .unwrap();
    assert_value!(b, AzureConfigKey::AccountName, "os");
}

#[test]
fn azure_connection_strings() {
    let cs = format!(
        "DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;AccountKey={AZURITE_KEY};\
         BlobEndpoint=http://127.0.0.1:10000/devstoreaccount1;QueueEndpoint=http://127.0.0.1:10001/x;"
    );
    let got = connection_string(&cs, "test").unwrap();
    assert!(got.contains(&(AzureConfigKey::AccountName, "devstoreaccount1".into())));
    // The key's `==` padding survives: only the first `=` splits.
    assert!(got.contains(&(AzureConfigKey::AccessKey, AZURITE_KEY.into())));
    assert!(got.contains(&(
        AzureConfigKey::Endpoint,
        "http://127.0.0.1:10000/devstoreaccount1".into()
    )));
    assert_eq!(got.len(), 3, "{got:?}");
    assert_eq!(scrub(&format!("x {AZURITE_KEY} y")), "x *** y");

    let got = connection_string(
        "AccountName=a;SharedAccessSignature=sv=2022&sig=abc%3D;EndpointSuffix=core.chinacloudapi.cn",
        "test",
    )
    .unwrap();
    assert!(got.contains(&(AzureConfigKey::SasKey, "sv=2022&sig=abc%3D".into())));
    assert!(got.contains(&(
        AzureConfigKey::Endpoint,
        "https://a.blob.core.chinacloudapi.cn".into()
    )));
    let got = connection_string("UseDevelopmentStorage=true", "test").unwrap();
    assert_eq!(got, vec![(AzureConfigKey::UseEmulator, "true".into())]);

    let err = connection_string("AccountName=a;not-a-pair-secret", "storage_options").unwrap_err();
    assert!(matches!(err, Error::InvalidOption { .. }), "{err}");
    assert!(!err.to_string().contains("not-a-pair-secret"), "{err}");

    // Through the variable and the option; explicit keys win over the string.
    let e = [("AZURE_STORAGE_CONNECTION_STRING", cs.as_str())];
    let b = az(&[], &e).unwrap();
    assert_value!(b, HTTP, "true");
    let b = az(&[("account_name", "other")], &e).unwrap();
    assert_value!(b, AzureConfigKey::AccountName, "other");
    let b = az(&[("connection_string", &cs)], &[]).unwrap();
    assert_value!(
        b,
        AzureConfigKey::Endpoint,
        "http://127.0.0.1:10000/devstoreaccount1"
    );
}

#[test]
fn open_builds_gcs_and_azure_stores_for_local_servers() {
    let r = open_with_env(
        "gs://bucket/m/",
        &pairs(&[]),
        pairs(&[("STORAGE_EMULATOR_HOST", "127.0.0.1:1")]),
    )
    .unwrap();
    assert!(r.is_prefix);
    assert_eq!(r.path.as_ref(), "m");
    let r = open_with_env(
        "az://models/m/x.safetensors",
        &pairs(&[
            ("account_name", "acct"),
            ("access_key", AZURITE_KEY),
            ("endpoint", "http://127.0.0.1:1/acct"),
        ]),
        pairs(&[]),
    )
    .unwrap();
    assert_eq!(r.path.as_ref(), "m/x.safetensors");
    assert_eq!(r.uri, "az://models/m/x.safetensors");
}
