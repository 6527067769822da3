"""The GPU path, in four layers:

- without a driver (CI): ``device="cuda"`` raises a clear ``FastloadError``, CPU loads go on, and
  nothing loads libcuda at import or for CPU loads;
- the staged pipeline into host memory (the "host" copy engine): the same ring, copy and
  completion code as CUDA, checked bitwise for every dtype, tensors larger than a block, and
  the host-memory bound;
- the simulated driver (tests/fake_cuda/fake_cuda.c, see cuda_sim.py): the real CUDA engine
  (its driver loading, the probe, contexts per thread, page-locked staging, async copies run late
  on the simulator's thread) with host memory standing in for the device;
- ``gpu``-marked tests for a real driver and device, skipped elsewhere.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import cuda_sim
import fastload
import pytest
import torch
from helpers import assert_same_tensor, raw_bytes, reference, run_probe, staged_stream_bitwise

# ---------------------------------------------------------------------------------------------
# No driver


def _has_driver() -> bool:
    try:
        fastload._fastload.cuda_device_count()
    except fastload.FastloadError:
        return False
    return True


no_driver = pytest.mark.skipif(_has_driver(), reason="a CUDA driver is present")
# No usable device: no driver at all, or one with no visible device (CUDA_VISIBLE_DEVICES="").
NO_CUDA = "CUDA driver not found|no CUDA device is visible"


@no_driver
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 1)])
def test_cuda_without_a_driver_is_a_clear_error(dtypes_file, device):
    with pytest.raises(fastload.FastloadError, match=NO_CUDA) as info:
        fastload.load(dtypes_file, device=device)
    assert not isinstance(info.value, (ValueError, OSError))
    # Nothing is left behind: the same process loads to CPU as before.
    got = fastload.load(dtypes_file)
    want = reference(dtypes_file)
    for name, ref in want.items():
        assert_same_tensor(got[name], ref, name)


@no_driver
def test_cli_bench_cuda_without_a_driver(dtypes_file):
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "bench", str(dtypes_file), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode != 0
    assert re.search(NO_CUDA, proc.stderr), proc.stderr
    assert "panicked" not in proc.stderr


def test_gpu_options_are_checked_before_the_driver(dtypes_file):
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(dtypes_file, device="cuda", method="mapped")
    assert info.value.option == "method"
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(dtypes_file, device="mps")
    assert info.value.option == "device"


# ---------------------------------------------------------------------------------------------
# The staged pipeline into host memory


def _staged(path, **kw) -> fastload.Stream:
    return fastload.Stream(path, _target="host", **kw)


def test_staged_parity_every_dtype(dtypes_file):
    stats = staged_stream_bitwise(dtypes_file, _target="host", block_size="4KiB",
                                  memory_limit="1MiB")  # fmt: skip
    assert stats["target"] == "host"
    assert (stats["method"], stats["block_size"], stats["memory_limit"]) == ("read", 4096, 1 << 20)


def test_staged_block_is_at_most_half_the_memory_limit(dtypes_file):
    # Two staging buffers at least: an 8 MiB block under a 1 MiB limit stages 512 KiB at a time.
    with _staged(dtypes_file, block_size="8MiB", memory_limit="1MiB") as s:
        got = dict(s)
        stats = s.stats()
    assert stats["block_size"] == 512 << 10
    assert sorted(got) == sorted(reference(dtypes_file))


def test_staged_big_tensors_in_pieces_within_the_memory_limit(gil_file):
    # One 512 MiB tensor through 1 MiB of staging: 2048 pieces, host memory bounded by the ring.
    with _staged(gil_file, block_size="256KiB", memory_limit="1MiB") as s:
        got = dict(s)
        stats = s.stats()
    assert stats["staging_peak_bytes"] <= 1 << 20
    assert stats["bytes_copied"] == stats["total_bytes"] == 512 << 20
    want = reference(gil_file)
    for name, ref in want.items():
        assert torch.equal(raw_bytes(got[name]), raw_bytes(ref)), name


def test_staged_names_and_shards(sharded_dir):
    want = reference(*sorted(sharded_dir.glob("*.safetensors")))
    names = sorted(want)[::2]
    got = dict(_staged(sharded_dir, names=names, concurrency=2, block_size="4KiB"))
    assert sorted(got) == names
    for name in names:
        assert_same_tensor(got[name], want[name], name)


def test_staged_close_midway_keeps_delivered_tensors(big_file):
    s = _staged(big_file, block_size="1MiB", memory_limit="8MiB")
    first = [next(s) for _ in range(3)]
    s.close()
    want = reference(big_file)
    for name, t in first:
        assert torch.equal(t, want[name]), name


def test_staged_tiny_tensors(tiny_file):
    got = dict(_staged(tiny_file))
    want = reference(tiny_file)
    assert len(got) == len(want)
    for name in list(want)[:: max(1, len(want) // 500)]:
        assert_same_tensor(got[name], want[name], name)


def test_allocator_exception_propagates(dtypes_file):
    class Boom(RuntimeError):
        pass

    def allocate(sizes):
        raise Boom("no memory for you")

    s = fastload._fastload.Stream([str(dtypes_file)], target="host", allocate=allocate)
    with pytest.raises(Boom, match="no memory for you"):
        list(s)


# ---------------------------------------------------------------------------------------------
# A fake libcuda


FAKE_LOAD = """
import fastload, torch
from fastload import _fastload, _torch
from safetensors.torch import load_file
path, device, block, limit = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]

def allocate(sizes):  # host tensors stand in for device memory
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]

got, runs = {}, []
for _ in range(2):  # the second load reuses the page-locked ring of the first
    s = _fastload.Stream([path], target=device, allocate=allocate, block_size=block,
                         memory_limit=limit)
    for batch in s:
        for item in batch:
            got[item.name] = _torch.from_bytes(item.dtype, item.shape, item.data, path)
    runs.append(s.stats().as_dict())
want = load_file(path)
def same(a, b):
    flat = lambda t: t.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))
bad = [n for n in want if not same(want[n], got[n])]
maps = open("/proc/self/maps").read()
emit(bad=bad, n=len(got), stats=runs[-1], libcuda="libcuda.so" in maps)
"""


def test_fake_driver_parity_and_bounds(fake_cuda, dtypes_file, gil_file, tmp_path):
    for path, block, limit in [(dtypes_file, "4KiB", "1MiB"), (gil_file, "1MiB", "4MiB")]:
        log = tmp_path / "log"
        out = run_probe(FAKE_LOAD, path, "cuda:0", block, limit, env=cuda_sim.env(fake_cuda, log))
        assert out["bad"] == [] and out["n"] == len(reference(path))
        assert out["stats"]["target"] == "cuda:0"
        assert out["libcuda"]
        counters = cuda_sim.log(log)
        assert counters["violations"] == 0, counters
        # Page-locked memory: the ring only, allocated once and reused by the second load.
        assert counters["pinned_peak"] <= fastload._fastload.parse_size(limit)
        assert counters["bytes"] == 2 * out["stats"]["total_bytes"]


def test_fake_driver_release_memory(fake_cuda, dtypes_file, tmp_path):
    # The page-locked ring stays cached after a GPU load until release_memory() hands it back to
    # the driver (in its context, from a thread that never used CUDA); the next load pins again.
    # Neither the load nor the release leaves a context current on the caller's thread.
    code = """
import threading
def allocate(sizes):
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]
def run():
    s = _fastload.Stream([sys.argv[1]], target="cuda:0", allocate=allocate,
                         block_size="64KiB", memory_limit="1MiB")
    return sum(len(batch) for batch in s)
import ctypes, torch
from fastload import _fastload
n = run()
cached = fastload.cached_memory()
driver = ctypes.CDLL("libcuda.so.1")
def current():
    ctx = ctypes.c_void_p()
    driver.cuCtxGetCurrent(ctypes.byref(ctx))
    return ctx.value
loaded_here = current()  # the consumer's thread: no context before, none after the load
out = {}
def release():  # a thread without a current context keeps none
    out.update(freed=fastload.release_memory(), ctx=current())
t = threading.Thread(target=release)
t.start(); t.join()
emptied = fastload.cached_memory()
n2 = run()
again = fastload.cached_memory()
fastload.release_memory()
emit(n=[n, n2], cached=cached, freed=out["freed"], ctx=[loaded_here, out["ctx"], current()],
     emptied=emptied, again=again)
"""
    log = tmp_path / "log"
    out = run_probe(code, dtypes_file, env=cuda_sim.env(fake_cuda, log))
    assert out["n"] == [len(reference(dtypes_file))] * 2
    assert 0 < out["cached"]["pinned"] <= 1 << 20, out
    assert out["freed"]["pinned"] == out["cached"]["pinned"], out
    # torch's current device follows a thread's current context: fastload leaves it alone.
    assert out["ctx"] == [None, None, None], out
    assert out["emptied"]["pinned"] == 0 and out["again"]["pinned"] > 0, out
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    assert counters["pinned_now"] == 0, counters


def test_fake_driver_missing_device(fake_cuda, dtypes_file, tmp_path):
    code = """
try:
    fastload.load(sys.argv[1], device="cuda:2")
except fastload.ConfigError as e:
    emit(error=str(e))
"""
    out = run_probe(code, dtypes_file, env=cuda_sim.env(fake_cuda, tmp_path / "log", devices=2))
    assert "cuda:2 does not exist" in out["error"] and "2 CUDA device" in out["error"]


def test_no_cuda_at_import_or_for_cpu_loads(fake_cuda, dtypes_file, tmp_path):
    # Fork safety: with a driver available, importing fastload and reading to host memory leave
    # CUDA untouched; only a GPU load (here: its device count) loads the driver. (torch itself is
    # left out: importing it maps libcuda.)
    code = """
import sys, json
def mapped():
    return "libcuda.so" in open("/proc/self/maps").read()
import fastload
seen = [mapped()]
for batch in fastload._fastload.Stream([sys.argv[1]]):
    pass
seen.append(mapped())
fastload._fastload.cuda_device_count()
seen.append(mapped())
print(json.dumps(seen))
"""
    env = cuda_sim.env(fake_cuda, tmp_path / "log")
    proc = subprocess.run(
        [sys.executable, "-c", code, str(dtypes_file)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [False, False, True]


def test_fake_driver_cli_bench(fake_cuda, gil_file, tmp_path):
    log = tmp_path / "log"
    argv = ["bench", str(gil_file), "--device", "cuda", "--repeat", "2", "--block-size", "1MiB",
            "--memory-limit", "8MiB", "--json"]  # fmt: skip
    proc = cuda_sim.run_cli(fake_cuda, log, *argv)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["bytes"] == 512 << 20 and len(report["runs"]) == 2
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    # Both runs' bytes, plus the copies that measured the host-to-device limit.
    limit = report["limits"]["host_to_device"]
    assert limit["gb_per_s"] > 0
    assert counters["bytes"] == 2 * (512 << 20) + limit["bytes"]
    assert counters["pinned_peak"] <= 8 << 20


# ---------------------------------------------------------------------------------------------
# A real GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("device", ["cuda", "cuda:0", torch.device("cuda", 0)])
def test_cuda_parity_every_dtype(dtypes_file, device):
    got = fastload.load(dtypes_file, device=device)
    assert {t.device for t in got.values()} == {torch.device("cuda", 0)}
    want = reference(dtypes_file)
    for name, ref in want.items():
        assert_same_tensor(got[name].cpu(), ref, name)


@pytest.mark.gpu
@gpu
def test_cuda_every_device(dtypes_file):
    want = reference(dtypes_file)
    for i in range(torch.cuda.device_count()):
        got = fastload.load(dtypes_file, device=f"cuda:{i}")
        assert {t.device for t in got.values()} == {torch.device("cuda", i)}
        for name, ref in want.items():
            assert_same_tensor(got[name].cpu(), ref, name)


@pytest.mark.gpu
@gpu
def test_cuda_memory_bounds_and_torch_accounting(gil_file):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(0)
    with fastload.stream(gil_file, device="cuda", block_size="1MiB", memory_limit="16MiB") as s:
        got = dict(s)
        stats = s.stats()
    assert stats["staging_peak_bytes"] <= 16 << 20
    # torch's allocator owns the tensors: it accounts for every byte.
    assert torch.cuda.memory_allocated(0) - before >= 512 << 20
    want = reference(gil_file)
    for name, ref in want.items():
        assert torch.equal(got[name].cpu(), ref), name


@pytest.mark.gpu
@gpu
def test_cuda_tensors_usable_on_another_stream(dtypes_file):
    # load() on the current (default) stream: the tensors' memory belongs to that stream. Used on
    # another stream, torch's rules apply: that stream waits for the current one before reading,
    # and record_stream keeps the memory from being handed out again while it may still read.
    want = reference(dtypes_file)
    got = fastload.load(dtypes_file, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(100_000_000)  # the side stream reads late, after the frees below
        copies = {}
        for name, t in got.items():
            t.record_stream(side)
            copies[name] = t.reshape(-1).view(torch.uint8).clone()
    del got, t  # (the loop's last tensor too) freed while `side` has not read them yet
    # Fresh memory on the current stream, overwritten at once: it must not be theirs.
    junk = [
        torch.full((c.numel(),), 0xEE, dtype=torch.uint8, device="cuda") for c in copies.values()
    ]
    side.synchronize()
    for name, ref in want.items():
        assert copies[name].device == torch.device("cuda", 0), name
        assert torch.equal(copies[name].cpu(), raw_bytes(ref)), name
    del junk


@pytest.mark.gpu
@gpu
def test_cuda_load_overlaps_reads_and_copies(tmp_path):
    # 2 GiB, warm cache: the load should take about the slower leg, not the sum of both.
    from safetensors.torch import save_file

    path = tmp_path / "two.safetensors"
    save_file({f"w{i}": torch.full((64 << 20,), i, dtype=torch.int32) for i in range(8)}, path)
    fastload.load(path, method="read")  # warm the page cache
    t0 = time.perf_counter()
    fastload.load(path, method="read")
    read_s = time.perf_counter() - t0
    host = torch.empty(2 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    copy_s = time.perf_counter() - t0
    del host, dev
    fastload.load(path, device="cuda")  # pins the ring once per process
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fastload.load(path, device="cuda")
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    assert total <= 1.35 * max(read_s, copy_s) + 0.25, (total, read_s, copy_s)
