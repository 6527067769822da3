use std::fmt;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures_util::stream::BoxStream;
use object_store::memory::InMemory;
use object_store::{
    CopyOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    PutMultipartOptions, PutOptions, PutPayload, PutResult,
};

use futures_util::StreamExt;
use object_store::path::Path;
use object_store::{GetOptions, ObjectStore, ObjectStoreExt};

use super::*;
use crate::error::{Error, Result};
use crate::store::{Remote, RetrySettings};

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

/// Cuts the first `cuts` bodies after `keep` bytes (then errors), or pads every body; with
/// `meet`, a GET and a listing each wait at that barrier until the other arrives (a caller that
/// asks them one after the other never gets an answer).
#[derive(Debug)]
struct Flaky {
    inner: InMemory,
    keep: usize,
    cuts: AtomicUsize,
    pad: bool,
    gets: AtomicUsize,
    meet: Option<tokio::sync::Barrier>,
}

impl Flaky {
    fn new(inner: InMemory, keep: usize, cuts: usize, pad: bool) -> Self {
        Flaky {
            inner,
            keep,
            cuts: AtomicUsize::new(cuts),
            pad,
            gets: AtomicUsize::new(0),
            meet: None,
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
        if let Some(meet) = &self.meet {
            meet.wait().await;
        }
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
        if let Some(meet) = &self.meet {
            meet.wait().await;
        }
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

#[tokio::test]
async fn a_prefix_asks_for_its_index_and_its_listing_at_once() {
    // Each request waits for the other: resolved only if both are in flight together (one
    // round trip to the store), with an index and without.
    for with_index in [false, true] {
        let inner = InMemory::new();
        let mut files = vec![
            ("m/s-1.safetensors", data(11)),
            ("m/s-2.safetensors", data(22)),
        ];
        if with_index {
            files.push((
                "m/model.safetensors.index.json",
                index(&[("w", "s-2.safetensors")]),
            ));
        }
        for (name, bytes) in files {
            inner
                .put(&Path::from(name), PutPayload::from(bytes))
                .await
                .unwrap();
        }
        let mut store = Flaky::new(inner, 0, 0, false);
        store.meet = Some(tokio::sync::Barrier::new(2));
        let r = remote(Arc::new(store), "m", true);
        let found = tokio::time::timeout(Duration::from_secs(10), list_safetensors(&r))
            .await
            .expect("the index probe waited for the listing, or the listing for the probe")
            .unwrap();
        let want: &[(&str, u64)] = match with_index {
            true => &[("m/s-2.safetensors", 22)],
            false => &[("m/s-1.safetensors", 11), ("m/s-2.safetensors", 22)],
        };
        let want: Vec<(Path, u64)> = want.iter().map(|(p, n)| (Path::from(*p), *n)).collect();
        assert_eq!(sized(found), want, "index {with_index}");
    }
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

/// Paths and sizes of what a listing found.
fn sized(found: Vec<Found>) -> Vec<(Path, u64)> {
    found.into_iter().map(|f| (f.path, f.size)).collect()
}
