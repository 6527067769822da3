"""The local cache (``cache=``): remote objects are written to local disk while they stream, and
a later load of the same object (same ETag) reads the local copy.

Against a real HTTP server on 127.0.0.1 (servers/http.py: Range, ETag, a log of every request)
and SeaweedFS for S3; subprocesses for the races, ``kill -9`` and file-size limits; a real
tmpfs for a full disk.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import fastload
import pytest
import torch
from helpers import assert_same_tensors, indexed_files, reference
from safetensors.torch import save_file
from servers.http import Behaviour, start_server

TESTS = Path(__file__).parent


def data_gets(server) -> list:
    """The ranged GETs the server answered (reads of data, not HEADs)."""
    return [e for e in server.behaviour.log if e[0] == "GET"]


def published(cache: Path) -> list[Path]:
    """The copies under `cache`, once this process's copies being published are (loads do not
    wait for the flush; `cache_stats()` does)."""
    fastload.cache_stats()
    return sorted((cache / "objects").glob("*.safetensors"))


def leftovers(cache: Path) -> list[Path]:
    fastload.cache_stats()
    return sorted((cache / "objects").glob("*.fastload-partial"))


@pytest.fixture
def served(multi_block_file):
    server = start_server({"m/big.safetensors": multi_block_file})
    yield server, server.url("m/big.safetensors"), reference(multi_block_file)
    server.close()


def test_a_filled_copy_serves_the_next_load_without_reading_data_remotely(served, tmp_path):
    server, url, want = served
    cache = tmp_path / "cache"
    before = fastload.cache_stats()
    assert_same_tensors(fastload.load(url, cache=cache, block_size="64KiB"), want)
    (copy,) = published(cache)
    assert leftovers(cache) == []
    sidecar = json.loads(copy.with_suffix(".json").read_text())
    assert sidecar["uri"] == url and sidecar["etag"] == server.etags["/m/big.safetensors"]
    assert copy.read_bytes() == server.files["/m/big.safetensors"]
    after = fastload.cache_stats()
    assert after["published"] == before["published"] + 1
    assert after["filled_bytes"] - before["filled_bytes"] >= copy.stat().st_size

    server.behaviour.log.clear()
    assert_same_tensors(fastload.load(url, cache=str(cache)), want)
    # Only the HEAD that checks the ETag went to the server: every byte came from the copy.
    assert data_gets(server) == []
    assert [e[0] for e in server.behaviour.log] == ["HEAD"]
    assert fastload.cache_stats()["hits"] == after["hits"] + 1


def test_without_the_option_nothing_is_cached(served, tmp_path, monkeypatch):
    _, url, want = served
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert_same_tensors(fastload.load(url), want)
    assert not (tmp_path / "xdg").exists()
    # FASTLOAD_CACHE=1 is the default directory; cache=False wins over it.
    monkeypatch.setenv("FASTLOAD_CACHE", "1")
    assert_same_tensors(fastload.load(url, cache=False), want)
    assert not (tmp_path / "xdg").exists()
    assert_same_tensors(fastload.load(url), want)
    assert len(published(tmp_path / "xdg" / "fastload")) == 1
    monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "env"))
    assert_same_tensors(fastload.load(url), want)
    assert len(published(tmp_path / "env")) == 1


def test_a_changed_object_is_fetched_again(served, tmp_path, dtypes_file):
    server, url, _ = served
    cache = tmp_path / "cache"
    fastload.load(url, cache=cache)
    assert len(published(cache)) == 1
    server.put({"m/big.safetensors": dtypes_file})  # same URL, new content, new ETag
    server.behaviour.log.clear()
    assert_same_tensors(fastload.load(url, cache=cache), reference(dtypes_file))
    assert data_gets(server), "the changed object was not read from the server"
    (copy,) = published(cache)
    assert copy.read_bytes() == dtypes_file.read_bytes()
    server.behaviour.log.clear()
    assert_same_tensors(fastload.load(url, cache=cache), reference(dtypes_file))
    assert data_gets(server) == []


def test_a_partial_load_publishes_nothing_and_leaves_nothing(served, tmp_path):
    _, url, want = served
    cache = tmp_path / "cache"
    got = fastload.load(url, cache=cache, names=["scalar"])
    assert_same_tensors(got, {"scalar": want["scalar"]})
    assert published(cache) == [] and leftovers(cache) == []
    # A stream closed early: the same.
    stream = fastload.stream(url, cache=cache, block_size="64KiB", memory_limit="1MiB")
    next(iter(stream))
    stream.close()
    del stream
    # The runtime drops the cancelled reads' hold on the source just after close() returns.
    deadline = time.monotonic() + 10
    while leftovers(cache) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert published(cache) == [] and leftovers(cache) == []


def test_a_bad_cache_value_is_a_config_error(served):
    _, url, _ = served
    with pytest.raises(fastload.ConfigError, match="cache"):
        fastload.load(url, cache=3)


LOADER = textwrap.dedent(
    """
    import json, os, resource, signal, sys, time
    import fastload
    url, cache, go = sys.argv[1:4]
    if os.environ.get("FSIZE"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        limit = int(os.environ["FSIZE"])
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    while not os.path.exists(go):
        time.sleep(0.01)
    from test_cache import checksum
    t = fastload.load(url, cache=cache, block_size="64KiB")
    print(checksum(t), json.dumps(fastload.cache_stats()))
    """
)


def checksum(tensors) -> str:
    import hashlib

    import torch

    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def loader(url, cache, go, **env):
    return subprocess.Popen(
        [sys.executable, "-c", LOADER, url, str(cache), str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(TESTS), **env},
    )


def test_two_processes_racing_on_one_object_both_load_and_one_copy_is_published(
    multi_block_file, tmp_path
):
    # Slow bodies, so that both loads are in flight at once.
    server = start_server(
        {"big.safetensors": multi_block_file}, Behaviour(trickle_rate=4 << 20, trickle_from=0)
    )
    try:
        url, cache, go = server.url("big.safetensors"), tmp_path / "cache", tmp_path / "go"
        procs = [loader(url, cache, go) for _ in range(2)]
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
        want = checksum(reference(multi_block_file))
        for p, (out, err) in zip(procs, outs):
            assert p.returncode == 0, err
            assert out.split()[0] == want
        stats = [json.loads(out.split(maxsplit=1)[1]) for out, _ in outs]
        # One filled and published; the other found the lock taken and read the network only.
        assert sorted(s["published"] for s in stats) == [0, 1], stats
        (copy,) = published(cache)
        assert copy.read_bytes() == multi_block_file.read_bytes()
        assert leftovers(cache) == []
    finally:
        server.close()


def test_a_load_killed_midway_publishes_nothing_and_the_next_load_fills_the_copy(
    multi_block_file, tmp_path
):
    behaviour = Behaviour(trickle_rate=512 << 10, trickle_from=0)
    server = start_server({"big.safetensors": multi_block_file}, behaviour)
    try:
        url, cache, go = server.url("big.safetensors"), tmp_path / "cache", tmp_path / "go"
        go.touch()
        proc = loader(url, cache, go)
        deadline = time.monotonic() + 60
        while not leftovers(cache) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert leftovers(cache), "the load never started filling"
        time.sleep(0.5)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
        assert published(cache) == []
        assert not list((cache / "objects").glob("*.json"))
        behaviour.trickle_rate = 0
        got = fastload.load(url, cache=cache)
        assert_same_tensors(got, reference(multi_block_file))
        (copy,) = published(cache)
        assert copy.read_bytes() == multi_block_file.read_bytes()
        assert leftovers(cache) == []
    finally:
        server.close()


def test_a_file_size_limit_stops_caching_with_one_warning_and_the_load_succeeds(
    sharded_dir, tmp_path
):
    files = {f"s/{p.name}": p for p in sorted(sharded_dir.iterdir())}
    server = start_server(files)
    try:
        url, cache, go = (
            server.url("s/model.safetensors.index.json"),
            tmp_path / "c",
            tmp_path / "g",
        )
        go.touch()
        proc = loader(url, cache, go, FSIZE="1000")
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.split()[0] == checksum(reference(*indexed_files(sharded_dir)))
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1, err
        assert "local cache off for this load" in warnings[0]
        assert published(cache) == [] and leftovers(cache) == []
    finally:
        server.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_stops_caching_midway_and_the_load_succeeds(multi_block_file, tmp_path):
    disk = tmp_path / "small"
    disk.mkdir()
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("cannot mount a tmpfs here")
    server = start_server({"big.safetensors": multi_block_file})
    try:
        go = tmp_path / "go"
        go.touch()
        proc = loader(server.url("big.safetensors"), disk, go)
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.split()[0] == checksum(reference(multi_block_file))
        warnings = [line for line in err.splitlines() if "warning" in line]
        assert len(warnings) == 1 and "No space left" in warnings[0], err
        stats = json.loads(out.split(maxsplit=1)[1])
        assert "No space left" in stats["disabled_reason"]
        assert published(disk) == [] and leftovers(disk) == []
    finally:
        server.close()
        subprocess.run(["umount", str(disk)], check=False)


def test_s3_objects_are_cached_by_their_etag(s3_store, sharded_dir, tmp_path, monkeypatch):
    for k, v in s3_store.env().items():
        monkeypatch.setenv(k, v)
    cache = tmp_path / "cache"
    uri = s3_store.uri("sharded/")
    want = reference(*indexed_files(sharded_dir))
    first = fastload.load(uri, cache=cache)
    assert_same_tensors(first, want)
    copies = published(cache)
    assert copies and leftovers(cache) == []
    hits = fastload.cache_stats()["hits"]
    assert_same_tensors(fastload.load(uri, cache=cache), want)
    assert fastload.cache_stats()["hits"] == hits + len(copies)


def test_bench_with_cache_fills_on_the_first_run_and_reads_the_copy_after(served, tmp_path, capfd):
    _, url, _ = served
    argv = ["fastload", "bench", url, "--cache", str(tmp_path / "c"), "--repeat", "3", "--json"]
    assert fastload._fastload.cli_main(argv) == 0
    report = json.loads(capfd.readouterr().out)
    # The first run streams (read into buffers) and fills; the others map the local copy.
    assert [r["method"] for r in report["runs"]] == ["read", "mmap", "mmap"]
    assert len({r["checksum"] for r in report["runs"]}) == 1
    assert len(published(tmp_path / "c")) == 1
    # issue 33: each run says what it read, and each source gets its own verdict: the network
    # beside the ranged GETs, the mapped copy bound by mapping (not by the network).
    assert [r["read_from"] for r in report["runs"]] == ["network", "local_copy", "local_copy"]
    parts = [(m["read_from"], m["best_run"]) for m in report["modes"]["warm"]["by_source"]]
    assert parts[0] == ("network", 1) and parts[1][0] == "local_copy", report["modes"]
    assert report["modes"]["warm"]["by_source"][1]["bound_by"] == "mapping and first touch"
    assert report["modes"]["warm"]["by_source"][0]["limit"] == "ranged_get"
    # The table says so too; the copy is there now, so every run reads it.
    assert fastload._fastload.cli_main(argv[:-1]) == 0
    text = capfd.readouterr().out
    assert f"objects read over the network until a local copy is in {tmp_path / 'c'}" in text
    assert "warm page cache" not in text and "   1  local copy " in text, text


# ---------------------------------------------------------------------------------------------
# A cache directory that cannot be used: one warning that names it and the OS error, and the
# load succeeds from the network.


def one_warning_naming(err: str, cache: Path, *os_errors: str) -> str:
    warnings = [line for line in err.splitlines() if "warning" in line]
    assert len(warnings) == 1, err
    reason = fastload.cache_stats()["disabled_reason"]
    assert reason is not None and str(cache) in reason, reason
    assert any(e in reason for e in os_errors), reason
    assert reason in warnings[0]
    return reason


@pytest.mark.parametrize("kind", ["a file", "under a file", "/dev/null"])
def test_an_unusable_cache_directory_warns_once_and_says_why(served, tmp_path, capfd, kind):
    _, url, want = served
    (tmp_path / "f").write_bytes(b"")
    cache = {"a file": tmp_path / "f", "under a file": tmp_path / "f" / "sub"}.get(
        kind, Path("/dev/null")
    )
    capfd.readouterr()
    assert_same_tensors(fastload.load(url, cache=cache, block_size="64KiB"), want)
    one_warning_naming(capfd.readouterr().err, cache, "Not a directory", "File exists")
    assert (tmp_path / "f").read_bytes() == b""


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_read_only_cache_directory_warns_once_and_says_why(served, tmp_path, capfd):
    _, url, want = served
    disk = tmp_path / "ro"
    disk.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(disk)],
            check=True,
            capture_output=True,
        )
    except (subprocess.CalledProcessError, FileNotFoundError):
        pytest.skip("cannot mount a tmpfs here")
    try:
        capfd.readouterr()
        assert_same_tensors(fastload.load(url, cache=disk), want)
        one_warning_naming(capfd.readouterr().err, disk, "Read-only file system")
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_400_character_etag_is_cached(served, tmp_path):
    server, url, want = served
    server.etags["/m/big.safetensors"] = '"' + "e" * 398 + '"'
    cache = tmp_path / "cache"
    assert_same_tensors(fastload.load(url, cache=cache, block_size="64KiB"), want)
    (copy,) = published(cache)
    assert json.loads(copy.with_suffix(".json").read_text())["etag"] == '"' + "e" * 398 + '"'
    server.behaviour.log.clear()
    assert_same_tensors(fastload.load(url, cache=cache), want)
    assert data_gets(server) == []


def test_a_weak_etag_is_no_identity(tmp_path):
    """W/"x" says "equivalent", not "the same bytes": an object that changed under the same weak
    ETag is read again, never served from a copy."""
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    save_file({"w": torch.zeros(1000)}, str(a))
    save_file({"w": torch.ones(1000)}, str(b))
    assert a.stat().st_size == b.stat().st_size
    server = start_server({"m.safetensors": a})
    try:
        url, cache = server.url("m.safetensors"), tmp_path / "cache"
        server.etags["/m.safetensors"] = 'W/"same"'
        assert_same_tensors(fastload.load(url, cache=cache), reference(a))
        server.put({"m.safetensors": b})
        server.etags["/m.safetensors"] = 'W/"same"'
        assert_same_tensors(fastload.load(url, cache=cache), reference(b))
        assert published(cache) == [] and leftovers(cache) == []
    finally:
        server.close()


def test_a_bad_verify_value_is_a_config_error(served):
    _, url, _ = served
    for bad in (3, "yes", None.__class__):
        with pytest.raises(fastload.ConfigError) as info:
            fastload.load(url, verify=bad)
        assert info.value.option == "verify"
