"""Loading from S3: a real S3-compatible server on 127.0.0.1 (SeaweedFS, SigV4 enforced; moto for
some error paths), bitwise parity with `safetensors.torch.load_file`, and clean, bounded failures.

Servers and fixtures live in s3_server.py. Settings reach fastload the three documented ways: the
standard AWS_* environment variables, `storage_options={...}`, or boto3's shared config files.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import fastload
import helpers
import pytest
import s3_server
from helpers import assert_same_tensors, indexed_files, reference
from s3_server import (
    ACCESS_KEY,
    BUCKET,
    PUBLIC_BUCKET,
    REGION,
    SECRET_KEY,
    Fault,
    FaultProxy,
    HttpFaultProxy,
    closed_port,
    upload,
    upload_dir,
)

# The servers' fixtures, bound here so that pytest finds them.
seaweed = s3_server.seaweed
moto_s3 = s3_server.moto_s3
aws_env = s3_server.aws_env

# A failure must surface well inside this (retries and timeouts are bounded).
ERROR_DEADLINE = 60.0


@pytest.fixture(scope="module")
def bucket(seaweed, dtypes_file, sharded_dir, tiny_file):
    """Uploads the session's checkpoints once: single files, a sharded prefix with its index
    (plus the stray file the index does not name), and a prefix without an index."""
    s3 = seaweed.client()
    upload(
        s3,
        BUCKET,
        helpers.bucket_objects(dtypes_file, tiny_file),
    )
    upload_dir(s3, BUCKET, "sharded", sharded_dir)
    upload(s3, PUBLIC_BUCKET, {"open/all.safetensors": dtypes_file})
    return seaweed


def timed_error(exc_type, fn, deadline: float = ERROR_DEADLINE):
    return helpers.timed_error(exc_type, fn, deadline)


# ---------------------------------------------------------------------------------------------
# Parity


def test_single_object_parity(bucket, aws_env, dtypes_file):
    aws_env(bucket)
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/all.safetensors"), reference(dtypes_file))


def test_many_tiny_tensors_parity(bucket, aws_env, tiny_file):
    aws_env(bucket)
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/tiny.safetensors"), reference(tiny_file))


def test_prefix_with_index_reads_exactly_the_indexed_shards(bucket, aws_env, sharded_dir):
    aws_env(bucket)
    want = reference(*indexed_files(sharded_dir))
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/sharded/"), want)
    # Without the trailing slash, and through the index object itself.
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/sharded"), want)
    index = f"s3://{BUCKET}/sharded/model.safetensors.index.json"
    assert_same_tensors(fastload.load(index), want)


def test_prefix_without_index_reads_every_safetensors(bucket, aws_env, dtypes_file, tiny_file):
    aws_env(bucket)
    got = fastload.load(f"s3://{BUCKET}/plain/")
    assert_same_tensors(got, reference(dtypes_file, tiny_file))


def test_storage_options_without_environment(bucket, aws_env, dtypes_file):
    got = fastload.load(f"s3://{BUCKET}/all.safetensors", storage_options=bucket.storage_options())
    assert_same_tensors(got, reference(dtypes_file))


def test_options_override_the_environment(bucket, aws_env, monkeypatch, dtypes_file):
    aws_env(bucket)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    with pytest.raises(fastload.StorageError):
        fastload.load(f"s3://{BUCKET}/all.safetensors")
    got = fastload.load(
        f"s3://{BUCKET}/all.safetensors", storage_options={"secret_access_key": SECRET_KEY}
    )
    assert_same_tensors(got, reference(dtypes_file))


def test_small_blocks_and_many_reads_in_flight(bucket, aws_env, sharded_dir):
    aws_env(bucket)
    got = fastload.load(
        f"s3://{BUCKET}/sharded/", block_size=4096, concurrency=32, memory_limit="1MiB"
    )
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


def test_names_subset(bucket, aws_env, sharded_dir):
    aws_env(bucket)
    want = reference(*indexed_files(sharded_dir))
    names = ["embed.weight", "layers.5.weight"]
    got = fastload.load(f"s3://{BUCKET}/sharded/", names=names)
    assert_same_tensors(got, {n: want[n] for n in names})


def test_stream_yields_every_tensor_once(bucket, aws_env, dtypes_file):
    aws_env(bucket)
    want = reference(dtypes_file)
    got = {}
    for name, tensor in fastload.stream(f"s3://{BUCKET}/all.safetensors"):
        assert name not in got
        got[name] = tensor
    assert_same_tensors(got, want)


def test_object_stores_default_to_more_reads_in_flight(bucket, aws_env, monkeypatch, fault_file):
    """Unset, `concurrency` is 64 for object stores (16 for local files); an explicit value or
    FASTLOAD_CONCURRENCY wins. A counting relay sees the connections the requests in flight need."""
    aws_env(bucket)
    monkeypatch.delenv("FASTLOAD_CONCURRENCY", raising=False)
    port = int(bucket.endpoint.rsplit(":", 1)[1])
    want = reference(fault_file)
    for concurrency, env, expected in [(None, None, 64), (6, "40", 6), (None, "4", 4)]:
        if env:
            monkeypatch.setenv("FASTLOAD_CONCURRENCY", env)
        relay = FaultProxy(("127.0.0.1", port))
        try:
            monkeypatch.setenv("AWS_ENDPOINT_URL", relay.endpoint)
            uri = f"s3://{BUCKET}/{FAULT_KEY}"
            # 4 KiB blocks: about a thousand requests, so that every slot stays busy.
            with fastload.stream(uri, concurrency=concurrency, block_size="4KiB") as s:
                got = dict(s)
                stats = s.stats()
        finally:
            relay.close()
        assert_same_tensors(got, want)
        assert stats["concurrency"] == expected
        # Reads in flight each hold a connection (HTTP/1.1), and the pool reuses idle ones.
        connections = relay.served["connections"]
        assert expected // 2 < connections <= expected + 2, (expected, connections)


def test_cli_bench_reads_a_prefix(bucket, aws_env, monkeypatch, sharded_dir):
    """`fastload bench s3://...` (the CLI the wheel installs) reads the bytes a local bench of the
    same files reads, at the object-store default of 64 requests in flight."""
    aws_env(bucket)
    monkeypatch.delenv("FASTLOAD_CONCURRENCY", raising=False)

    def bench(uri: str) -> dict:
        cli = [sys.executable, "-m", "fastload._cli"]
        cmd = [*cli, "bench", uri, "--json", "--cold", "--repeat=1"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        # --cold drops local files from the page cache; it cannot do that for objects.
        assert ("--cold evicts local files only" in out.stderr) == ("://" in uri), out.stderr
        return json.loads(out.stdout)

    remote, local = bench(f"s3://{BUCKET}/sharded/"), bench(str(sharded_dir))
    assert remote["concurrency"] == 64 and local["concurrency"] == 16
    for key in ("files", "bytes", "tensors", "checksum"):
        assert remote[key] == local[key], key
    assert remote["runs"][0]["gb_per_s"] > 0


def test_anonymous_access_to_a_public_bucket(bucket, aws_env, dtypes_file):
    got = fastload.load(
        f"s3://{PUBLIC_BUCKET}/open/all.safetensors",
        storage_options={"endpoint": bucket.endpoint, "skip_signature": "true"},
    )
    assert_same_tensors(got, reference(dtypes_file))


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


def test_missing_or_unsupported_profile_is_a_config_error(profiles, monkeypatch, tmp_path):
    uri = f"s3://{BUCKET}/all.safetensors"
    monkeypatch.setenv("AWS_PROFILE", "prod")
    with pytest.raises(fastload.ConfigError, match='"prod" not found'):
        fastload.load(uri)
    config = tmp_path / "config"
    config.write_text("[profile prod]\nrole_arn = arn:aws:iam::1:role/r\nsource_profile = dev\n")
    with pytest.raises(fastload.ConfigError, match="export-credentials"):
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
# Errors: the right exception, naming the URI, within a bounded time, without secrets


def test_missing_object_is_file_not_found(bucket, aws_env):
    aws_env(bucket)
    uri = f"s3://{BUCKET}/no-such-model.safetensors"
    err = timed_error(FileNotFoundError, lambda: fastload.load(uri))
    assert isinstance(err, fastload.FastloadError)
    assert uri in str(err)


def test_missing_shard_named_by_the_index(bucket, aws_env, sharded_dir):
    aws_env(bucket)
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    index["weight_map"]["extra.weight"] = "model-gone.safetensors"
    upload_dir(bucket.client(), BUCKET, "broken", sharded_dir)
    upload(
        bucket.client(), BUCKET, {"broken/model.safetensors.index.json": json.dumps(index).encode()}
    )
    err = timed_error(FileNotFoundError, lambda: fastload.load(f"s3://{BUCKET}/broken/"))
    assert "model-gone.safetensors" in str(err)


def test_empty_prefix_is_file_not_found(bucket, aws_env):
    aws_env(bucket)
    timed_error(FileNotFoundError, lambda: fastload.load(f"s3://{BUCKET}/nothing-here/"))


def test_missing_bucket_is_a_storage_error(bucket, aws_env):
    aws_env(bucket)
    uri = "s3://no-such-bucket-fastload/model.safetensors"
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri))
    assert isinstance(err, OSError)
    assert not isinstance(err, FileNotFoundError)
    assert "no-such-bucket-fastload" in str(err)


def test_bad_credentials_are_a_storage_error_without_secrets(bucket, aws_env, monkeypatch):
    aws_env(bucket)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret-for-fastload-test")
    uri = f"s3://{BUCKET}/all.safetensors"
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri))
    text = str(err)
    assert uri in text
    assert "wrong-secret-for-fastload-test" not in text
    assert SECRET_KEY not in text


def test_refused_connection_is_a_storage_error(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", ACCESS_KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET_KEY)
    monkeypatch.setenv("AWS_REGION", REGION)
    uri = f"s3://{BUCKET}/all.safetensors"
    err = timed_error(fastload.StorageError, lambda: fastload.load(uri))
    assert uri in str(err)


def test_no_credentials_with_metadata_disabled_fails_fast(aws_env, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{closed_port()}")
    started = time.monotonic()
    with pytest.raises(fastload.StorageError, match="AWS_ACCESS_KEY_ID"):
        fastload.load(f"s3://{BUCKET}/all.safetensors")
    assert time.monotonic() - started < 5


def test_unknown_storage_option_is_a_config_error(aws_env):
    with pytest.raises(fastload.ConfigError, match="endpiont"):
        fastload.load(f"s3://{BUCKET}/x.safetensors", storage_options={"endpiont": "http://x"})


def test_moto_missing_object_and_bucket(moto_s3, aws_env):
    aws_env(moto_s3)
    timed_error(FileNotFoundError, lambda: fastload.load(f"s3://{BUCKET}/absent.safetensors"))
    timed_error(fastload.StorageError, lambda: fastload.load("s3://absent-bucket/x.safetensors"))


def test_moto_parity(moto_s3, aws_env, dtypes_file):
    aws_env(moto_s3)
    upload(moto_s3.client(), BUCKET, {"m/all.safetensors": dtypes_file})
    assert_same_tensors(fastload.load(f"s3://{BUCKET}/m/"), reference(dtypes_file))


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
def through_proxy(bucket, aws_env, monkeypatch):
    """Starts an HttpFaultProxy in front of SeaweedFS and points AWS_ENDPOINT_URL at it."""
    aws_env(bucket)
    port = int(bucket.endpoint.rsplit(":", 1)[1])
    proxies = []

    def start(**kw) -> HttpFaultProxy:
        proxy = HttpFaultProxy(("127.0.0.1", port), **kw)
        proxies.append(proxy)
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        return proxy

    yield start
    for p in proxies:
        p.close()


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
