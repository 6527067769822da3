use std::io;

use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path;
use object_store::ClientConfigKey;

use super::config::*;
use super::errors::*;
use super::s3::*;
use crate::error::{Error, Result};

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

const KEYS: &[(&str, &str)] = &[
    ("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE"),
    (
        "AWS_SECRET_ACCESS_KEY",
        "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
    ),
];

#[test]
fn endpoint_means_path_style_and_http_when_http() {
    let mut e = KEYS.to_vec();
    e.push(("AWS_ENDPOINT_URL", "http://127.0.0.1:9000"));
    let b = s3("s3://models/llama/", &[], &e).unwrap();
    assert_value!(b, AmazonS3ConfigKey::Endpoint, "http://127.0.0.1:9000");
    assert_value!(b, AmazonS3ConfigKey::VirtualHostedStyleRequest, "false");
    let http = AmazonS3ConfigKey::Client(ClientConfigKey::AllowHttp);
    assert_value!(b, http, "true");
    // An explicit allow_http=false wins over the inference.
    let b = s3("s3://models/x", &[("allow_http", "false")], &e).unwrap();
    assert_value!(b, http, "false");
    // Client defaults are in place and options override them.
    let timeout = AmazonS3ConfigKey::Client(ClientConfigKey::Timeout);
    assert_value!(b, timeout, "120s");
    let b = s3("s3://models/x", &[("timeout", "5s")], &e).unwrap();
    assert_value!(b, timeout, "5s");
    let (_, rest) = split_retry_options(&opts(&[("connect_timeout", "1.5")])).unwrap();
    assert_eq!(rest, opts(&[("connect_timeout", "1500ms")]));
    // https endpoints stay https-only.
    e.pop();
    e.push(("AWS_ENDPOINT_URL", "https://minio.example"));
    let b = s3("s3://models/x", &[], &e).unwrap();
    assert_ne!(b.get_config_value(&http).as_deref(), Some("true"));
}

#[test]
fn virtual_hosted_is_opt_in_with_an_endpoint() {
    let mut e = KEYS.to_vec();
    e.push(("AWS_ENDPOINT_URL", "http://s3.local:9000/"));
    let o = [("virtual_hosted_style_request", "true")];
    let b = s3("s3://models/x", &o, &e).unwrap();
    assert_value!(
        b,
        AmazonS3ConfigKey::Endpoint,
        "http://models.s3.local:9000/"
    );
    assert_value!(b, AmazonS3ConfigKey::VirtualHostedStyleRequest, "true");
    // An endpoint that already names the bucket is left alone.
    let e2 = [
        KEYS[0],
        KEYS[1],
        ("AWS_ENDPOINT_URL", "http://models.s3.local"),
    ];
    let b = s3("s3://models/x", &o, &e2).unwrap();
    assert_value!(b, AmazonS3ConfigKey::Endpoint, "http://models.s3.local");
}

#[test]
fn aws_without_endpoint_is_virtual_hosted_unless_the_bucket_has_dots() {
    let b = s3("s3://models/x", &[], KEYS).unwrap();
    assert_value!(b, AmazonS3ConfigKey::VirtualHostedStyleRequest, "true");
    let b = s3("s3://my.models/x", &[], KEYS).unwrap();
    assert_value!(b, AmazonS3ConfigKey::VirtualHostedStyleRequest, "false");
    let b = s3(
        "s3://models/x",
        &[("virtual_hosted_style_request", "false")],
        KEYS,
    )
    .unwrap();
    assert_value!(b, AmazonS3ConfigKey::VirtualHostedStyleRequest, "false");
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
    assert_value!(b, AmazonS3ConfigKey::Region, "us-west-2");
    assert_value!(b, AmazonS3ConfigKey::Token, "session-token-value");
    let b = s3(
        "s3://b/x",
        &[],
        &[KEYS[0], KEYS[1], ("AWS_DEFAULT_REGION", "eu-west-1")],
    )
    .unwrap();
    assert_value!(b, AmazonS3ConfigKey::Region, "eu-west-1");
    let b = s3(
        "s3://b/x",
        &[("region", "ap-south-1"), ("access_key_id", "OTHER")],
        &e,
    )
    .unwrap();
    assert_value!(b, AmazonS3ConfigKey::Region, "ap-south-1");
    assert_value!(b, AmazonS3ConfigKey::AccessKeyId, "OTHER");
}

#[test]
fn disabled_metadata_without_credentials_fails_before_any_request() {
    let err = s3("s3://b/x", &[], &[("AWS_EC2_METADATA_DISABLED", "true")]).unwrap_err();
    assert!(
        matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::PermissionDenied),
        "{err}"
    );
    // The point is the advice: the message names what to set.
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
    assert!(
        matches!(err, Error::InvalidOption { ref option, .. } if option == "storage_options[\"endpiont\"]"),
        "{err}"
    );
    let err = open_with_env("s3://b/x", &opts(&[("max_retries", "many")]), env(KEYS)).unwrap_err();
    assert!(
        matches!(err, Error::InvalidOption { ref option, .. } if option == "storage_options[\"max_retries\"]"),
        "{err}"
    );
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
    assert!(
        matches!(err, Error::Io { ref path, ref source }
            if path == "az://container/x" && source.kind() == io::ErrorKind::InvalidInput),
        "{err}"
    );
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

// ---- classification of object_store errors by type -----------------------------------

fn kind_of(e: object_store::Error) -> Result<io::ErrorKind, Error> {
    match storage_error("s3://b/k", e) {
        Error::Io { path, source } => {
            assert_eq!(path, "s3://b/k");
            Ok(source.kind())
        }
        other => Err(other),
    }
}

fn generic(source: impl std::error::Error + Send + Sync + 'static) -> object_store::Error {
    object_store::Error::Generic {
        store: "S3",
        source: Box::new(source),
    }
}

fn not_found(body: &str) -> object_store::Error {
    object_store::Error::NotFound {
        path: "k".into(),
        source: format!("Server returned non-2xx status code: 404 Not Found: {body}").into(),
    }
}

#[test]
fn transport_failures_are_classified_by_their_types() {
    use object_store::client::{HttpError, HttpErrorKind};
    let http = |kind, inner: io::Error| generic(HttpError::new(kind, inner));
    let timeout = http(HttpErrorKind::Timeout, io::Error::other("deadline"));
    assert_eq!(kind_of(timeout).unwrap(), io::ErrorKind::TimedOut);
    // The socket's own kind is more precise than "could not connect".
    let refused = http(
        HttpErrorKind::Connect,
        io::Error::from(io::ErrorKind::ConnectionRefused),
    );
    assert_eq!(kind_of(refused).unwrap(), io::ErrorKind::ConnectionRefused);
    let dns = http(HttpErrorKind::Connect, io::Error::other("no such host"));
    assert_eq!(kind_of(dns).unwrap(), io::ErrorKind::NotConnected);
    let reset = generic(io::Error::from(io::ErrorKind::ConnectionReset));
    assert_eq!(kind_of(reset).unwrap(), io::ErrorKind::ConnectionReset);
    // Words in a message decide nothing.
    let words = generic(io::Error::other("operation timed out (Timeout)"));
    assert_eq!(kind_of(words).unwrap(), io::ErrorKind::Other);
    let denied = object_store::Error::PermissionDenied {
        path: "k".into(),
        source: "403".into(),
    };
    assert_eq!(kind_of(denied).unwrap(), io::ErrorKind::PermissionDenied);
    let unauthenticated = object_store::Error::Unauthenticated {
        path: "k".into(),
        source: "401".into(),
    };
    assert_eq!(
        kind_of(unauthenticated).unwrap(),
        io::ErrorKind::PermissionDenied
    );
}

#[test]
fn a_listings_refusal_is_access_denied_by_its_status() {
    /// object_store's list error: its own words, the retry error (status and body) as source.
    #[derive(Debug)]
    struct Listing(io::Error);
    impl std::fmt::Display for Listing {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "Error performing list request: {}", self.0)
        }
    }
    impl std::error::Error for Listing {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }
    let status = |line: &str| generic(Listing(io::Error::other(line.to_string())));
    let refused = "Server returned non-2xx status code: 403 Forbidden: SignatureDoesNotMatch";
    assert_eq!(
        kind_of(status(refused)).unwrap(),
        io::ErrorKind::PermissionDenied
    );
    let unsigned = "Server returned non-2xx status code: 401 Unauthorized: ";
    assert_eq!(
        kind_of(status(unsigned)).unwrap(),
        io::ErrorKind::PermissionDenied
    );
    let busy = "Server returned non-2xx status code: 503 Service Unavailable: SlowDown";
    assert_eq!(kind_of(status(busy)).unwrap(), io::ErrorKind::Other);
    // A message that only quotes a status decides nothing.
    let quoted = generic(io::Error::other(format!("proxy said: {refused}")));
    assert_eq!(kind_of(quoted).unwrap(), io::ErrorKind::Other);
    let text = storage_error("s3://b/k", status(refused)).to_string();
    assert!(text.contains("access denied"), "{text}");
}

#[test]
fn a_404_is_a_missing_bucket_only_by_the_service_error_code() {
    let xml = |code: &str| {
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?><Error><Code>{code}</Code>\
             <Message>The specified resource does not exist.</Message></Error>"
        )
    };
    for code in ["NoSuchBucket", "ContainerNotFound"] {
        let err = storage_error("s3://b/k", not_found(&xml(code)));
        assert!(
            matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::NotFound),
            "{code}: {err}"
        );
        assert!(err.to_string().contains(code), "{err}");
    }
    // A missing key, or a key that merely has the code in its name, is a missing object.
    let key_named_like_a_code =
        not_found(&format!("NoSuchBucket.safetensors: {}", xml("NoSuchKey")));
    for e in [
        not_found(&xml("NoSuchKey")),
        key_named_like_a_code,
        not_found(""),
    ] {
        assert!(
            matches!(storage_error("s3://b/k", e), Error::NotFound { ref path } if path == "s3://b/k")
        );
    }
}

#[test]
fn client_defaults_keep_the_idle_connections_the_shared_clients_say() {
    use super::clients::{IDLE_PER_HOST, IDLE_TIMEOUT};
    let value = |key| {
        let found = super::keys::CLIENT_DEFAULTS.iter().find(|(k, _)| *k == key);
        found.map(|(_, v)| v.to_string())
    };
    let idle = value(ClientConfigKey::PoolMaxIdlePerHost);
    assert_eq!(idle, Some(IDLE_PER_HOST.to_string()));
    let timeout = value(ClientConfigKey::PoolIdleTimeout).unwrap();
    assert_eq!(humantime::parse_duration(&timeout).unwrap(), IDLE_TIMEOUT);
}
