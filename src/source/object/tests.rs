use std::fmt;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use futures_util::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::{
    CopyOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use futures_util::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::path::Path;
use object_store::{ClientConfigKey, GetOptions, ObjectStore, ObjectStoreExt};

use super::config::*;
use super::errors::*;
use super::s3::*;
use super::*;
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
        retry: RetrySettings::default(),
        multipart: None,
    }
}

/// Reads `dst.len()` bytes at `offset` of the object `key`, named `s3://b/{key}` in errors, with
/// the default retries.
async fn read_at(store: &dyn ObjectStore, key: &str, offset: u64, dst: &mut [u8]) -> Result<()> {
    let uri = format!("s3://b/{key}");
    read_range_into(
        store,
        &Path::from(key),
        offset,
        dst,
        &uri,
        &RetrySettings::default(),
    )
    .await
}

#[tokio::test]
async fn reads_ranges_exactly() {
    let bytes = data(100_000);
    let store = memory(&[("m.safetensors", bytes.clone())]).await;
    let key = "m.safetensors";
    let mut dst = vec![0u8; 30_000];
    read_at(store.as_ref(), key, 12_345, &mut dst)
        .await
        .unwrap();
    assert_eq!(dst, bytes[12_345..42_345]);
    read_at(store.as_ref(), key, 0, &mut []).await.unwrap();
    // Past the end: the object is shorter than the range.
    let err = read_at(store.as_ref(), key, 90_000, &mut dst)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Io { ref path, ref source }
            if path == "s3://b/m.safetensors" && source.kind() == io::ErrorKind::UnexpectedEof),
        "{err}"
    );
    let err = read_at(store.as_ref(), "nope", 0, &mut dst)
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
                    source: Box::new(io::Error::from(io::ErrorKind::ConnectionReset)),
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

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        self.inner.list(prefix)
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
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
    read_at(&store, "m", 5_000, &mut dst).await.unwrap();
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
    let err = read_at(&store, "m", 0, &mut dst).await.unwrap_err();
    // The error is the one that cut the last body off, classified by its type.
    assert!(
        matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::ConnectionReset),
        "{err}"
    );
    assert_eq!(
        store.gets.load(Ordering::SeqCst),
        RetrySettings::default().max_stalled_resumes as usize
    );
    assert!(started.elapsed() < Duration::from_secs(5));
}

#[tokio::test]
async fn rejects_bodies_longer_than_asked() {
    let store = flaky(&data(1000), 0, 0, true).await;
    let mut dst = vec![0u8; 100];
    let err = read_at(&store, "m", 0, &mut dst).await.unwrap_err();
    assert!(
        matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::InvalidData),
        "{err}"
    );
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
    let got = sized(list_safetensors(&r).await.unwrap());
    assert_eq!(
        got,
        vec![
            (Path::from("m/a.safetensors"), 20),
            (Path::from("m/b.safetensors"), 10)
        ]
    );
    // Without the trailing slash, a name that is no object is tried as a prefix.
    assert_eq!(
        sized(resolve(&remote(store.clone(), "m", false)).await.unwrap()),
        got
    );
    let one = sized(
        resolve(&remote(store.clone(), "m/b.safetensors", false))
            .await
            .unwrap(),
    );
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
        sized(
            list_safetensors(&remote(store.clone(), "m", true))
                .await
                .unwrap()
        ),
        want
    );
    let direct = remote(store.clone(), "m/model.safetensors.index.json", false);
    let found = resolve(&direct).await.unwrap();
    assert!(
        found.iter().all(|f| f.etag.is_some()),
        "the cache needs ETags"
    );
    assert_eq!(sized(found), want);

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

/// The header of an object, read as the loader reads it: through its source.
async fn header_of(r: &Remote, path: &Path, size: u64) -> Result<crate::format::Header, Error> {
    let source = crate::source::object::RemoteObject::new(
        r.uri_of(path),
        r.store.clone(),
        path.clone(),
        size,
        r.retry.clone(),
    );
    crate::source::open_shard(std::sync::Arc::new(source))
        .await
        .map(|shard| shard.header)
}

#[tokio::test(flavor = "multi_thread")]
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
        let h = header_of(&r, &r.path, file.len() as u64).await.unwrap();
        assert_eq!(h.tensors.len(), 1);
    }
    let store = memory(&[(
        "bad.safetensors",
        b"\xff\xff\xff\xff\xff\xff\xff\x7f{}".to_vec(),
    )])
    .await;
    let r = remote(store, "bad.safetensors", false);
    let err = header_of(&r, &r.path, 10).await.unwrap_err();
    assert!(matches!(err, Error::Format { .. }), "{err}");
    let err = header_of(&r, &r.path, 0).await.unwrap_err();
    assert!(matches!(err, Error::Format { .. }), "{err}");
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

/// Paths and sizes of what a listing found.
fn sized(found: Vec<Found>) -> Vec<(Path, u64)> {
    found.into_iter().map(|f| (f.path, f.size)).collect()
}

#[test]
fn client_defaults_keep_the_idle_connections_the_shared_clients_say() {
    use crate::source::clients::{IDLE_PER_HOST, IDLE_TIMEOUT};
    let value = |key| {
        let found = super::keys::CLIENT_DEFAULTS.iter().find(|(k, _)| *k == key);
        found.map(|(_, v)| v.to_string())
    };
    let idle = value(ClientConfigKey::PoolMaxIdlePerHost);
    assert_eq!(idle, Some(IDLE_PER_HOST.to_string()));
    let timeout = value(ClientConfigKey::PoolIdleTimeout).unwrap();
    assert_eq!(humantime::parse_duration(&timeout).unwrap(), IDLE_TIMEOUT);
}
