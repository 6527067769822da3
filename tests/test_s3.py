"""Loading from S3: a real S3-compatible server on 127.0.0.1 (SeaweedFS, SigV4 enforced; moto for
some error paths), bitwise parity with `safetensors.torch.load_file`, and clean, bounded failures.

Servers and fixtures live in s3_server.py. Settings reach fastload the two documented ways: the
standard AWS_* environment variables, or `storage_options={...}`.
"""

from __future__ import annotations

import json
import time

import fastload
import pytest
import s3_server
from helpers import assert_same_tensors, indexed_files, reference
from s3_server import (
    ACCESS_KEY,
    BUCKET,
    PUBLIC_BUCKET,
    REGION,
    SECRET_KEY,
    FaultProxy,
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
        {
            "all.safetensors": dtypes_file,
            "tiny.safetensors": tiny_file,
            "plain/a.safetensors": dtypes_file,
            "plain/b.safetensors": tiny_file,
            "plain/notes.txt": b"not a checkpoint",
        },
    )
    upload_dir(s3, BUCKET, "sharded", sharded_dir)
    upload(s3, PUBLIC_BUCKET, {"open/all.safetensors": dtypes_file})
    return seaweed


def timed_error(exc_type, fn):
    started = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn()
    took = time.monotonic() - started
    assert took < ERROR_DEADLINE, f"took {took:.1f} s to fail"
    return info.value


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


def test_anonymous_access_to_a_public_bucket(bucket, aws_env, dtypes_file):
    got = fastload.load(
        f"s3://{PUBLIC_BUCKET}/open/all.safetensors",
        storage_options={"endpoint": bucket.endpoint, "skip_signature": "true"},
    )
    assert_same_tensors(got, reference(dtypes_file))


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
