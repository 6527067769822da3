"""Loading over plain http(s):// with range requests: a small threaded server on 127.0.0.1 that
honours Range (206 Partial Content, Content-Range, HEAD with Content-Length, 416 for ranges past
the end), bitwise parity with `safetensors.torch.load_file`, and clean, bounded failures.

The server is `http.server` based and serves files from memory. Variants: one that ignores Range
(200 with the whole body, as some static servers and CDNs do), one that answers the first requests
with 503, one that forbids everything, and an https one with a certificate from a throwaway CA.
"""

from __future__ import annotations

import datetime
import email.utils
import hashlib
import ipaddress
import json
import re
import ssl
import threading
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import fastload
import helpers
import pytest
import torch
from helpers import assert_same_tensors, indexed_files, pattern, reference
from safetensors.torch import save_file

# A failure must surface well inside this (retries and timeouts are bounded).
ERROR_DEADLINE = 30.0
# Fast, bounded retries for the error-path tests (the defaults allow up to a minute of retries).
QUICK_RETRIES = {"max_retries": "2", "retry_timeout": "10", "connect_timeout": "2"}

_RANGE = re.compile(r"^bytes=(\d*)-(\d*)$")


def parse_range(header: str, size: int) -> tuple[int, int] | str | None:
    """(start, end) for a satisfiable single range, "unsatisfiable" for one past the end, or None
    when the header is malformed or asks for several ranges (then the whole object is served, as
    RFC 9110 allows)."""
    m = _RANGE.match(header.strip())
    if not m or (not m.group(1) and not m.group(2)):
        return None
    first, last = m.group(1), m.group(2)
    if not first:  # suffix range: the last N bytes
        n = int(last)
        return "unsatisfiable" if n == 0 or size == 0 else (max(0, size - n), size)
    start = int(first)
    end = size if not last else int(last) + 1
    if last and end <= start:
        return None
    if start >= size:
        return "unsatisfiable"
    return start, min(end, size)


@dataclass
class Behaviour:
    """What the server does besides serving files correctly."""

    ignore_range: bool = False  # always 200 with the whole body
    fail_first: int = 0  # the first N GET/HEAD requests get `fail_status`
    fail_status: int = 503
    forbid: bool = False  # every request gets 403
    propfind: int = 501  # WebDAV listing: 501 as http.server answers, 405 as nginx does
    failed: int = 0
    log: list = field(default_factory=list)  # (method, path, Range header, status)
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as a real server: clients pool connections
    server_version = "fastload-test-range/1"

    def log_message(self, format, *args):
        pass

    def do_HEAD(self):
        self._serve(send_body=False)

    def do_GET(self):
        self._serve(send_body=True)

    def do_PROPFIND(self):
        status = self.server.behaviour.propfind
        self.server.behaviour.log.append((self.command, self.path, None, status))
        self._reply(status, b"no listing here\n", True)

    def _reply(self, status: int, body: bytes, send_body: bool, headers=()) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Content-Type", "text/plain")
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def _serve(self, send_body: bool) -> None:
        b: Behaviour = self.server.behaviour
        files: dict[str, bytes] = self.server.files
        path = urllib.parse.unquote(urllib.parse.urlsplit(self.path).path)
        rng = self.headers.get("Range")
        with b.lock:
            failing = b.failed < b.fail_first
            if failing:
                b.failed += 1
        if b.forbid:
            status = 403
        elif failing:
            status = b.fail_status
        elif path not in files:
            status = 404
        else:
            status = 200
        if status != 200:
            b.log.append((self.command, path, rng, status))
            self._reply(status, f"{status} for {path}\n".encode(), send_body)
            return
        data = files[path]
        size = len(data)
        start, end = 0, size
        got = None if (rng is None or b.ignore_range) else parse_range(rng, size)
        if got == "unsatisfiable":
            b.log.append((self.command, path, rng, 416))
            self._reply(
                416, b"range not satisfiable\n", send_body, [("Content-Range", f"bytes */{size}")]
            )
            return
        if got is not None:
            status, (start, end) = 206, got
        b.log.append((self.command, path, rng, status))
        self.send_response(status)
        self.send_header("Content-Length", str(end - start))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", self.server.etags[path])
        self.send_header("Last-Modified", self.server.modified)
        if not b.ignore_range:
            self.send_header("Accept-Ranges", "bytes")
        if status == 206:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{size}")
        self.end_headers()
        if send_body:
            view = memoryview(data)
            for at in range(start, end, 1 << 20):
                self.wfile.write(view[at : min(end, at + (1 << 20))])


class RangeServer(ThreadingHTTPServer):
    """Serves `files` ({"/url/path": bytes}) on 127.0.0.1 from a daemon thread."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, files: dict[str, bytes], behaviour: Behaviour | None = None, tls=None):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.files = files
        self.etags = {p: f'"{hashlib.md5(d).hexdigest()}"' for p, d in files.items()}
        self.modified = email.utils.formatdate(usegmt=True)
        self.behaviour = behaviour or Behaviour()
        self.scheme = "http"
        if tls is not None:
            self.socket = tls.wrap_socket(self.socket, server_side=True)
            self.scheme = "https"
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True
        )
        self._thread.start()

    def url(self, path: str) -> str:
        return f"{self.scheme}://127.0.0.1:{self.server_address[1]}/{path.lstrip('/')}"

    def close(self) -> None:
        self.shutdown()
        self.server_close()
        self._thread.join(timeout=5)


def start_server(files, behaviour=None, tls=None):
    server = RangeServer(files, behaviour, tls)
    return server


# ---------------------------------------------------------------------------------------------
# Files


def write_multi_block(path: Path) -> Path:
    """About 3 MiB in several dtypes, so that 64 KiB blocks split tensors many times over."""
    tensors = {
        "embed.weight": pattern((512, 640), torch.float32, seed=1),
        "layer.0.q": pattern((640, 640), torch.bfloat16, seed=2),
        "layer.0.k": pattern((333, 641), torch.float16, seed=3),
        "layer.0.norm": pattern((641,), torch.float32, seed=4),
        "layer.0.ids": pattern((70_001,), torch.int64, seed=5),
        "layer.0.mask": pattern((99_999,), torch.bool, seed=6),
        "scalar": pattern((), torch.float64, seed=7),
        "empty": pattern((0, 4), torch.float32, seed=8),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def served(tmp_path_factory, dtypes_file, tiny_file, sharded_dir):
    """{"/url/path": bytes} of every file the servers offer, and the local files behind them."""
    big = write_multi_block(tmp_path_factory.mktemp("http") / "big.safetensors")
    files = {
        "/model.safetensors": dtypes_file.read_bytes(),
        "/big.safetensors": big.read_bytes(),
        "/tiny.safetensors": tiny_file.read_bytes(),
        "/truncated.safetensors": big.read_bytes()[:-1000],
    }
    for p in sorted(sharded_dir.iterdir()):
        files[f"/sharded/{p.name}"] = p.read_bytes()
    return files, {"model": dtypes_file, "big": big, "tiny": tiny_file, "sharded": sharded_dir}


@pytest.fixture(scope="module")
def http_server(served):
    server = start_server(served[0])
    yield server
    server.close()


@pytest.fixture
def make_server(served):
    """Starts servers with a given behaviour; closes them after the test."""
    started = []

    def make(**kw) -> RangeServer:
        server = start_server(served[0], Behaviour(**kw))
        started.append(server)
        return server

    yield make
    for s in started:
        s.close()


def timed_error(exc_type, fn, deadline: float = ERROR_DEADLINE):
    return helpers.timed_error(exc_type, fn, deadline)


# ---------------------------------------------------------------------------------------------
# The server itself (so that a fastload failure can't be blamed on it)


def _fetch(url: str, method: str = "GET", range_: str | None = None):
    req = urllib.request.Request(url, method=method)
    if range_:
        req.add_header("Range", range_)
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_server_honours_ranges(http_server, served):
    data = served[0]["/big.safetensors"]
    url = http_server.url("big.safetensors")
    status, headers, body = _fetch(url, "HEAD")
    assert status == 200 and int(headers["Content-Length"]) == len(data) and body == b""
    status, headers, body = _fetch(url, range_="bytes=10-19")
    assert status == 206 and body == data[10:20]
    assert headers["Content-Range"] == f"bytes 10-19/{len(data)}"
    assert _fetch(url, range_="bytes=-5")[2] == data[-5:]
    assert _fetch(url, range_=f"bytes={len(data) - 3}-")[2] == data[-3:]
    status, headers, _ = _fetch(url, range_=f"bytes={len(data)}-")
    assert status == 416 and headers["Content-Range"] == f"bytes */{len(data)}"
    status, _, body = _fetch(url)
    assert status == 200 and body == data
    assert _fetch(http_server.url("nope"))[0] == 404


# ---------------------------------------------------------------------------------------------
# Parity


def test_all_dtypes_parity(http_server, served):
    got = fastload.load(http_server.url("model.safetensors"))
    assert_same_tensors(got, reference(served[1]["model"]))


def test_multi_block_file_with_small_blocks(http_server, served):
    url = http_server.url("big.safetensors")
    log = http_server.behaviour.log
    before = len(log)
    got = fastload.load(url, block_size="64KiB", concurrency=8)
    assert_same_tensors(got, reference(served[1]["big"]))
    gets = [e for e in log[before:] if e[0] == "GET" and e[1] == "/big.safetensors"]
    # Every data read was a ranged GET answered with 206, and there were many of them.
    size = len(served[0]["/big.safetensors"])
    assert len(gets) >= size // (64 << 10), len(gets)
    assert all(rng and status == 206 for _, _, rng, status in gets), gets[:5]


def test_multi_block_file_streamed(http_server, served):
    want = reference(served[1]["big"])
    got = {}
    for name, tensor in fastload.stream(
        http_server.url("big.safetensors"), block_size="64KiB", memory_limit="1MiB"
    ):
        assert name not in got
        got[name] = tensor
    assert_same_tensors(got, want)


def test_many_tiny_tensors(http_server, served):
    got = fastload.load(http_server.url("tiny.safetensors"))
    assert_same_tensors(got, reference(served[1]["tiny"]))


def test_names_reads_only_those_tensors(http_server, served):
    want = reference(served[1]["big"])
    names = ["layer.0.norm", "scalar"]
    log = http_server.behaviour.log
    before = len(log)
    got = fastload.load(http_server.url("big.safetensors"), names=names, block_size="64KiB")
    assert_same_tensors(got, {n: want[n] for n in names})
    # The header, then a few KiB of data: nothing near the file's 3 MiB.
    ranges = [e[2] for e in log[before:] if e[0] == "GET"]
    fetched = 0
    for r in ranges:
        a, b = _RANGE.match(r).groups()
        fetched += int(b) + 1 - int(a)
    assert fetched < 512 << 10, (fetched, ranges)


def test_index_file_over_http(http_server, served):
    sharded = served[1]["sharded"]
    got = fastload.load(http_server.url("sharded/model.safetensors.index.json"))
    assert_same_tensors(got, reference(*indexed_files(sharded)))


# ---------------------------------------------------------------------------------------------
# Errors and odd servers


@pytest.mark.parametrize("propfind", [501, 405])
def test_missing_file_is_file_not_found(make_server, propfind):
    server = make_server(propfind=propfind)
    url = server.url("no-such-model.safetensors")
    err = timed_error(
        FileNotFoundError, lambda: fastload.load(url, storage_options=QUICK_RETRIES), 10
    )
    assert isinstance(err, fastload.FastloadError)
    assert url in str(err)


def test_missing_shard_named_by_an_index(tmp_path, served):
    files = dict(served[0])
    index = json.loads(files["/sharded/model.safetensors.index.json"])
    index["weight_map"]["extra.weight"] = "model-gone.safetensors"
    files["/broken/model.safetensors.index.json"] = json.dumps(index).encode()
    for k, v in served[0].items():
        if k.startswith("/sharded/") and k.endswith(".safetensors"):
            files["/broken/" + k.rsplit("/", 1)[1]] = v
    server = start_server(files)
    try:
        url = server.url("broken/model.safetensors.index.json")
        err = timed_error(
            FileNotFoundError, lambda: fastload.load(url, storage_options=QUICK_RETRIES), 10
        )
        assert "model-gone.safetensors" in str(err)
    finally:
        server.close()


def test_file_shorter_than_its_header_says_is_a_format_error(http_server):
    url = http_server.url("truncated.safetensors")
    err = timed_error(fastload.FormatError, lambda: fastload.load(url))
    assert url in str(err)


def test_server_that_ignores_range_is_a_clear_storage_error(make_server):
    server = make_server(ignore_range=True)
    url = server.url("big.safetensors")
    err = timed_error(
        fastload.StorageError,
        lambda: fastload.load(url, block_size="64KiB", storage_options=QUICK_RETRIES),
        10,
    )
    assert isinstance(err, OSError)
    assert url in str(err)
    assert "range" in str(err).lower(), str(err)


def test_transient_503s_are_retried(make_server, served):
    server = make_server(fail_first=4, fail_status=503)
    got = fastload.load(server.url("big.safetensors"), block_size="256KiB")
    assert_same_tensors(got, reference(served[1]["big"]))
    assert server.behaviour.failed == 4


def test_forbidden_is_a_storage_error_fast(make_server):
    server = make_server(forbid=True)
    url = server.url("big.safetensors")
    # 403 is permanent: no retries, so this fails well inside the retry budget.
    err = timed_error(fastload.StorageError, lambda: fastload.load(url), 5)
    assert not isinstance(err, FileNotFoundError)
    assert url in str(err)
    requests = len(server.behaviour.log)
    assert requests <= 2, server.behaviour.log


def test_refused_connection_is_a_storage_error():
    with ThreadingHTTPServer(("127.0.0.1", 0), _Handler) as s:
        port = s.server_address[1]  # closed again when the block ends: nothing listens
    url = f"http://127.0.0.1:{port}/model.safetensors"
    err = timed_error(
        fastload.StorageError, lambda: fastload.load(url, storage_options=QUICK_RETRIES)
    )
    assert url in str(err)


# ---------------------------------------------------------------------------------------------
# https with a certificate from a throwaway CA


def _make_certs(directory: Path) -> tuple[Path, Path, Path]:
    """A CA, and a server certificate for 127.0.0.1 signed by it: (ca.pem, cert.pem, key.pem)."""
    x509 = pytest.importorskip("cryptography.x509")
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn):
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("fastload test CA"))
        .issuer_name(name("fastload test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("127.0.0.1"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), False
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(pem))
    paths[1].write_bytes(cert.public_bytes(pem))
    paths[2].write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


@pytest.fixture(scope="module")
def https_server(tmp_path_factory, served):
    ca, cert, key = _make_certs(tmp_path_factory.mktemp("tls"))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    server = start_server(served[0], tls=ctx)
    server.ca = ca
    yield server
    server.close()


def test_https_with_an_untrusted_certificate_fails_cleanly(https_server):
    url = https_server.url("model.safetensors")
    err = timed_error(
        fastload.StorageError, lambda: fastload.load(url, storage_options=QUICK_RETRIES)
    )
    assert url in str(err)


def test_https_trusting_the_ca_through_ssl_cert_file(https_server, served, monkeypatch):
    monkeypatch.setenv("SSL_CERT_FILE", str(https_server.ca))
    got = fastload.load(https_server.url("model.safetensors"))
    assert_same_tensors(got, reference(served[1]["model"]))


def test_https_with_invalid_certificates_allowed(https_server, served):
    got = fastload.load(
        https_server.url("big.safetensors"),
        block_size="64KiB",
        storage_options={"allow_invalid_certificates": "true"},
    )
    assert_same_tensors(got, reference(served[1]["big"]))
