"""`fastload serve`: a serve subprocess on 127.0.0.1 (port 0) of a local folder, of an s3://
origin (SeaweedFS) and of an hf:// origin (the mock Hub), read over plain HTTP as a peer would:
the manifest and its origin identities, ranges bitwise equal to the files, 416 and 404, 409 for
another version, the token (401 without it), the bind rule, hostile paths, per-client metrics,
--hold, TLS, and SIGTERM/SIGINT."""

from __future__ import annotations

import datetime
import hashlib
import http.client
import ipaddress
import json
import os
import re
import select
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import wait_held
from servers import s3 as s3_server
from servers.hub import MockHub, lfs_sha256
from servers.s3 import BUCKET

aws_env = s3_server.aws_env
s3 = s3_server.s3_client

HERE = Path(__file__).resolve().parent
PYTHON = str(HERE.parent / "python")
TOKEN = "peer-secret-0123456789"


class Serve:
    """A `python -m fastload serve ...` subprocess and a client of it."""

    def __init__(self, args: list[str], tmp: Path, env: dict[str, str] | None = None):
        self.err_path = tmp / f"serve-{time.monotonic_ns()}.err"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastload", "serve", "--port", "0", *args],
            env={**os.environ, "PYTHONPATH": PYTHON, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=self.err_path.open("wb"),
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        m = re.fullmatch(r"serving on (https?)://127\.0\.0\.1:(\d+)\n", line)
        assert m, f"{line!r}: {self.stderr()}"
        self.scheme, self.port = m[1], int(m[2])
        self.context: ssl.SSLContext | None = None

    def stderr(self) -> str:
        return self.err_path.read_text(errors="replace")

    def request(self, path: str, headers: dict[str, str] | None = None, source: str = "127.0.0.1"):
        """`GET path` exactly as given (no normalisation): (status, headers, body); a serve that
        does not answer within a minute fails the test instead of hanging it."""
        address = {"source_address": (source, 0), "timeout": 60}
        if self.scheme == "https":
            conn = http.client.HTTPSConnection(
                "127.0.0.1", self.port, context=self.context, **address
            )
        else:
            conn = http.client.HTTPConnection("127.0.0.1", self.port, **address)
        try:
            conn.request("GET", path, headers=headers or {})
            r = conn.getresponse()
            return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
        finally:
            conn.close()

    def manifest(self, **kw) -> dict:
        status, headers, body = self.request("/v1/manifest", **kw)
        assert status == 200 and headers["content-type"] == "application/json", body
        return json.loads(body)

    def stop(self, sig=signal.SIGTERM) -> str:
        self.proc.send_signal(sig)
        rc = self.proc.wait(timeout=30)
        self.proc.stdout.close()
        err = self.stderr()
        assert rc == 0, err
        assert "fastload serve: stopped" in err
        return err


@pytest.fixture
def serve(tmp_path):
    started: list[Serve] = []

    def start(*args: str, env: dict[str, str] | None = None) -> Serve:
        s = Serve(list(args), tmp_path, env)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait()


def run_serve(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """A serve expected to refuse to start."""
    return subprocess.run(
        [sys.executable, "-m", "fastload", "serve", "--port", "0", *args],
        env={**os.environ, "PYTHONPATH": PYTHON, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def folder(sharded_dir, tmp_path) -> Path:
    """A model folder: shards, index, and a config in a subfolder; a secret file beside it."""
    root = tmp_path / "model"
    shutil.copytree(sharded_dir, root)
    (root / "sub").mkdir()
    (root / "sub" / "config.json").write_bytes(b'{"model_type": "llama"}')
    (tmp_path / "secret.txt").write_text("not to be served")
    return root


def files_of(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def check_ranges(s: Serve, name: str, files: dict[str, bytes], headers=None) -> None:
    """Whole files, first/middle/last ranges, open and suffix ranges: bitwise the files."""
    for path, data in files.items():
        url = f"/v1/files/{name}/{path}"
        status, h, body = s.request(url, headers)
        assert (status, body) == (200, data), path
        assert int(h["content-length"]) == len(data)
        n = len(data)
        ranges = [(0, 0), (0, 9), (n // 3, 2 * n // 3), (n - 5, n - 1), (n - 1, n + 100)]
        for a, b in [(a, b) for a, b in ranges if 0 <= a <= b]:
            status, h, body = s.request(url, {**(headers or {}), "Range": f"bytes={a}-{b}"})
            end = min(b, n - 1)
            assert (status, body) == (206, data[a : end + 1]), (path, a, b)
            assert h["content-range"] == f"bytes {a}-{end}/{n}"
        status, _, body = s.request(url, {**(headers or {}), "Range": "bytes=-7"})
        assert (status, body) == (206, data[-7:] if n >= 7 else data)
        status, _, body = s.request(url, {**(headers or {}), "Range": f"bytes={n // 2}-"})
        assert (status, body) == (206, data[n // 2 :])


def test_a_local_folder_is_served_with_its_manifest_ranges_416_404_and_409(serve, folder):
    files = files_of(folder)
    s = serve(str(folder))
    manifest = s.manifest()
    assert manifest["protocol"] == 1 and manifest["tiers"] == ["http"]
    (ckpt,) = manifest["checkpoints"]
    assert ckpt["name"] == "model"
    assert ckpt["origin"] == folder.as_uri() + "/"
    listed = {f["path"]: f for f in ckpt["files"]}
    assert set(listed) == set(files)
    for path, data in files.items():
        f = listed[path]
        sha = hashlib.sha256(data).hexdigest()
        assert f["size"] == len(data) and f["held"] is True
        assert f["identity"] == {"sha256": sha, "etag": None, "version": None, "commit": None}
        assert f["origin_uri"] == (folder / path).as_uri()
    check_ranges(s, "model", files)

    path, data = next((p, d) for p, d in files.items() if p.endswith(".safetensors"))
    url = f"/v1/files/model/{path}"
    sha = hashlib.sha256(data).hexdigest()
    status, h, _ = s.request(url, {"Range": "bytes=0-0"})
    assert h["x-fastload-identity"] == f"sha256:{sha}" and h["etag"] == f'"{sha}"'
    assert h["accept-ranges"] == "bytes"
    # The client's pinned identity: the same is served, another version is "not here".
    status, _, body = s.request(url, {"Range": "bytes=0-3", "X-Fastload-Identity": f"sha256:{sha}"})
    assert (status, body) == (206, data[:4])
    status, h, _ = s.request(url, {"X-Fastload-Identity": "sha256:" + "0" * 64})
    assert status == 409 and h["x-fastload-identity"] == f"sha256:{sha}"
    status, h, _ = s.request(url, {"Range": f"bytes={len(data)}-"})
    assert status == 416 and h["content-range"] == f"bytes */{len(data)}"
    for missing in ("/v1/files/model/nope.safetensors", "/v1/files/other/" + path, "/v1/nothing"):
        assert s.request(missing)[0] == 404, missing
    assert s.request("/healthz")[:3:2] == (200, b"ok")
    s.stop()


def test_request_paths_never_reach_the_file_system(serve, folder):
    s = serve(str(folder), "--name", "m")
    name = next(p for p in files_of(folder) if p.endswith(".safetensors"))
    assert s.request(f"/v1/files/m/{name}")[0] == 200
    hostile = [
        "/v1/files/m/../secret.txt",
        "/v1/files/m/%2e%2e/secret.txt",
        "/v1/files/m/%2E%2E%2Fsecret.txt",
        "/v1/files/m/..%2f..%2fsecret.txt",
        f"/v1/files/m/sub/../{name}",
        f"/v1/files/m/./{name}",
        f"/v1/files/m//{name}",
        f"/v1/files/m/{folder}/{name}",
        f"/v1/files/m/%2F{str(folder).lstrip('/')}/{name}",
        "/v1/files/m/%2Fetc%2Fpasswd",
        "/v1/files/m//etc/passwd",
        "/v1/files/%2e%2e/secret.txt",
        f"/v1/files/..%2fmodel/{name}",
        f"/v1/files/m%2F..%2Fm/{name}",
        "/v1/files/m/sub",
        "/v1/files/m/",
        "/../../etc/passwd",
    ]
    for path in hostile:
        status, _, body = s.request(path)
        assert status == 404 and b"not to be served" not in body, path
    s.stop()
    for bad in ("a/b", "../x", "x y"):
        refused = run_serve(str(folder), "--name", bad)
        assert refused.returncode == 1 and "--name" in refused.stderr, refused.stderr


def test_the_token_is_required_and_never_shown(serve, folder, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    name = next(p for p in files_of(folder) if p.endswith(".safetensors"))
    url = f"/v1/files/model/{name}"
    ok = {"Authorization": f"Bearer {TOKEN}"}
    for s in (
        serve(str(folder), "--token-file", str(token_file)),
        serve(str(folder), env={"FASTLOAD_PEER_TOKEN": TOKEN}),
    ):
        for path in ("/v1/manifest", url, "/metrics"):
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
                status, h, body = s.request(path, headers)
                assert status == 401 and h["www-authenticate"] == "Bearer", (path, headers)
                assert TOKEN.encode() not in body
            assert s.request(path, ok)[0] == 200, path
        assert s.request("/healthz")[0] == 200
        metrics = s.request("/metrics", ok)[2].decode()
        assert 'code="401"' in metrics and TOKEN not in metrics
        assert TOKEN not in s.stop()


def test_other_addresses_need_a_token_or_no_auth(folder, tmp_path):
    refused = run_serve(str(folder), "--bind", "0.0.0.0")
    assert refused.returncode == 1 and refused.stdout == ""
    assert "--no-auth" in refused.stderr and "FASTLOAD_PEER_TOKEN" in refused.stderr
    empty = tmp_path / "empty"
    empty.write_text("\n")
    refused = run_serve(str(folder), "--bind", "0.0.0.0", "--token-file", str(empty))
    assert refused.returncode == 1 and "holds no token" in refused.stderr


@pytest.mark.parametrize("how", ["--no-auth", "token"])
def test_a_non_loopback_bind_starts_with_a_token_or_no_auth(folder, tmp_path, how):
    args = ["--no-auth"] if how == "--no-auth" else []
    env = {"FASTLOAD_PEER_TOKEN": TOKEN} if how == "token" else {}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fastload",
            "serve",
            str(folder),
            "--bind",
            "0.0.0.0",
            "--port",
            "0",
            *args,
        ],
        env={**os.environ, "PYTHONPATH": PYTHON, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready and re.fullmatch(r"serving on http://0\.0\.0\.0:\d+\n", proc.stdout.readline())
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_metrics_count_bytes_and_answers_per_client(serve, folder):
    s = serve(str(folder))
    name = next(p for p in files_of(folder) if p.endswith(".safetensors"))
    url = f"/v1/files/model/{name}"
    sent = {"127.0.0.1": 0, "127.0.0.2": 0}
    for client, rng in [("127.0.0.1", "0-99"), ("127.0.0.2", "10-4105"), ("127.0.0.1", "7-7")]:
        status, _, body = s.request(url, {"Range": f"bytes={rng}"}, source=client)
        assert status == 206
        sent[client] += len(body)
    assert s.request("/v1/files/model/none", source="127.0.0.2")[0] == 404
    metrics = s.request("/metrics", source="127.0.0.3")[2].decode()
    for client, n in sent.items():
        assert f'fastload_serve_bytes_total{{client="{client}"}} {n}\n' in metrics
    assert 'fastload_serve_requests_total{client="127.0.0.1",code="206"} 2\n' in metrics
    assert 'fastload_serve_requests_total{client="127.0.0.2",code="206"} 1\n' in metrics
    assert 'fastload_serve_requests_total{client="127.0.0.2",code="404"} 1\n' in metrics
    files = files_of(folder)
    assert f"fastload_serve_files_held {len(files)}\n" in metrics
    assert f"fastload_serve_bytes_held {sum(map(len, files.values()))}\n" in metrics
    s.stop()


def test_clients_that_stop_reading_do_not_hold_up_the_others(serve, folder):
    """64 connections each ask for a whole 32 MiB file and never read a byte of it (their
    answers fill the socket buffers and wait); the serve still answers another client's
    manifest and ranges at once, bitwise, and goes on after they hang up."""
    import socket

    big = bytes(range(256)) * (128 << 10)
    (folder / "big.bin").write_bytes(big)
    s = serve(str(folder))
    stuck = []
    try:
        for _ in range(64):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            c.sendall(b"GET /v1/files/model/big.bin HTTP/1.1\r\nHost: peer\r\n\r\n")
            stuck.append(c)
        time.sleep(0.5)  # let their answers start and fill the buffers
        assert s.manifest()["checkpoints"][0]["name"] == "model"
        check_ranges(s, "model", {k: v for k, v in files_of(folder).items() if k != "big.bin"})
        status, _, body = s.request("/v1/files/model/big.bin", {"Range": "bytes=1000-1999"})
        assert (status, body) == (206, big[1000:2000])
    finally:
        for c in stuck:
            c.close()
    status, _, body = s.request("/v1/files/model/big.bin")
    assert (status, body) == (200, big)
    s.stop()


def test_hold_serves_the_files_as_they_were_after_they_changed_on_disk(serve, folder):
    files = files_of(folder)
    s = serve(str(folder), "--hold")
    assert "fastload serve: holding" in s.stderr()
    for path, data in files.items():
        # Rewritten in place (same inode, other bytes), and one cut short.
        with open(folder / path, "r+b") as f:
            f.write(bytes(255 - b for b in data))
    path = next(p for p in files if p.endswith(".safetensors"))
    os.truncate(folder / path, 10)
    assert all(f["held"] for f in s.manifest()["checkpoints"][0]["files"])
    check_ranges(s, "model", files)
    s.stop()


def self_signed(tmp_path: Path) -> tuple[Path, Path]:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    cert_path, key_path = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    return cert_path, key_path


def test_tls_serves_the_same_bytes_to_a_client_that_trusts_the_certificate(serve, folder, tmp_path):
    pytest.importorskip("cryptography")
    cert, key = self_signed(tmp_path)
    s = serve(str(folder), "--tls-cert", str(cert), "--tls-key", str(key))
    assert s.scheme == "https"
    s.context = ssl.create_default_context(cafile=str(cert))
    check_ranges(s, "model", files_of(folder))
    # A client that does not trust it, and one speaking plain HTTP, get nothing.
    s.context = ssl.create_default_context()
    with pytest.raises(ssl.SSLError):
        s.request("/v1/manifest")
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
    with pytest.raises((http.client.HTTPException, ConnectionError)):
        conn.request("GET", "/healthz")
        conn.getresponse()
    conn.close()
    s.stop()
    refused = run_serve(
        str(folder), "--tls-cert", str(cert), "--tls-key", str(tmp_path / "none.pem")
    )
    assert refused.returncode == 1 and "--tls-key" in refused.stderr


def test_sigint_stops_a_serve_cleanly(serve, folder):
    s = serve(str(folder))
    assert s.request("/healthz")[0] == 200
    s.stop(signal.SIGINT)


def test_an_s3_origin_is_served_with_its_etags_and_filled_into_the_cache(
    serve, s3, sharded_dir, tmp_path
):
    prefix = "serve/s3/model/"
    files = files_of(sharded_dir)
    files["sub/config.json"] = b'{"model_type": "llama"}'
    for key, data in files.items():
        s3.put_object(Bucket=BUCKET, Key=prefix + key, Body=data)
    cache = tmp_path / "cache"
    s = serve(f"s3://{BUCKET}/{prefix}", env={"FASTLOAD_CACHE": str(cache)})
    (ckpt,) = s.manifest()["checkpoints"]
    assert ckpt["name"] == "model" and ckpt["origin"] == f"s3://{BUCKET}/{prefix}"
    check_ranges(s, "model", files)
    listed = {f["path"]: f for f in wait_held(s.manifest)["checkpoints"][0]["files"]}
    assert set(listed) == set(files)
    for key, data in files.items():
        etag = s3.head_object(Bucket=BUCKET, Key=prefix + key)["ETag"]
        f = listed[key]
        assert f["size"] == len(data) and f["origin_uri"] == f"s3://{BUCKET}/{prefix}{key}"
        assert f["identity"] == {"sha256": None, "etag": etag, "version": None, "commit": None}
        h = s.request(f"/v1/files/model/{key}", {"Range": "bytes=0-0"})[1]
        assert h["x-fastload-identity"] == f"etag:{etag.strip(chr(34))};version:-;size:{len(data)}"
    # The copies are in the cache; served from them now, bitwise the same.
    cached = sorted(
        p.stat().st_size for p in cache.rglob("*") if p.is_file() and p.stat().st_size > 1000
    )
    assert sorted(len(d) for d in files.values() if len(d) > 1000) == cached
    check_ranges(s, "model", files)
    s.stop()


@pytest.fixture
def hub(sharded_dir):
    hub = MockHub()
    hub.tree = files_of(sharded_dir)
    hub.tree["config.json"] = b'{"model_type": "llama"}'
    hub.commit = hub.add("org/served", hub.tree)
    yield hub
    hub.close()


def test_an_hf_origin_is_served_with_its_commit_and_sha256s(serve, hub, tmp_path):
    env = {
        "HF_ENDPOINT": hub.base,
        "HF_HOME": str(tmp_path / "hf_home"),
        "FASTLOAD_CACHE": str(tmp_path / "cache"),
    }
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
        os.environ.pop(var, None)
    s = serve("hf://org/served", env=env)
    (ckpt,) = s.manifest()["checkpoints"]
    assert ckpt["name"] == "served" and ckpt["origin"] == f"hf://org/served@{hub.commit}"
    check_ranges(s, "served", hub.tree)
    listed = {f["path"]: f for f in wait_held(s.manifest)["checkpoints"][0]["files"]}
    assert set(listed) == set(hub.tree)
    for path, data in hub.tree.items():
        f = listed[path]
        assert f["identity"]["commit"] == hub.commit
        assert f["origin_uri"] == f"hf://org/served@{hub.commit}/{path}"
        if path.endswith(".safetensors"):
            sha = lfs_sha256(data)
            assert f["identity"]["sha256"] == sha
            h = s.request(f"/v1/files/served/{path}", {"Range": "bytes=0-0"})[1]
            assert h["x-fastload-identity"] == f"sha256:{sha}" and h["etag"] == f'"{sha}"'
    # Filled into the Hugging Face cache, and served from it bitwise.
    blobs = list((tmp_path / "hf_home").rglob("blobs/*"))
    assert len(blobs) == len(hub.tree)
    check_ranges(s, "served", hub.tree)
    s.stop()


def test_a_serve_reads_its_origin_from_another_serve_through_fastload_peers(
    serve, s3, sharded_dir, tmp_path
):
    prefix = "serve/chain/model/"
    files = files_of(sharded_dir)
    for key, data in files.items():
        s3.put_object(Bucket=BUCKET, Key=prefix + key, Body=data)
    uri = f"s3://{BUCKET}/{prefix}"
    first = serve(uri, env={"FASTLOAD_CACHE": str(tmp_path / "first")})
    wait_held(first.manifest)
    second = serve(
        uri,
        env={
            "FASTLOAD_CACHE": str(tmp_path / "second"),
            "FASTLOAD_PEERS": f"127.0.0.1:{first.port}",
        },
    )
    check_ranges(second, "model", files)
    wait_held(second.manifest)
    # The second serve's fill came from the first (no origin read needed for those bytes).
    metrics = first.request("/metrics")[2].decode()
    sent = re.search(r'fastload_serve_bytes_total\{client="127\.0\.0\.1"\} (\d+)', metrics)
    assert sent and int(sent[1]) >= sum(map(len, files.values())), metrics
    check_ranges(second, "model", files)
    second.stop()
    first.stop()
