use std::ops::Range;
use std::sync::Mutex;

use bytes::Bytes;
use futures_util::stream;

use super::*;
use crate::source::remote::Version;
use crate::source::testing;

/// A peer that sends `budget` bytes in all, then breaks the body it is sending and refuses
/// every later request (a serve killed mid-load).
struct Dying {
    data: Vec<u8>,
    budget: Mutex<usize>,
    asked: Mutex<Vec<Range<u64>>>,
}

impl Dying {
    fn new(data: &[u8], budget: usize) -> Dying {
        Dying {
            data: data.to_vec(),
            budget: Mutex::new(budget),
            asked: Mutex::new(Vec::new()),
        }
    }
}

impl RangedGet for Dying {
    fn get<'a>(&'a self, range: Range<u64>, _pin: &'a Version) -> BoxFuture<'a, Result<Answer>> {
        Box::pin(async move {
            self.asked.lock().unwrap().push(range.clone());
            let mut budget = self.budget.lock().unwrap();
            if *budget == 0 {
                return Err(io_error("peer", io::ErrorKind::ConnectionRefused, "down"));
            }
            let want = (range.end - range.start) as usize;
            let n = want.min(*budget);
            *budget -= n;
            let start = range.start as usize;
            let mut chunks = vec![Ok(Bytes::copy_from_slice(&self.data[start..start + n]))];
            if n < want {
                chunks.push(Err(io_error("peer", io::ErrorKind::ConnectionReset, "cut")));
            }
            Ok(Answer::Bytes(Response {
                range,
                size: None,
                version: Version::default(),
                body: stream::iter(chunks).boxed(),
            }))
        })
    }
}

/// An origin that records the ranges read from it.
#[derive(Debug)]
struct Origin {
    inner: testing::Bytes,
    reads: Mutex<Vec<(u64, usize)>>,
}

impl Source for Origin {
    fn name(&self) -> &str {
        self.inner.name()
    }
    fn size(&self) -> u64 {
        self.inner.size()
    }
    fn read_into<'a>(&'a self, offset: u64, dst: &'a mut [u8]) -> BoxFuture<'a, Result<()>> {
        self.reads.lock().unwrap().push((offset, dst.len()));
        self.inner.read_into(offset, dst)
    }
}

fn data() -> Vec<u8> {
    (0..10_000u32).map(|i| (i * 7 % 251) as u8).collect()
}

fn origin(data: &[u8]) -> Arc<Origin> {
    Arc::new(Origin {
        inner: testing::Bytes {
            name: "s3://b/m.safetensors".into(),
            data: data.to_vec(),
        },
        reads: Mutex::new(Vec::new()),
    })
}

fn set(peers: usize) -> Arc<PeerSet> {
    let settings = PeerSettings {
        peers: (0..peers)
            .map(|i| format!("http://127.0.0.1:{}", 9000 + i))
            .collect(),
        token: None,
    };
    Arc::new(PeerSet::new(settings, &RetrySettings::default()).unwrap())
}

fn read(source: &PeerSource, offset: u64, len: usize) -> Vec<u8> {
    let mut dst = vec![0u8; len];
    crate::runtime::block_on("test", source.read(offset, &mut dst)).unwrap();
    dst
}

#[test]
fn a_dying_peer_is_dropped_and_the_origin_reads_only_the_bytes_it_did_not_send() {
    let data = data();
    let origin = origin(&data);
    let set = set(1);
    let peer = Arc::new(Dying::new(&data, 3_000));
    let gets: Vec<(usize, Box<dyn RangedGet>)> = vec![(0, Box::new(ArcGet(peer.clone())))];
    let source = PeerSource::new(origin.clone(), set.clone(), gets);

    assert_eq!(read(&source, 1_000, 5_000), data[1_000..6_000]);
    // The peer sent 1000..4000, then its body broke and the resumption was refused: the
    // origin read 4000..6000 only.
    assert_eq!(*origin.reads.lock().unwrap(), [(4_000, 2_000)]);
    assert_eq!(
        peer.asked.lock().unwrap()[..2],
        [1_000..6_000, 4_000..6_000]
    );
    assert!(set.is_dropped(0));
    assert_eq!(set.from_peers.load(Ordering::Relaxed), 3_000);

    // Dropped for the rest of the load: the next read asks the origin alone.
    let asked = peer.asked.lock().unwrap().len();
    assert_eq!(read(&source, 0, 500), data[..500]);
    assert_eq!(peer.asked.lock().unwrap().len(), asked);
    assert_eq!(origin.reads.lock().unwrap()[1], (0, 500));
}

#[test]
fn the_next_peer_goes_on_at_the_byte_reached_and_the_origin_is_not_read() {
    let data = data();
    let origin = origin(&data);
    let set = set(2);
    let first = Arc::new(Dying::new(&data, 1_234));
    let second = Arc::new(Dying::new(&data, usize::MAX));
    let gets: Vec<(usize, Box<dyn RangedGet>)> = vec![
        (0, Box::new(ArcGet(first.clone()))),
        (1, Box::new(ArcGet(second.clone()))),
    ];
    let source = PeerSource::new(origin.clone(), set.clone(), gets);

    assert_eq!(read(&source, 0, 10_000), data);
    assert!(origin.reads.lock().unwrap().is_empty());
    assert_eq!(*second.asked.lock().unwrap(), vec![1_234..10_000_u64]);
    assert!(set.is_dropped(0) && !set.is_dropped(1));
}

/// A shared [`Dying`] as a boxed requester (the test keeps a handle to look at it).
struct ArcGet(Arc<Dying>);

impl RangedGet for ArcGet {
    fn get<'a>(&'a self, range: Range<u64>, pin: &'a Version) -> BoxFuture<'a, Result<Answer>> {
        self.0.get(range, pin)
    }
}

fn manifest(json: &str) -> Manifest {
    serde_json::from_str(json).unwrap()
}

#[test]
fn a_file_is_located_on_the_peers_that_list_its_origin_and_identity_in_order() {
    let same = r#"{"protocol": 1, "checkpoints": [{"name": "m", "origin": "s3://b/",
        "files": [{"path": "m.safetensors", "size": 10,
                   "identity": {"sha256": null, "etag": "\"e1\"", "version": null, "commit": null},
                   "origin_uri": "s3://b/m.safetensors", "held": true}]}], "tiers": ["http"]}"#;
    let other = same.replace("e1", "e2");
    let hub = r#"{"protocol": 1, "checkpoints": [{"name": "h", "origin": "hf://o/r@0123",
        "files": [{"path": "sub/m.safetensors", "size": 10,
                   "identity": {"sha256": "ABCD", "etag": null, "version": null, "commit": "0123"},
                   "origin_uri": null, "held": false}]}]}"#;
    let manifests = vec![
        (0, "http://a:1".to_string(), manifest(&other)),
        (1, "http://b:2".to_string(), manifest(same)),
        (2, "https://c:3".to_string(), manifest(same)),
        (3, "http://d:4".to_string(), manifest(hub)),
    ];
    let identity = canonical_identity(None, Some("\"e1\""), None, 10);
    let found = locate(&manifests, "s3://b/m.safetensors", &identity);
    assert_eq!(
        found,
        [
            Location {
                peer: 1,
                url: "http://b:2/v1/files/m/m.safetensors".into(),
                identity: identity.clone(),
            },
            Location {
                peer: 2,
                url: "https://c:3/v1/files/m/m.safetensors".into(),
                identity: identity.clone(),
            },
        ]
    );
    assert!(locate(&manifests, "s3://b/other.safetensors", &identity).is_empty());
    // Another size is another identity.
    let bigger = canonical_identity(None, Some("\"e1\""), None, 11);
    assert!(locate(&manifests, "s3://b/m.safetensors", &bigger).is_empty());
    // A Hub file: the repo, commit and path, and its sha256.
    let found = locate(&manifests, "hf://o/r@0123/sub/m.safetensors", "sha256:abcd");
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].url, "http://d:4/v1/files/h/sub/m.safetensors");
}

#[test]
fn a_version_id_the_client_did_not_pin_is_asked_for_as_the_peer_lists_it() {
    let entry = |etag: &str, version: &str| {
        format!(
            r#"{{"checkpoints": [{{"name": "m", "origin": "s3://b/", "files": [
            {{"path": "m.safetensors", "size": 10, "origin_uri": "s3://b/m.safetensors",
              "identity": {{"sha256": null, "etag": "{etag}", "version": {version}}}}}]}}]}}"#
        )
    };
    let at = |json: String| vec![(0, "http://a:1".to_string(), manifest(&json))];
    let uri = "s3://b/m.safetensors";
    let versioned = at(entry("\\\"e1\\\"", "\"v1\""));
    // A client that listed (no version id): the same ETag and size; asked for as the peer
    // lists it.
    let listed = canonical_identity(None, Some("\"e1\""), None, 10);
    let found = locate(&versioned, uri, &listed);
    assert_eq!(found.len(), 1);
    assert_eq!(found[0].identity, "etag:e1;version:v1;size:10");
    // A client that pinned the version by a HEAD: that version or none.
    assert_eq!(
        locate(&versioned, uri, "etag:e1;version:v1;size:10").len(),
        1
    );
    assert!(locate(&versioned, uri, "etag:e1;version:v2;size:10").is_empty());
    // Another ETag, or a weak one (it names no content), is never taken for it.
    assert!(locate(&versioned, uri, "etag:e2;version:-;size:10").is_empty());
    let weak = at(entry("W/\\\"e1\\\"", "\"v1\""));
    let weak_listed = canonical_identity(None, Some("W/\"e1\""), None, 10);
    assert!(locate(&weak, uri, &weak_listed).is_empty());
}

#[test]
fn peers_are_host_port_or_http_urls() {
    assert_eq!(base_url("127.0.0.1:8080").unwrap(), "http://127.0.0.1:8080");
    assert_eq!(base_url("https://h:443/").unwrap(), "https://h:443");
    for bad in [
        "ftp://h:1",
        "http://h:1/p",
        "not a peer",
        "http://u:p@h:1",
        "http://h:1?x",
    ] {
        assert!(base_url(bad).is_err(), "{bad}");
    }
    let s = PeerSettings::resolve(Some(vec![" a:1 ".into(), "".into()]), None).unwrap();
    assert_eq!(s.peers, ["http://a:1"]);
    let e = PeerSettings::resolve(Some(vec!["ftp://x".into()]), None).unwrap_err();
    assert!(e.to_string().contains("peers"), "{e}");
}
