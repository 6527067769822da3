"""The CUDA engine against the simulated driver (tests/cuda_sim.py): how it opens the driver, binds
contexts, pools page-locked memory, fails, and behaves after fork or with no visible device.

Each process runs on the simulator through `cuda_sim.env`; destinations are host tensors handed
out by an `allocate` callable (the simulator's "device memory" is host memory), so no CUDA build of
torch is needed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import cuda_sim
import pytest
import torch
from helpers import run_probe
from safetensors.torch import save_file

# A load through the native module into host tensors standing in for device memory.
LOAD = """
import ctypes, time
import torch
from fastload import _fastload

def host_allocate(sizes):
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]

def load(path, allocate=host_allocate, target="cuda:0", **opts):
    s = _fastload.Stream([path], target=target, allocate=allocate, **opts)
    got = {}
    for batch in s:
        for item in batch:
            got[item.name] = item.data.numpy().tobytes()
    stats = s.stats().as_dict()
    s.close()
    return got, stats

def expected(path):
    from safetensors.torch import load_file
    flat = lambda t: t.reshape(-1).view(torch.uint8).numpy().tobytes()
    return {k: flat(v) for k, v in load_file(path).items()}
"""


def _file(tmp_path, name: str, tensors: int, each: int):
    path = tmp_path / name
    g = torch.Generator().manual_seed(tensors * each)
    save_file(
        {
            f"w{i:02d}": torch.randint(0, 255, (each,), dtype=torch.uint8, generator=g)
            for i in range(tensors)
        },
        path,
    )
    return path


@pytest.fixture(scope="module")
def eight_mib(tmp_path_factory):
    return _file(tmp_path_factory.mktemp("eight"), "eight.safetensors", 4, 2 << 20)


@pytest.fixture(scope="module")
def sixteen_mib(tmp_path_factory):
    return _file(tmp_path_factory.mktemp("sixteen"), "sixteen.safetensors", 8, 2 << 20)


# ---------------------------------------------------------------------------------------------
# Page-locked staging (issue 13, item 4)


def test_ring_pins_at_most_the_memory_limit_with_small_blocks(fake_cuda, eight_mib, tmp_path):
    # A slow first allocation holds the copy thread while reads fill the whole ring: 256 slots of
    # 4 KiB under a 1 MiB limit. Each buffer must count what it pins (a page here, not 64 KiB).
    code = (
        LOAD
        + """
first = [True]
def slow_allocate(sizes):
    if first[0]:
        first[0] = False
        time.sleep(1.5)
    return host_allocate(sizes)
got, stats = load(sys.argv[1], slow_allocate, block_size="4KiB", memory_limit="1MiB")
emit(ok=got == expected(sys.argv[1]), stats=stats)
"""
    )
    log = tmp_path / "log"
    out = run_probe(code, eight_mib, env=cuda_sim.env(fake_cuda, log))
    assert out["ok"]
    counters = cuda_sim.log(log)
    assert counters["pinned_peak"] <= 1 << 20, counters
    assert counters["violations"] == 0, counters


def test_block_size_change_reuses_page_locked_buffers(fake_cuda, sixteen_mib, tmp_path):
    # One load with 1 MiB blocks, then three with 256 KiB blocks, all under a 4 MiB limit: the
    # second load replaces the first one's buffers (at most one ring: 16), the next ones reuse
    # them. Without eviction every later block paid cuMemHostAlloc + cuMemFreeHost.
    code = (
        LOAD
        + """
want = expected(sys.argv[1])
ok = []
got, _ = load(sys.argv[1], block_size="1MiB", memory_limit="4MiB")
ok.append(got == want)
for _ in range(3):
    got, _ = load(sys.argv[1], block_size="256KiB", memory_limit="4MiB")
    ok.append(got == want)
emit(ok=ok, cached=fastload.cached_memory())
"""
    )
    log = tmp_path / "log"
    out = run_probe(code, sixteen_mib, env=cuda_sim.env(fake_cuda, log))
    assert out["ok"] == [True] * 4
    assert 0 < out["cached"]["pinned"] <= 4 << 20, out
    counters = cuda_sim.log(log)
    assert counters["host_allocs"] <= 4 + 16, counters
    assert counters["host_frees"] <= 4, counters
    assert counters["pinned_peak"] <= 4 << 20, counters
    assert counters["violations"] == 0, counters


# ---------------------------------------------------------------------------------------------
# Contexts (item 5)


def test_copies_rebind_the_context_after_the_allocator_ran(fake_cuda, dtypes_file, tmp_path):
    # torch runs on the copy thread (the allocator) and may leave another context current there:
    # here it leaves device 1's. The copies, events and waits must still go to cuda:0's context.
    code = (
        LOAD
        + """
driver = ctypes.CDLL("libcuda.so.1")
assert driver.cuInit(0) == 0
dev, ctx1 = ctypes.c_int(), ctypes.c_void_p()
assert driver.cuDeviceGet(ctypes.byref(dev), 1) == 0
assert driver.cuDevicePrimaryCtxRetain(ctypes.byref(ctx1), dev) == 0

def allocate_on_device_1(sizes):
    assert driver.cuCtxSetCurrent(ctx1) == 0
    return host_allocate(sizes)

got, stats = load(sys.argv[1], allocate_on_device_1, block_size="4KiB", memory_limit="1MiB")
emit(ok=got == expected(sys.argv[1]), target=stats["target"])
"""
    )
    log = tmp_path / "log"
    out = run_probe(code, dtypes_file, env=cuda_sim.env(fake_cuda, log, devices=2))
    assert out == {"ok": True, "target": "cuda:0"}
    assert cuda_sim.log(log)["violations"] == 0


# ---------------------------------------------------------------------------------------------
# Fork (item 6)


def test_forked_child_gets_the_fork_error_and_frees_nothing(fake_cuda, dtypes_file, tmp_path):
    code = (
        LOAD
        + """
import json, os
got, _ = load(sys.argv[1], block_size="64KiB", memory_limit="1MiB")
parent_cached = fastload.cached_memory()["pinned"]
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    out = {}
    try:
        out["count"] = _fastload.cuda_device_count()
    except fastload.FastloadError as e:
        out["count_error"] = str(e)
    try:
        load(sys.argv[1], block_size="64KiB", memory_limit="1MiB")
    except fastload.FastloadError as e:
        out["load_error"] = str(e)
    out["cached"] = fastload.cached_memory()["pinned"]
    out["freed"] = fastload.release_memory()["pinned"]
    os.write(w, json.dumps(out).encode())
    os._exit(0)
os.close(w)
child = json.loads(os.read(r, 1 << 16))
os.waitpid(pid, 0)
emit(parent_cached=parent_cached, child=child, still=fastload.cached_memory()["pinned"])
"""
    )
    log = tmp_path / "log"
    out = run_probe(code, dtypes_file, env=cuda_sim.env(fake_cuda, log))
    child = out["child"]
    assert out["parent_cached"] > 0, out
    assert "forked" in child.get("count_error", ""), child
    assert "forked" in child.get("load_error", ""), child
    # The parent's page-locked buffers are not the child's to count or free.
    assert child["cached"] == 0 and child["freed"] == 0, child
    assert out["still"] == out["parent_cached"], out
    assert cuda_sim.log(log)["violations"] == 0


def test_child_of_a_parent_that_initialised_cuda_gets_the_fork_error(
    fake_cuda, dtypes_file, tmp_path
):
    # The parent initialised CUDA without fastload (as torch does); the child's first fastload
    # call is its own cuInit, which the driver refuses after fork.
    code = """
import ctypes, os
from fastload import _fastload
assert ctypes.CDLL("libcuda.so.1").cuInit(0) == 0
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        _fastload.cuda_device_count()
        message = "no error"
    except fastload.FastloadError as e:
        message = str(e)
    os.write(w, message.encode())
    os._exit(0)
os.close(w)
message = os.read(r, 1 << 16).decode()
os.waitpid(pid, 0)
emit(message=message, parent=_fastload.cuda_device_count())
"""
    out = run_probe(code, dtypes_file, env=cuda_sim.env(fake_cuda, tmp_path / "log"))
    assert "forked" in out["message"] and "spawn" in out["message"], out
    assert out["parent"] == 1


# ---------------------------------------------------------------------------------------------
# Failures (item 7)


def test_failed_fence_wait_fails_the_load_and_retires_its_buffer(fake_cuda, eight_mib, tmp_path):
    # The 3rd fence wait fails: the load ends with the driver's error, and the buffer that block
    # was copied from is never reused nor freed (its copies may still be reading it): after
    # release_memory() exactly that one buffer is still page-locked.
    code = (
        LOAD
        + """
import gc
try:
    load(sys.argv[1], block_size="64KiB", memory_limit="1MiB")
    error = None
except fastload.FastloadError as e:
    error = str(e)
gc.collect()
time.sleep(0.2)
fastload.release_memory()
emit(error=error)
"""
    )
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, fail="cuEventSynchronize:3")
    out = run_probe(code, eight_mib, env=env, timeout=120)
    assert out["error"] and "cuEventSynchronize" in out["error"], out
    assert "CUDA_ERROR_UNKNOWN" in out["error"], out
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    assert counters["pinned_now"] == 64 << 10, counters


def _build_without(out_dir, symbol: str):
    """The simulator with `symbol` hidden from its dynamic symbol table (an older or foreign
    driver that lacks an entry point)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out_dir.mkdir()
    script = out_dir / "hide.map"
    script.write_text(f"{{ global: *; local: {symbol}; }};\n")
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            "-O1",
            f"-Wl,--version-script={script}",
            "-o",
            str(out_dir / "libcuda.so.1"),
            str(cuda_sim.SOURCES / "fake_cuda.c"),
            "-lpthread",
        ],
        check=True,
    )
    (out_dir / "libcuda.so").symlink_to("libcuda.so.1")
    return out_dir


def test_missing_entry_point_is_an_error_not_a_silent_stop(dtypes_file, tmp_path):
    # cudarc resolved each symbol on first use and panicked there, on the copy thread: the load
    # stopped without a cause. Every entry point is resolved when the driver is opened.
    lib = _build_without(tmp_path / "old", "cuStreamWaitEvent")
    code = (
        LOAD
        + """
def allocate_after_default_stream(sizes):  # stream 0: orders the copies after its work
    _, dst = host_allocate(sizes)
    return 0, dst
try:
    load(sys.argv[1], allocate_after_default_stream)
    error = None
except fastload.FastloadError as e:
    error = str(e)
emit(error=error)
"""
    )
    out = run_probe(code, dtypes_file, env=cuda_sim.env(lib, tmp_path / "log"), timeout=60)
    assert out["error"] and "cuStreamWaitEvent" in out["error"], out


def test_toolkit_stub_on_the_library_path_does_not_shadow_the_driver(
    fake_cuda, stub_cuda, dtypes_file, tmp_path
):
    # cuda/lib64/stubs has libcuda.so (cuInit: CUDA_ERROR_STUB_LIBRARY) and no libcuda.so.1; the
    # driver's own name is libcuda.so.1, which torch's runtime opens too.
    code = (
        LOAD
        + """
got, stats = load(sys.argv[1])
emit(ok=got == expected(sys.argv[1]), target=stats["target"])
"""
    )
    env = cuda_sim.env(fake_cuda, tmp_path / "log")
    env["LD_LIBRARY_PATH"] = f"{stub_cuda}:{env['LD_LIBRARY_PATH']}"
    out = run_probe(code, dtypes_file, env=env)
    assert out == {"ok": True, "target": "cuda:0"}


# ---------------------------------------------------------------------------------------------
# No visible device (item 8)


def test_no_visible_device_is_a_clear_error(fake_cuda, dtypes_file, tmp_path):
    code = (
        LOAD
        + """
out = {}
try:
    _fastload.cuda_device_count()
except fastload.FastloadError as e:
    out["count"] = str(e)
try:
    load(sys.argv[1])
except fastload.FastloadError as e:
    out["load"] = str(e)
emit(**out)
"""
    )
    env = cuda_sim.env(fake_cuda, tmp_path / "log", visible="")
    out = run_probe(code, dtypes_file, env=env)
    for where in ("count", "load"):
        assert "no CUDA device is visible" in out.get(where, ""), out
        assert "CUDA_VISIBLE_DEVICES" in out[where], out
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "bench", str(dtypes_file), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode != 0
    assert "no CUDA device is visible" in proc.stderr, proc.stderr
    assert "panicked" not in proc.stderr
