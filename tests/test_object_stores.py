"""One conformance suite, every remote store: S3 (SeaweedFS), GCS (fake-gcs-server), Azure
(servers/azure.py), plain HTTP (servers/http.py) and the Hugging Face Hub (servers/hub.py), all on
127.0.0.1 and holding the same objects (stores.py). Each test runs once per store and asserts the
same behaviour: bitwise parity with `safetensors.torch.load_file`, prefixes and indexes, names,
streaming, the same clean, bounded failures, and the one resumable read's behaviour under faults
injected between fastload and the server that sends the bytes (bodies cut, stalled or trickling;
429 and 5xx). Where a store cannot do something (plain HTTP has no listing), the store says why
and the test asserts what happens instead.

What only one store has (credentials, profiles, emulators, signatures, faults, odd servers) stays
in test_s3.py, test_gcs.py, test_azure.py, test_http.py and test_hub.py.
"""

from __future__ import annotations

import json
import subprocess
import sys

import fastload
import helpers
import pytest
import stores
from helpers import assert_same_tensors, indexed_files, reference
from servers.s3 import Fault, FaultProxy, HttpFaultProxy

# A failure must surface well inside this (retries and timeouts are bounded).
ERROR_DEADLINE = 30.0
# A missing object is answered at once: nothing to retry.
NOT_FOUND_DEADLINE = 10.0


@pytest.fixture(params=["s3", "gcs", "azure", "http", "hub"])
def store(request, monkeypatch, tmp_path) -> stores.Store:
    """Each store in turn, filled once per session, with only its own settings in the
    environment (and those only where the suite configures it through the environment)."""
    backend = request.getfixturevalue(f"{request.param}_store")
    stores.isolate(monkeypatch, tmp_path)
    return configure(backend, monkeypatch)


def configure(store: stores.Store, monkeypatch) -> stores.Store:
    if store.via_env:
        for k, v in store.env().items():
            monkeypatch.setenv(k, v)
    return store


def load(store: stores.Store, key: str, *, storage_options=None, **kw):
    options = store.load_options(**(storage_options or {}))
    return fastload.load(store.uri(key), storage_options=options, **kw)


def stream(store: stores.Store, key: str, **kw):
    return fastload.stream(store.uri(key), storage_options=store.load_options(), **kw)


def timed_error(exc_type, fn, deadline: float = ERROR_DEADLINE):
    return helpers.timed_error(exc_type, fn, deadline)


# ---------------------------------------------------------------------------------------------
# Parity


def test_single_object_parity(store, dtypes_file):
    assert_same_tensors(load(store, "all.safetensors"), reference(dtypes_file))


def test_many_tiny_tensors_parity(store, tiny_file):
    assert_same_tensors(load(store, "tiny.safetensors"), reference(tiny_file))


def test_prefix_with_index_reads_exactly_the_indexed_shards(store, sharded_dir):
    want = reference(*indexed_files(sharded_dir))
    # With the trailing slash, and through the index object itself.
    for key in ("sharded/", "sharded/model.safetensors.index.json"):
        assert_same_tensors(load(store, key), want)
    # Without the trailing slash: an object, or where there is none, a prefix.
    if store.no_listing is None:
        assert_same_tensors(load(store, "sharded"), want)
    else:
        # Only a listing tells a prefix from a missing object: the 404 is the answer.
        uri = store.uri("sharded")
        err = timed_error(FileNotFoundError, lambda: load(store, "sharded"), NOT_FOUND_DEADLINE)
        assert store.names(uri, str(err)), err


def test_prefix_without_index_reads_every_safetensors(store, dtypes_file, tiny_file):
    # Only plain/a and plain/b: not plain/notes.txt, nor plain/sub/c below the prefix.
    if store.no_listing is None:
        got = load(store, "plain/")
        assert_same_tensors(got, reference(dtypes_file, tiny_file))
    else:
        uri = store.uri("plain/")
        err = timed_error(fastload.StorageError, lambda: load(store, "plain/"))
        assert not isinstance(err, FileNotFoundError)
        assert store.names(uri, str(err)), err


def test_a_prefix_missing_a_shard_is_a_format_error_naming_it(store):
    """`partial/` holds shards 1 and 3 of 3 and no index (a save that stopped part-way): refused,
    naming the shard that is not there, never loaded as a smaller model."""
    uri = store.uri("partial/")
    if store.no_listing is not None:
        # Without a listing or an index there is nothing to load under a prefix.
        timed_error(fastload.StorageError, lambda: load(store, "partial/"))
        return
    for read in (load, lambda s, k: list(stream(s, k))):
        err = timed_error(fastload.FormatError, lambda read=read: read(store, "partial/"))
        assert "model-00002-of-00003.safetensors" in str(err), err
        assert "incomplete" in str(err) and store.names(uri, str(err)), err


def test_a_prefix_with_two_checkpoints_loads_only_through_an_index(store, sharded_dir):
    """`mixed/`: an older save's `model.safetensors` beside a shard set, no index: refused saying
    which to remove; `mixed-indexed/`, the same with the index: exactly the indexed shards."""
    assert_same_tensors(load(store, "mixed-indexed/"), reference(*indexed_files(sharded_dir)))
    if store.no_listing is not None:
        timed_error(fastload.StorageError, lambda: load(store, "mixed/"))
        return
    err = timed_error(fastload.FormatError, lambda: load(store, "mixed/"))
    hint = "remove model.safetensors or the model-0000K-of-00003.safetensors files"
    assert hint in str(err) and store.names(store.uri("mixed/"), str(err)), err


def test_names_subset(store, sharded_dir):
    want = reference(*indexed_files(sharded_dir))
    names = ["embed.weight", "layers.5.weight"]
    got = load(store, "sharded/", names=names)
    assert_same_tensors(got, {n: want[n] for n in names})


def test_small_blocks_and_many_reads_in_flight(store, sharded_dir):
    got = load(store, "sharded/", block_size=4096, concurrency=32, memory_limit="1MiB")
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


# ---------------------------------------------------------------------------------------------
# Streaming


def test_stream_yields_every_tensor_once(store, dtypes_file):
    got = {}
    for name, tensor in stream(store, "all.safetensors"):
        assert name not in got
        got[name] = tensor
    assert_same_tensors(got, reference(dtypes_file))


def test_stream_with_small_blocks(store, sharded_dir):
    got = {}
    for name, tensor in stream(store, "sharded/", block_size=4096, concurrency=16):
        assert name not in got
        got[name] = tensor
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


def test_stream_within_a_small_memory_limit(store, multi_block_file):
    got = {}
    for name, tensor in stream(store, "big.safetensors", block_size="64KiB", memory_limit="1MiB"):
        assert name not in got
        got[name] = tensor
    assert_same_tensors(got, reference(multi_block_file))


def test_object_stores_default_to_more_reads_in_flight(store, monkeypatch, multi_block_file):
    """Unset, `concurrency` is 64 for object stores (16 for local files); an explicit value or
    FASTLOAD_CONCURRENCY wins. A counting relay sees the connections the requests in flight need."""
    want = reference(multi_block_file)
    port = store.data_port()
    for concurrency, env, expected in [(None, None, 64), (6, "40", 6), (None, "4", 4)]:
        if env:
            monkeypatch.setenv("FASTLOAD_CONCURRENCY", env)
        relay = FaultProxy(("127.0.0.1", port))
        try:
            with store.data_via(relay.endpoint) as via:
                relayed = configure(via, monkeypatch)
                # 4 KiB blocks: about 750 requests, so that every slot stays busy.
                with stream(
                    relayed, "big.safetensors", concurrency=concurrency, block_size="4KiB"
                ) as s:
                    got = dict(s)
                    stats = s.stats()
        finally:
            relay.close()
        assert_same_tensors(got, want)
        assert stats["concurrency"] == expected
        # Reads in flight each hold a connection (HTTP/1.1), and the pool reuses idle ones.
        connections = relay.served["connections"]
        assert expected // 2 < connections <= store.max_connections(expected), (
            expected,
            connections,
        )


def test_cli_bench_reads_a_prefix(store, monkeypatch, sharded_dir):
    """`fastload bench <uri>` (the CLI the wheel installs, configured by the environment) reads the
    bytes a local bench of the same files reads, at the object-store default of 64 requests in
    flight."""
    for k, v in store.env().items():
        monkeypatch.setenv(k, v)

    def bench(uri: str) -> dict:
        cli = [sys.executable, "-m", "fastload._cli"]
        cmd = [*cli, "bench", uri, "--json", "--cold", "--repeat=1"]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        # --cold drops local files from the page cache; it cannot do that for objects.
        assert ("--cold evicts local files only" in out.stderr) == ("://" in uri), out.stderr
        return json.loads(out.stdout)

    remote, local = bench(store.uri("sharded/")), bench(str(sharded_dir))
    assert remote["concurrency"] == 64 and local["concurrency"] == 16
    for key in ("files", "bytes", "tensors", "checksum"):
        assert remote[key] == local[key], key
    assert remote["runs"][0]["gb_per_s"] > 0
    # issue 16: beside fastload, the raw ranged-GET rate of the same objects through the same
    # client, concurrency and block size; local files get the storage's limits instead.
    limit = remote["limits"]["ranged_get"]
    assert limit["gb_per_s"] > 0 and "64 in flight x 8MiB" in limit["what"], limit
    assert limit["bytes"] > remote["bytes"], limit  # whole objects, headers included
    assert remote["modes"]["cold"]["limit"] == "ranged_get", remote["modes"]
    assert "ranged_get" not in local["limits"] and "storage_buffered" in local["limits"]


# ---------------------------------------------------------------------------------------------
# Configuration


def test_environment_alone_or_storage_options_alone(store, monkeypatch, dtypes_file):
    uri, want = store.uri("all.safetensors"), reference(dtypes_file)
    for k, v in store.env().items():
        monkeypatch.setenv(k, v)
    assert_same_tensors(fastload.load(uri), want)
    for k in store.env():
        monkeypatch.delenv(k)
    assert_same_tensors(fastload.load(uri, storage_options=store.options()), want)


def test_anonymous_access_to_a_public_object(store, monkeypatch, dtypes_file):
    for var in store.env():
        monkeypatch.delenv(var, raising=False)
    uri, options = store.public()
    assert_same_tensors(fastload.load(uri, storage_options=options), reference(dtypes_file))


def test_options_override_the_environment(store, monkeypatch, dtypes_file):
    if store.no_env_settings is not None:
        pytest.skip(store.no_env_settings)
    env, fix = store.spoiled()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    uri = store.uri("all.safetensors")
    # The environment alone fails; options given beside it win over it.
    timed_error(fastload.StorageError, lambda: fastload.load(uri))
    assert_same_tensors(fastload.load(uri, storage_options=fix), reference(dtypes_file))


@pytest.mark.parametrize("typo", ["endpiont", "acount_name"])
def test_unknown_storage_option_is_a_config_error(store, typo):
    with pytest.raises(fastload.ConfigError, match=typo):
        fastload.load(store.uri("x.safetensors"), storage_options={typo: "http://127.0.0.1:9"})


# ---------------------------------------------------------------------------------------------
# Errors: the right exception, naming the URI, within a bounded time


def test_missing_object_is_file_not_found(store):
    uri = store.uri("no-such-model.safetensors")
    err = timed_error(
        FileNotFoundError, lambda: load(store, "no-such-model.safetensors"), NOT_FOUND_DEADLINE
    )
    assert isinstance(err, fastload.NotFoundError)
    assert isinstance(err, fastload.FastloadError)
    assert store.names(uri, str(err)), err


@pytest.mark.parametrize("key", ["broken/", "broken/model.safetensors.index.json"])
def test_missing_shard_named_by_the_index(store, key):
    err = timed_error(FileNotFoundError, lambda: load(store, key), NOT_FOUND_DEADLINE)
    assert stores.MISSING_SHARD in str(err)


def test_object_shorter_than_its_header_says_is_a_format_error(store):
    uri = store.uri("truncated.safetensors")
    err = timed_error(fastload.FormatError, lambda: load(store, "truncated.safetensors"))
    assert store.names(uri, str(err)), err


def test_empty_prefix_is_file_not_found(store):
    uri = store.uri("nothing-here/")
    if store.no_listing is None:
        err = timed_error(FileNotFoundError, lambda: load(store, "nothing-here/"))
    else:
        # No index there, and no listing to look further: the listing's failure is the answer.
        err = timed_error(
            fastload.StorageError,
            lambda: load(store, "nothing-here/"),
        )
        assert not isinstance(err, FileNotFoundError)
    assert store.names(uri, str(err)), err


def test_missing_bucket_is_a_storage_error(store):
    if store.no_buckets is not None:
        pytest.skip(store.no_buckets)
    uri = store.missing_bucket()
    err = timed_error(
        fastload.StorageError, lambda: fastload.load(uri, storage_options=store.load_options())
    )
    assert isinstance(err, OSError)
    assert not isinstance(err, FileNotFoundError)
    assert store.names(uri, str(err)), err


def test_refused_connection_is_a_storage_error(store, monkeypatch):
    dead = configure(store.refused(), monkeypatch)
    uri = dead.uri("all.safetensors")
    err = timed_error(fastload.StorageError, lambda: load(dead, "all.safetensors"))
    assert store.names(uri, str(err)), err


# ---------------------------------------------------------------------------------------------
# Faults between fastload and the server that sends the bytes (a relay, HttpFaultProxy): every
# store reads through the one resumable read (src/source/remote/), so each behaves the same.

# A stall rule quick enough for tests: under 64 KiB/s over a second is cut and resumed.
QUICK_STALL_RULE = {"min_rate": "64KiB", "min_rate_window": "1", "max_retries": "3"}


def through_faults(store, monkeypatch, key: str, plan=(), then=None, **kw):
    """Loads `key` with each ranged GET of its bytes taking the next fault of `plan` (then
    `then`); returns (tensors, the relay's counters)."""
    proxy = HttpFaultProxy(("127.0.0.1", store.data_port()), plan=plan, then=then)
    try:
        with store.data_via(proxy.endpoint) as via:
            got = load(configure(via, monkeypatch), key, **kw)
    finally:
        proxy.close()
    return got, proxy.served


@pytest.mark.parametrize("kind", ["cut", "reset"])
def test_cut_bodies_resume_from_the_first_missing_byte(store, monkeypatch, multi_block_file, kind):
    plan = [Fault(kind, after=a) for a in (10_000, 70_000, 0)]
    got, served = through_faults(store, monkeypatch, "big.safetensors", plan, block_size="256KiB")
    assert_same_tensors(got, reference(multi_block_file))
    assert served[kind] == 3


def test_stalled_bodies_are_cut_by_the_stall_rule_and_resumed(store, monkeypatch, multi_block_file):
    plan = [Fault("stall", after=a, seconds=60) for a in (10_000, 0)]
    got, served = through_faults(
        store,
        monkeypatch,
        "big.safetensors",
        plan,
        block_size="256KiB",
        storage_options=QUICK_STALL_RULE,
    )
    assert_same_tensors(got, reference(multi_block_file))
    assert served["stall"] == 2


def test_a_trickle_fails_within_the_stall_rule(store, monkeypatch):
    trickle = Fault("trickle", after=1000, rate=200)
    proxy = HttpFaultProxy(("127.0.0.1", store.data_port()), then=trickle)
    try:
        with store.data_via(proxy.endpoint) as via:
            via = configure(via, monkeypatch)
            uri = via.uri("big.safetensors")
            err = timed_error(
                fastload.StorageError,
                lambda: load(
                    via,
                    "big.safetensors",
                    block_size="256KiB",
                    storage_options=QUICK_STALL_RULE,
                ),
            )
    finally:
        proxy.close()
    assert store.names(uri, str(err)), err
    assert "below the minimum rate of 64.0 KiB/s" in str(err), err
    assert proxy.served["trickle"] > 0


@pytest.mark.parametrize("status", [429, 500, 503])
def test_throttling_and_server_errors_are_retried(store, monkeypatch, multi_block_file, status):
    plan = [Fault("status", status=status, code="SlowDown")] * 2
    got, served = through_faults(store, monkeypatch, "big.safetensors", plan, block_size="1MiB")
    assert_same_tensors(got, reference(multi_block_file))
    assert served["status"] == 2
