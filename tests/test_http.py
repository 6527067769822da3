"""What only plain http(s):// has, beside the conformance suite (test_object_stores.py, which
reads servers/http.py's server like every other store): the server's own Range handling, that data
reads are ranged GETs of no more than they need, servers that answer PROPFIND otherwise, ignore
Range, fail at first or forbid everything, and https with a certificate from a throwaway CA.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import fastload
import helpers
import pytest
from helpers import assert_same_tensors, indexed_files, reference
from servers.http import RANGE, Behaviour, RangeServer, start_server

# A failure must surface well inside this (retries and timeouts are bounded).
ERROR_DEADLINE = 30.0
# Fast, bounded retries for the error-path tests (the defaults allow up to a minute of retries).
QUICK_RETRIES = {"max_retries": "2", "retry_timeout": "10", "connect_timeout": "2"}


@pytest.fixture(scope="module")
def served(store_files):
    """{"/url/path": bytes}: what every object store holds (stores.py), for the servers started
    here."""
    return {
        "/" + key: src if isinstance(src, bytes) else src.read_bytes()
        for key, src in store_files.items()
    }


@pytest.fixture(scope="module")
def http_server(http_store):
    """The session's well-behaved server, the one the conformance suite reads."""
    return http_store.server


@pytest.fixture
def make_server(served):
    """Starts servers with a given behaviour; closes them after the test."""
    started = []

    def make(**kw) -> RangeServer:
        server = start_server(served, Behaviour(**kw))
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
    data = served["/big.safetensors"]
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
# Data reads are ranged GETs, of what is needed


def test_multi_block_file_with_small_blocks(http_server, served, multi_block_file):
    url = http_server.url("big.safetensors")
    log = http_server.behaviour.log
    before = len(log)
    got = fastload.load(url, block_size="64KiB", concurrency=8)
    assert_same_tensors(got, reference(multi_block_file))
    gets = [e for e in log[before:] if e[0] == "GET" and e[1] == "/big.safetensors"]
    # Every data read was a ranged GET answered with 206, and there were many of them.
    size = len(served["/big.safetensors"])
    assert len(gets) >= size // (64 << 10), len(gets)
    assert all(rng and status == 206 for _, _, rng, status in gets), gets[:5]


def test_auto_reads_objects_and_says_so(http_server, multi_block_file):
    url = http_server.url("big.safetensors")
    with fastload.stream(url) as s:
        list(s)
        stats = s.stats()
    assert stats["method"] == "read", stats
    assert stats["method_reason"] == f"{url} is not a local file: read into pooled buffers"


def test_names_reads_only_those_tensors(http_server, multi_block_file):
    want = reference(multi_block_file)
    names = ["layer.0.norm", "scalar"]
    log = http_server.behaviour.log
    before = len(log)
    got = fastload.load(http_server.url("big.safetensors"), names=names, block_size="64KiB")
    assert_same_tensors(got, {n: want[n] for n in names})
    # The header, then a few KiB of data: nothing near the file's 3 MiB.
    ranges = [e[2] for e in log[before:] if e[0] == "GET"]
    fetched = 0
    for r in ranges:
        a, b = RANGE.match(r).groups()
        fetched += int(b) + 1 - int(a)
    assert fetched < 512 << 10, (fetched, ranges)


def test_index_is_sized_with_head_requests_not_a_listing(http_server, sharded_dir):
    """A plain server cannot list (PROPFIND is refused, and retried as a server error for
    seconds): the shards an index names are sized with HEAD requests alone."""
    log = http_server.behaviour.log
    before = len(log)
    got = fastload.load(http_server.url("sharded/model.safetensors.index.json"))
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    methods = [e[0] for e in log[before:]]
    assert "PROPFIND" not in methods, methods
    assert "HEAD" in methods, methods


# ---------------------------------------------------------------------------------------------
# Odd servers


def test_missing_file_is_file_not_found_when_propfind_is_not_allowed(make_server):
    # The suite's server answers PROPFIND 501, as http.server does; nginx answers 405.
    server = make_server(propfind=405)
    url = server.url("no-such-model.safetensors")
    err = timed_error(
        FileNotFoundError, lambda: fastload.load(url, storage_options=QUICK_RETRIES), 10
    )
    assert isinstance(err, fastload.FastloadError)
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


def test_transient_503s_are_retried(make_server, multi_block_file):
    server = make_server(fail_first=4, fail_status=503)
    got = fastload.load(server.url("big.safetensors"), block_size="256KiB")
    assert_same_tensors(got, reference(multi_block_file))
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


# ---------------------------------------------------------------------------------------------
# The stall rule: a body below the minimum rate is cut and retried; a trickle fails in bounded time

STALL_PROBE = """
import time
start = time.monotonic()
try:
    fastload.load(sys.argv[1], block_size="256KiB", storage_options=json.loads(sys.argv[2]))
    emit(ok=True, took=time.monotonic() - start)
except fastload.StorageError as e:
    emit(ok=False, error=str(e), took=time.monotonic() - start)
"""


def _data_offset(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def test_trickling_server_fails_within_the_stall_rule(make_server, multi_block_file):
    # 20 bytes a second once the tensor data starts: every request made progress, so before the
    # stall rule the read resumed for ever (the request timeout cut each body with new bytes).
    server = make_server(trickle_rate=20, trickle_from=_data_offset(multi_block_file))
    url = server.url("big.safetensors")
    options = {"min_rate": "4KiB", "min_rate_window": "1", "timeout": "2"}
    out = helpers.run_probe(STALL_PROBE, url, json.dumps(options), timeout=90)
    assert out["ok"] is False, out
    error = out["error"]
    assert url in error and "bytes " in error and "B/s" in error, error
    assert "minimum rate of 4.0 KiB/s" in error, error
    # Five windows of a second and the backoffs between them.
    assert out["took"] < 30, out


def test_slow_server_above_the_minimum_rate_completes(make_server, multi_block_file):
    # About 512 KiB/s against a minimum of 16 KiB/s over half a second: slow is not stalled.
    server = make_server(trickle_rate=512 << 10, trickle_from=_data_offset(multi_block_file))
    got = fastload.load(
        server.url("big.safetensors"),
        block_size="256KiB",
        concurrency=2,
        storage_options={"min_rate": "16KiB", "min_rate_window": "0.5"},
    )
    assert_same_tensors(got, reference(multi_block_file))


@pytest.mark.parametrize(
    "key, value", [("min_rate", "fast"), ("min_rate_window", "0"), ("min_rate_window", "soon")]
)
def test_stall_rule_options_are_checked(http_server, key, value):
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(http_server.url("big.safetensors"), storage_options={key: value})
    assert info.value.option == f'storage_options["{key}"]'


# ---------------------------------------------------------------------------------------------
# One version per load: every ranged GET carries If-Match with the ETag seen first, so an object
# overwritten midway is a clear error, never tensors that mix two versions


@pytest.fixture
def new_version(tmp_path, multi_block_file):
    """big.safetensors as someone overwrites it: the same size and header, other values."""
    path = helpers.write_multi_block(tmp_path / "new.safetensors", seed=100)
    assert path.stat().st_size == multi_block_file.stat().st_size
    assert path.read_bytes() != multi_block_file.read_bytes()
    return path


@pytest.mark.parametrize("ignore_if_match", [False, True], ids=["412", "ignores-if-match"])
def test_an_object_overwritten_while_loading_is_an_error_not_torn(
    make_server, new_version, ignore_if_match
):
    server = make_server(
        swap_path="/big.safetensors",
        swap_data=new_version.read_bytes(),
        swap_after=3,
        ignore_if_match=ignore_if_match,
    )
    url = server.url("big.safetensors")
    load = lambda: fastload.load(url, block_size="64KiB")  # noqa: E731
    err = timed_error(fastload.StorageError, load)
    assert "changed while loading" in str(err) and url in str(err), err
    # A server that honours If-Match refuses the stale version; one that ignores it is caught by
    # the ETag of its answer.
    assert (server.behaviour.refused_if_match > 0) == (not ignore_if_match)
    # The object holds one version again: a new load reads it whole.
    assert_same_tensors(fastload.load(url, block_size="64KiB"), reference(new_version))


def test_a_stream_over_an_overwritten_object_ends_in_the_error(
    make_server, new_version, multi_block_file
):
    server = make_server(
        swap_path="/big.safetensors", swap_data=new_version.read_bytes(), swap_after=4
    )
    old = reference(multi_block_file)
    with pytest.raises(fastload.StorageError, match="changed while loading"):
        for name, tensor in fastload.stream(
            server.url("big.safetensors"), block_size="64KiB", memory_limit="1MiB"
        ):
            # What was handed out before the error is of the first version, whole.
            helpers.assert_same_tensor(tensor, old[name], name)


def test_a_torn_load_publishes_nothing_in_the_cache(make_server, new_version, tmp_path):
    server = make_server(
        swap_path="/big.safetensors", swap_data=new_version.read_bytes(), swap_after=3
    )
    url, cache = server.url("big.safetensors"), tmp_path / "cache"
    load = lambda: fastload.load(url, block_size="64KiB", cache=cache)  # noqa: E731
    timed_error(fastload.StorageError, load)
    fastload.cache_stats()  # waits for copies being published
    assert sorted((cache / "objects").glob("*.safetensors")) == []
    assert sorted((cache / "objects").glob("*.fastload-partial")) == []
    # The next load fills the copy with the new version, and the one after reads that copy.
    want = reference(new_version)
    assert_same_tensors(load(), want)
    fastload.cache_stats()  # a load returns before its copy is published: wait for it
    gets = server.behaviour.gets
    assert_same_tensors(load(), want)
    assert server.behaviour.gets == gets, "the second load read the published copy"


# Servers whose GETs carry fewer validators than their HEAD: the version is pinned on all the
# validators the server gives (ETag, Last-Modified, size), and a response that cannot be tied to
# the pinned version stops the load


@pytest.mark.parametrize(
    "validators",
    [
        {"get_etags": False},
        {"get_etags": False, "ignore_if_match": True},
        {"etags": False},
        {"etags": False, "ignore_if_match": True},
    ],
    ids=["no-etag-on-get", "no-etag-on-get-ignores-if-match", "last-modified-only", "lm-ignored"],
)
def test_an_overwrite_is_caught_whatever_validators_the_gets_carry(
    make_server, new_version, validators
):
    """HEAD gives an ETag but GETs carry none (a proxy stripped it), or the server gives only
    Last-Modified: the HEAD's ETag is sent as If-Match, else its Last-Modified as
    If-Unmodified-Since, and each response's Last-Modified is compared; an overwrite is an
    error, never tensors of two versions."""
    server = make_server(
        swap_path="/big.safetensors", swap_data=new_version.read_bytes(), swap_after=3, **validators
    )
    url = server.url("big.safetensors")
    err = timed_error(fastload.StorageError, lambda: fastload.load(url, block_size="64KiB"))
    assert "changed while loading" in str(err) and url in str(err), err
    # A server that honours the preconditions refused the stale version (412).
    assert (server.behaviour.refused_if_match > 0) == (not validators.get("ignore_if_match")), err
    assert_same_tensors(fastload.load(url, block_size="64KiB"), reference(new_version))


@pytest.mark.parametrize("ignore_if_match", [False, True], ids=["412", "ignores-if-match"])
def test_a_safe_open_handle_never_serves_another_version(
    make_server, new_version, multi_block_file, ignore_if_match
):
    """The header was read from version A; once the object is B, a tensor read through the
    handle is an error, not B's bytes under A's header, though the GETs carry no ETag."""
    server = make_server(get_etags=False, ignore_if_match=ignore_if_match)
    url = server.url("big.safetensors")
    old = reference(multi_block_file)
    with fastload.safe_open(url, "pt") as f:
        first, *rest = [name for name in f.keys() if old[name].numel()]
        helpers.assert_same_tensor(f.get_tensor(first), old[first], first)
        server.overwrite({"big.safetensors": new_version})
        for name in rest:
            with pytest.raises(fastload.StorageError, match="changed while loading"):
                f.get_tensor(name)
            with pytest.raises(fastload.StorageError, match="changed while loading"):
                f.get_slice(name)[:1]


@pytest.mark.parametrize(
    "validators, sent",
    [({}, 'If-Match: "{etag}"'), ({"etags": False}, "If-Unmodified-Since: ")],
    ids=["etag", "last-modified"],
)
def test_a_412_on_the_first_get_names_the_validator_refused(
    make_server, new_version, served, validators, sent
):
    """The object changes between the HEAD and the first GET: the 412 names what was sent."""
    import hashlib

    server = make_server(
        swap_path="/big.safetensors", swap_data=new_version.read_bytes(), swap_after=0, **validators
    )
    url = server.url("big.safetensors")
    err = timed_error(fastload.StorageError, lambda: fastload.load(url, block_size="64KiB"))
    etag = hashlib.md5(served["/big.safetensors"]).hexdigest()
    message = str(err)
    assert "412 Precondition Failed" in message and "changed while loading" in message, message
    assert sent.format(etag=etag) in message, message
    assert "If-Match:  " not in message and "If-Match: with" not in message, message
    assert server.behaviour.refused_if_match == 1


@pytest.mark.parametrize("compared_by", ["origin", "cdn"])
def test_head_and_get_etags_that_disagree_on_an_unchanged_object_say_so(
    make_server, served, compared_by
):
    """A CDN rewrites the ETag of GETs: HEAD says "a", GET says "b" though nothing changed. The
    error says the server's validators disagree, not that the object changed, whether If-Match
    goes through to the origin (the GET answers with "b") or the CDN compares it with its own
    tag (412)."""
    import hashlib

    server = make_server(
        get_etag='"rewritten-by-the-cdn"', if_match_against_get_etag=compared_by == "cdn"
    )
    url = server.url("big.safetensors")
    err = timed_error(fastload.StorageError, lambda: fastload.load(url, block_size="64KiB"))
    message = str(err)
    assert "validators disagree" in message and url in message, message
    assert "changed while loading" not in message, message
    etag = f'"{hashlib.md5(served["/big.safetensors"]).hexdigest()}"'
    if compared_by == "cdn":
        assert f"If-Match: {etag}" in message and "412" in message, message
    else:
        assert '"rewritten-by-the-cdn"' in message and etag in message, message


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
    server = start_server(served, tls=ctx)
    server.ca = ca
    yield server
    server.close()


def test_https_with_an_untrusted_certificate_fails_cleanly(https_server):
    url = https_server.url("all.safetensors")
    err = timed_error(
        fastload.StorageError, lambda: fastload.load(url, storage_options=QUICK_RETRIES)
    )
    assert url in str(err)


def test_https_trusting_the_ca_through_ssl_cert_file(https_server, monkeypatch, dtypes_file):
    monkeypatch.setenv("SSL_CERT_FILE", str(https_server.ca))
    got = fastload.load(https_server.url("all.safetensors"))
    assert_same_tensors(got, reference(dtypes_file))


def test_https_with_invalid_certificates_allowed(https_server, multi_block_file):
    got = fastload.load(
        https_server.url("big.safetensors"),
        block_size="64KiB",
        storage_options={"allow_invalid_certificates": "true"},
    )
    assert_same_tensors(got, reference(multi_block_file))
