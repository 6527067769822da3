"""Loads with ``method="direct"``: blocks that are not in the page cache are read around it
(``O_DIRECT``) straight into the page-locked staging buffers (to CPU: the pooled buffers), with
no copy out of the page cache; cached blocks are copied out of it as ``method="read"`` does; a
file that cannot be read that way has the rest of the load read through the page cache, and
``stats()["direct_refused"]`` says why. To a GPU on the simulated driver
(tests/fake_cuda/fake_cuda.c: copies only from page-locked memory it handed out) and
``gpu``-marked on a real device (the GPU kit runs it); to CPU as it is.
"""

from __future__ import annotations

import json

import cuda_sim
import fastload
import pytest
import torch
from helpers import (
    assert_same_tensor,
    cached_bytes,
    cuda_stream_bitwise,
    evict,
    reference,
    run_probe,
)
from safetensors.torch import save_file

LOAD = """
import fastload, torch
from fastload import _fastload, _torch
from safetensors.torch import load_file
uri, ref, block, limit, method = sys.argv[1:6]

def allocate(sizes):  # host tensors stand in for device memory
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]

got = {}
s = _fastload.Stream([uri], target="cuda:0", allocate=allocate, block_size=block,
                     memory_limit=limit, method=method, concurrency=4)
for batch in s:
    for item in batch:
        got[item.name] = _torch.from_bytes(item.dtype, item.shape, item.data, uri)
def same(a, b):
    flat = lambda t: t.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))
import os
from helpers import cached_bytes  # beside cuda_sim
# What the load left in the page cache past its first block, before the reference is read.
cached = cached_bytes(uri, 4 << 20) if os.path.exists(uri) else None
want = load_file(ref)  # after the load: reading it fills the page cache
bad = [n for n in want if n not in got or not same(want[n], got[n])]
emit(bad=bad, stats=s.stats().as_dict(), cached=cached)
"""

MiB = 1 << 20


@pytest.fixture(scope="module")
def cold_file(tmp_path_factory):
    """About 13 MiB whose tensors start and end inside pages, over three 4 MiB blocks and more."""
    g = torch.Generator().manual_seed(7)
    tensors = {
        "a": torch.randint(0, 255, (3,), dtype=torch.uint8, generator=g),
        "b": torch.randn(1_000_003, generator=g),
        "c": torch.randn(7, 333, generator=g).to(torch.bfloat16),
        "empty": torch.empty(0, 5),
        "d": torch.randint(-(2**31), 2**31 - 1, (2_200_001,), dtype=torch.int32, generator=g),
    }
    path = tmp_path_factory.mktemp("direct") / "cold.safetensors"
    save_file(tensors, str(path))
    return path


def _load(fake_cuda, tmp_path, uri, ref, block="4MiB", limit="16MiB", method="direct"):
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log)
    out = run_probe(LOAD, uri, ref, block, limit, method, env=env)
    return out, cuda_sim.log(log)


def test_direct_reads_a_cold_file_around_the_page_cache(fake_cuda, cold_file, tmp_path):
    evict(cold_file)
    out, counters = _load(fake_cuda, tmp_path, str(cold_file), str(cold_file))
    assert out["bad"] == []
    stats = out["stats"]
    assert stats["method"] == "direct" and "O_DIRECT" in stats["method_reason"], stats
    assert stats["direct_refused"] is None, stats
    # The header's read brings the first pages in (and the kernel's read-ahead with it), so
    # the first block is partly cached: not all of it, so it too is read around the cache.
    assert stats["direct_bytes"] == stats["total_bytes"] == stats["bytes_copied"], stats
    assert counters["violations"] == 0, counters
    # Around the page cache: past what the header's read brought in, nothing of the file is.
    assert out["cached"] == 0, out["cached"]


def test_direct_copies_a_warm_file_out_of_the_page_cache(fake_cuda, cold_file, tmp_path):
    cold_file.read_bytes()  # every page cached
    before = cached_bytes(cold_file)
    out, counters = _load(fake_cuda, tmp_path, str(cold_file), str(cold_file))
    assert out["bad"] == []
    stats = out["stats"]
    assert stats["method"] == "direct" and stats["direct_refused"] is None, stats
    assert stats["bytes_copied"] == stats["total_bytes"]
    # A kernel that cannot say what is cached (before Linux 6.5) reads every block around it.
    cached = f"{before} of {cold_file.stat().st_size} bytes cached before the load"
    assert stats["direct_bytes"] in (0, stats["total_bytes"]), (cached, stats)
    assert counters["violations"] == 0, counters


def test_objects_are_read_through_the_page_cache(fake_cuda, http_store, dtypes_file, tmp_path):
    uri = http_store.uri("all.safetensors")
    out, counters = _load(fake_cuda, tmp_path, uri, str(dtypes_file), block="4KiB", limit="1MiB")
    assert out["bad"] == []
    stats = out["stats"]
    assert stats["direct_bytes"] == 0
    assert "not a local file" in stats["direct_refused"], stats
    assert uri in stats["direct_refused"], stats
    assert stats["bytes_copied"] == stats["total_bytes"]
    assert counters["violations"] == 0, counters


@pytest.mark.parametrize("block", ["8MiB", "64KiB"])
def test_cpu_loads_read_a_cold_file_around_the_page_cache(cold_file, block):
    # Into pooled buffers that sit in their allocation as each segment sits in the file's
    # pages: a block's span may reach before the segment (its first) or past it (its last).
    evict(cold_file)
    with fastload.stream(cold_file, method="direct", block_size=block) as s:
        got = dict(s)
        stats = s.stats()
    past_first_block = cached_bytes(cold_file, 4 * MiB)
    assert stats["method"] == "direct" and "O_DIRECT" in stats["method_reason"], stats
    assert stats["direct_refused"] is None, stats
    # Blocks inside the header's read (256 KiB, read without read-ahead) are copied out of the
    # page cache; every other one went around it.
    assert stats["total_bytes"] - stats["direct_bytes"] <= 256 << 10, stats
    assert past_first_block == 0, past_first_block
    want = reference(cold_file)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert_same_tensor(got[name], ref, name)


def test_cpu_loads_copy_a_warm_file_out_of_the_page_cache(cold_file):
    cold_file.read_bytes()
    with fastload.stream(cold_file, method="direct") as s:
        got = dict(s)
        stats = s.stats()
    # A kernel that cannot say what is cached (before Linux 6.5) reads every block around it.
    assert stats["direct_bytes"] in (0, stats["total_bytes"]), stats
    for name, ref in reference(cold_file).items():
        assert_same_tensor(got[name], ref, name)


def test_a_block_size_off_the_page_grid_reads_through_the_page_cache(cold_file):
    evict(cold_file)
    with fastload.stream(cold_file, method="direct", block_size=1_000_000) as s:
        got = dict(s)
        stats = s.stats()
    assert stats["method"] == "read" and "not whole pages" in stats["method_reason"], stats
    for name, ref in reference(cold_file).items():
        assert_same_tensor(got[name], ref, name)


def test_cpu_loads_of_objects_are_read_through_the_page_cache(http_store, dtypes_file):
    uri = http_store.uri("all.safetensors")
    with fastload.stream(uri, method="direct", block_size="4KiB") as s:
        got = dict(s)
        stats = s.stats()
    assert stats["direct_bytes"] == 0
    assert "not a local file" in stats["direct_refused"], stats
    for name, ref in reference(dtypes_file).items():
        assert_same_tensor(got[name], ref, name)


def test_a_file_cut_short_before_its_direct_reads_is_an_error(tmp_path, cold_file):
    # The header is read, then the file loses its tail: the reads fail, never zeros.
    path = tmp_path / "cut.safetensors"
    path.write_bytes(cold_file.read_bytes())
    s = fastload.stream(
        path, method="direct", block_size="64KiB", concurrency=1, memory_limit="1MiB"
    )
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 4096)
    evict(path)
    with pytest.raises(fastload.FastloadError) as info, s:
        for _ in s:
            pass
    assert "truncated" in str(info.value) and str(path) in str(info.value)


def test_cli_bench_reads_around_the_page_cache_with_method_direct(fake_cuda, gil_file, tmp_path):
    log = tmp_path / "log"
    argv = ["bench", str(gil_file), "--device", "cuda", "--method", "direct", "--repeat", "1",
            "--cold", "--block-size", "4MiB", "--memory-limit", "32MiB", "--json"]  # fmt: skip
    proc = cuda_sim.run_cli(fake_cuda, log, *argv)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    runs = [(r["cache"], r["method"], r.get("direct_refused")) for r in report["runs"]]
    assert runs == [("cold", "direct", None)], report["runs"]
    assert cuda_sim.log(log)["violations"] == 0
    assert cached_bytes(gil_file, 4 * MiB) == 0


def test_an_unknown_method_names_direct_among_the_choices(dtypes_file):
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(dtypes_file, method="o_direct")
    assert "direct" in str(info.value)


# ---------------------------------------------------------------------------------------------
# A real GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@gpu
def test_cuda_direct_loads_a_cold_file_bitwise(cold_file, gil_file):
    for path, block, limit in [(cold_file, "4MiB", "16MiB"), (gil_file, "8MiB", "64MiB")]:
        evict(path)
        # Where the file cannot leave the page cache (tmpfs), every block is a cached one.
        evicted = cached_bytes(path) == 0
        stats = cuda_stream_bitwise(path, method="direct", block_size=block, memory_limit=limit)
        if stats["direct_refused"] is not None:
            print(f"direct reads refused here: {stats['direct_refused']}")
        elif evicted:
            assert stats["direct_bytes"] == stats["total_bytes"], stats
        else:
            assert stats["direct_bytes"] == 0, stats
