"""The CUDA engine against the simulated driver (tests/cuda_sim.py): how it opens the driver, binds
contexts, pools page-locked memory, orders its copies, bounds device memory, fails, and behaves
after fork or with no visible device. The one home of the engine's tests; test_cuda_sim.py checks
the simulator itself.

Each process runs on the simulator through `cuda_sim.env`; destinations are host tensors handed
out by an `allocate` callable (the simulator's "device memory" is host memory), so no CUDA build of
torch is needed.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import cuda_sim
import pytest
import torch
from helpers import run_probe
from safetensors.torch import save_file

# A 4 MiB copy takes 500 ms at 8 MiB/s: a stream busy with one runs its later work late.
SLOW = {"FAKE_CUDA_LAG_US": "1000", "FAKE_CUDA_COPY_RATE": str(8 << 20)}

VARIANTS = pytest.mark.parametrize("broken", [False, True], ids=["correct", "broken"])

# A load through the native module into host tensors standing in for device memory.
LOAD = """
import ctypes, time
import torch
from fastload import _fastload

def host_allocate(sizes):
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]

def slow_first_allocate():
    # host_allocate, its first call held up 1.5 s (the copy thread waits, the reads run ahead).
    first = [True]
    def allocate(sizes):
        if first[0]:
            first[0] = False
            time.sleep(1.5)
        return host_allocate(sizes)
    return allocate

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


def _cli_bench(path, env, *options: str) -> subprocess.CompletedProcess:
    """`fastload bench PATH OPTIONS` (the Rust-only path) on the simulator."""
    return subprocess.run(
        [sys.executable, "-m", "fastload._cli", "bench", str(path), *options],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


# ---------------------------------------------------------------------------------------------
# Page-locked staging (issue 13, item 4)


def test_ring_pins_at_most_the_memory_limit_with_small_blocks(fake_cuda, eight_mib, tmp_path):
    # A slow first allocation holds the copy thread while reads fill the whole ring: 256 slots of
    # 4 KiB under a 1 MiB limit (concurrency 128: the ring has 2 x 128 slots at most). Each buffer
    # must count what it pins (a page here, not 64 KiB).
    code = (
        LOAD
        + """
got, stats = load(sys.argv[1], slow_first_allocate(), block_size="4KiB", memory_limit="1MiB",
                  concurrency=128)
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


def test_first_load_pins_a_ring_for_its_reads_not_the_memory_limit(
    fake_cuda, sixteen_mib, tmp_path
):
    # The default 1 GiB limit and 1 MiB blocks, 2 reads at a time, and a copy thread held up by a
    # slow first allocation while the reads run ahead: the ring pins 2 x concurrency buffers (4
    # MiB), not a buffer per block read ahead (all 16 MiB of the file; up to 1 GiB for a bigger
    # one, which the first GPU load of every process paid for at the driver's pinning rate). The
    # second load pins nothing: the buffers stay cached. stats() reports what each load pinned.
    code = (
        LOAD
        + """
from cuda_sim import calls
want = expected(sys.argv[1])
out = []
for allocate in (slow_first_allocate(), host_allocate):
    before = calls().get("cuMemHostAlloc", 0)
    got, stats = load(sys.argv[1], allocate, block_size="1MiB", concurrency=2)
    out.append({"ok": got == want, "pins": calls().get("cuMemHostAlloc", 0) - before,
                "pinned_bytes": stats["pinned_bytes"], "pinned_ms": stats["pinned_ms"],
                "peak": stats["staging_peak_bytes"], "limit": stats["memory_limit"]})
emit(loads=out, cached=fastload.cached_memory()["pinned"])
"""
    )
    log = tmp_path / "log"
    out = run_probe(code, sixteen_mib, env=cuda_sim.env(fake_cuda, log))
    first, second = out["loads"]
    assert first["ok"] and second["ok"], out
    assert first["limit"] == 1 << 30, out
    assert 1 <= first["pins"] <= 4, out
    assert first["pinned_bytes"] == first["pins"] << 20 and first["pinned_ms"] > 0, out
    assert first["peak"] <= 4 << 20, out
    assert second["pins"] == 0 and second["pinned_bytes"] == 0, out
    assert second["pinned_ms"] == 0, out
    assert out["cached"] == first["pins"] << 20, out
    counters = cuda_sim.log(log)
    assert counters["host_allocs"] == first["pins"], counters
    assert counters["pinned_peak"] <= 4 << 20, counters
    assert counters["violations"] == 0, counters


def test_a_first_load_reads_while_its_ring_is_pinned(fake_cuda, sixteen_mib, tmp_path):
    # Pinning slow (8 MiB/s: 128 ms per 1 MiB buffer, one allocation at a time as in the driver),
    # eight reads at a time: one read pins while the others wait for a buffer to come back from
    # its copy or for their turn to pin, so the first tensors arrive while the ring is still
    # being pinned, and the load pins only what its reads got to use. Before, each of the eight
    # reads queued an allocation of its own in the driver: the first tensor came after every one
    # of them had been asked for, and the load ran at the pinning rate until the ring was pinned.
    code = (
        LOAD
        + """
from cuda_sim import calls
want = expected(sys.argv[1])
pins_at_first = []
def allocate(sizes):
    pins_at_first.append(calls().get("cuMemHostAlloc", 0))
    return host_allocate(sizes)
got, stats = load(sys.argv[1], allocate, block_size="1MiB", concurrency=8,
                  memory_limit="16MiB")
emit(ok=got == want, pins=calls().get("cuMemHostAlloc", 0), at_first=pins_at_first[0],
     stats=stats, cached=fastload.cached_memory()["pinned"])
"""
    )
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, FAKE_CUDA_PIN_RATE=str(8 << 20), FAKE_CUDA_LAG_US="200")
    out = run_probe(code, sixteen_mib, env=env)
    stats = out["stats"]
    assert out["ok"], out
    # When the first segment's destinations were asked for (its first block read), at most the
    # first two buffers had been asked of the driver (the second one's pin under way).
    assert out["at_first"] <= 2, out
    # Buffers coming back served the other reads: at most half a buffer per read in flight.
    assert 2 <= out["pins"] <= 4, out
    assert stats["pinned_bytes"] == out["pins"] << 20 == out["cached"], out
    counters = cuda_sim.log(log)
    assert counters["pinned_peak"] <= stats["memory_limit"] == 16 << 20, counters
    assert counters["violations"] == 0, counters
    # Where the time went: the reads' waits for a buffer hold the pinning (one pin at a time,
    # each with a read waiting on it).
    phases = stats["phases_ms"]
    assert set(phases) == {"read", "staging_wait", "ring_wait", "alloc", "copy", "copy_idle",
                           "fence_wait", "consumer_wait", "lend", "unlend"}, phases  # fmt: skip
    assert phases["lend"] == 0, phases  # method="read": nothing lent
    assert phases["staging_wait"] >= stats["pinned_ms"] > 0, stats


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


@pytest.mark.parametrize(("copy_streams", "failing"), [(1, 3), (3, 5)])
def test_failed_fence_wait_fails_the_load_and_retires_its_buffer(
    fake_cuda, eight_mib, tmp_path, copy_streams, failing
):
    # A fence wait fails (one stream: the 3rd; three streams, blocks on each in turn: the 5th,
    # the 2nd block of the 2nd stream): the load ends with the driver's error, and the buffer
    # that block was copied from is never reused nor freed (its copies may still be reading it):
    # after release_memory() exactly that one buffer is still page-locked. Every other buffer
    # came back, none reused on a fence of another stream (the simulator counts a reuse under a
    # pending copy).
    code = (
        LOAD
        + """
import gc
try:
    load(sys.argv[1], block_size="64KiB", memory_limit="1MiB", copy_streams=int(sys.argv[2]))
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
    env = cuda_sim.env(fake_cuda, log, fail=f"cuEventSynchronize:{failing}", **SLOW)
    out = run_probe(code, eight_mib, str(copy_streams), env=env, timeout=120)
    assert out["error"] and "cuEventSynchronize" in out["error"], out
    assert "CUDA_ERROR_UNKNOWN" in out["error"], out
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    assert counters["pinned_now"] == 64 << 10, counters
    assert counters["copy_streams"] == copy_streams, counters


def test_a_copy_stream_that_cannot_be_made_fails_the_load_before_it_reads(
    fake_cuda, eight_mib, tmp_path
):
    # The 3rd stream of a load of four cannot be created: the load fails with the driver's
    # error before anything is pinned or copied, and the streams made are destroyed.
    code = (
        LOAD
        + """
from cuda_sim import calls
try:
    load(sys.argv[1], block_size="64KiB", memory_limit="1MiB", copy_streams=4)
    error = None
except fastload.FastloadError as e:
    error = str(e)
import gc
gc.collect()
emit(error=error, calls=calls())
"""
    )
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, fail="cuStreamCreate:3")
    out = run_probe(code, eight_mib, env=env, timeout=120)
    assert out["error"] and "cuStreamCreate" in out["error"], out
    calls = out["calls"]
    assert calls.get("cuStreamCreate") == calls.get("cuStreamDestroy") == 2, calls
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    assert counters["copies"] == counters["host_allocs"] == 0, counters


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
    # The Rust CLI opens the driver the same way.
    proc = _cli_bench(dtypes_file, env, "--device", "cuda")
    assert proc.returncode == 0, proc.stderr
    assert cuda_sim.log(tmp_path / "log")["violations"] == 0


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
    proc = _cli_bench(dtypes_file, env, "--device", "cuda")
    assert proc.returncode != 0
    assert "no CUDA device is visible" in proc.stderr, proc.stderr
    assert "panicked" not in proc.stderr


# ---------------------------------------------------------------------------------------------
# The pipeline against the simulator's ordering rules: streams, contexts, device memory

PIPELINE = """
import ctypes
from fastload import _fastload
from safetensors.torch import load_file
from cuda_sim import Driver
path, mode, broken = sys.argv[1], sys.argv[2], sys.argv[3] == "broken"
copy_streams = int(sys.argv[4]) if len(sys.argv) > 4 else 1
cu = Driver()
cu.init()
ctx0 = cu.context(0)

def view(addr, n):  # the simulator's device memory, seen from the host
    return torch.frombuffer((ctypes.c_uint8 * max(n, 1)).from_address(addr), dtype=torch.uint8)[:n]

if mode == "consumer-stream":
    # The consumer's stream 0 still has work on the destination memory (a slow memset, as a
    # kernel using memory that the caching allocator hands out again): the allocator returns
    # the stream, and the copies must be ordered after it. The broken consumer says None.
    target = "cuda:0"
    size = max(4 << 20, 2 * os.path.getsize(path))
    cu.bind(ctx0)
    pool = cu.alloc(size)
    cu.bind(None)
    at = [0]
    def allocate(sizes):  # on the copy thread, with the engine's context bound
        if at[0] == 0:
            cu.ok("cuMemsetD8_v2", pool, 0xEE, size)
        out = []
        for n in sizes:
            addr = pool + at[0]
            at[0] += (n + 255) // 256 * 256
            out.append((view(addr, n), addr))
        return (None if broken else 0), out
else:
    # Loading to cuda:1 while the allocator leaves device 0's context current on the calling
    # (copy) thread, as torch's device guard does on a thread whose current device is 0.
    target = "cuda:1"
    def allocate(sizes):
        if broken:
            cu.bind(ctx0)
        ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return None, [(t, t.data_ptr()) for t in ts]

got, error = {}, None
try:
    s = _fastload.Stream([path], target=target, allocate=allocate, block_size="64KiB",
                         memory_limit="1MiB", copy_streams=copy_streams)
    for batch in s:
        for item in batch:
            got[item.name] = item.data
    streams = s.stats().as_dict()["copy_streams"]
except Exception as e:
    error, streams = str(e), None
cu.bind(ctx0)
cu.ok("cuCtxSynchronize")  # the consumer's later work sees what stream 0 left behind
got = {k: bytes(v.numpy()) for k, v in got.items()}
want = {k: bytes(v.reshape(-1).view(torch.uint8).numpy()) for k, v in load_file(path).items()}
emit(error=error, bad=sorted(k for k in want if got.get(k) != want[k]), n=len(got),
     streams=streams)
"""


@VARIANTS
@pytest.mark.parametrize("copy_streams", [1, 3])
def test_pipeline_orders_copies_after_the_consumers_stream(
    fake_cuda, dtypes_file, eight_mib, tmp_path, broken, copy_streams
):
    # With several copy streams, each one's copies wait for the consumer's stream: any block of
    # a segment may be copied on any of them (eight_mib: 128 blocks of 64 KiB).
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, **SLOW)
    mode = "broken" if broken else "correct"
    path = dtypes_file if copy_streams == 1 else eight_mib
    out = run_probe(PIPELINE, path, "consumer-stream", mode, str(copy_streams), env=env)
    assert out["error"] is None and out["streams"] == copy_streams, out
    if broken:
        assert out["bad"], "copies landed before the consumer's stream was done"
    else:
        assert out["bad"] == [] and out["n"] > 0
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    assert counters["copy_streams"] == copy_streams, counters


@pytest.mark.parametrize(
    "broken",
    [False, True],
    ids=["allocator-keeps-context", "allocator-switches-context"],
)
def test_pipeline_rebinds_its_context_after_the_allocator(fake_cuda, dtypes_file, tmp_path, broken):
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, devices=2)
    mode = "broken" if broken else "correct"
    out = run_probe(PIPELINE, dtypes_file, "switch-context", mode, env=env)
    assert out["error"] is None and out["bad"] == [] and out["n"] > 0, out
    assert cuda_sim.log(log)["violations"] == 0


@pytest.mark.parametrize(
    ("devices", "visible", "device"),
    [(2, None, "cuda:1"), (2, "1", "cuda:0"), (3, "2,0", "cuda:1")],
)
def test_cli_bench_on_another_device(fake_cuda, dtypes_file, tmp_path, devices, visible, device):
    # The Rust-only path (driver-allocated destinations) on a device other than the first.
    log = tmp_path / "log"
    options = ["--device", device, "--block-size", "64KiB", "--memory-limit", "1MiB", "--json"]
    proc = _cli_bench(
        dtypes_file, cuda_sim.env(fake_cuda, log, devices=devices, visible=visible), *options
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    counters = cuda_sim.log(log)
    # Every run's bytes, plus the host-to-device limit's copies.
    h2d = report["limits"]["host_to_device"]["bytes"]
    assert counters["bytes"] == report["bytes"] * len(report["runs"]) + h2d, (counters, report)
    assert counters["violations"] == 0 and counters["device_now"] == 0, counters
    assert 0 < counters["device_peak"] and counters["pinned_peak"] <= 1 << 20


@pytest.mark.parametrize("rate_mib", [16, 64])
def test_cli_bench_measures_the_host_to_device_limit(fake_cuda, dtypes_file, tmp_path, rate_mib):
    # issue 16: `--device cuda` reports the page-locked host-to-device copy rate beside the
    # end-to-end rate; the simulator's copies run at FAKE_CUDA_COPY_RATE, which it must follow
    # (a wide factor: this is a shared machine).
    log = tmp_path / "log"
    rate = rate_mib << 20
    env = cuda_sim.env(fake_cuda, log, FAKE_CUDA_COPY_RATE=str(rate))
    options = ["--device", "cuda", "--block-size", "1MiB", "--repeat", "1", "--json"]
    proc = _cli_bench(dtypes_file, env, *options)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    limit = report["limits"]["host_to_device"]
    assert "page-locked host to cuda:0" in limit["what"], limit
    assert rate / 4 <= limit["gb_per_s"] * 1e9 <= rate * 4, (limit, rate)
    warm = report["modes"]["warm"]
    # The lower of the two limits that apply (page-cache copy, host-to-device) is the one named.
    limits = {k: report["limits"][k]["gb_per_s"] for k in ("page_cache", "host_to_device")}
    assert warm["limit"] == min(limits, key=lambda k: limits[k]), report
    assert warm["fraction_of_limit"] == pytest.approx(
        warm["best_gb_per_s"] / warm["limit_gb_per_s"]
    )
    assert cuda_sim.log(log)["violations"] == 0


RUN_AHEAD = """
import gc
from fastload import _fastload
from cuda_sim import Driver
from safetensors.torch import load_file
path, keep, sleep = sys.argv[1], sys.argv[2] == "keep", float(sys.argv[3])
cu = Driver()
cu.init()
stream = _fastload.Stream([path], target="cuda:0", allocate=cu.allocator(0),
                          block_size="64KiB", memory_limit="1MiB")
want = load_file(path)
kept, bad, n = [], [], 0
for batch in stream:
    for item in batch:
        n += 1
        if not torch.equal(item.data, want[item.name].reshape(-1).view(torch.uint8)):
            bad.append(item.name)
        if keep:
            kept.append(item.data)
        time.sleep(sleep)
    del batch, item  # reference counting frees a dropped tensor's device memory at once
del stream, kept
gc.collect()
emit(n=n, bad=bad)
"""


@pytest.fixture(scope="module")
def quarter_mib_tensors(tmp_path_factory):
    """16 MiB: 64 int32 tensors of 256 KiB."""
    import torch
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("run_ahead") / "w.safetensors"
    save_file({f"w{i:02}": torch.full((64 << 10,), i, dtype=torch.int32) for i in range(64)}, path)
    return path


def test_device_memory_of_a_load_that_keeps_everything(fake_cuda, quarter_mib_tensors, tmp_path):
    # The real pipeline into simulated device memory (cuda_sim.Driver.allocator): the log counts
    # every destination byte, and a consumer that keeps every tensor holds all of them at once.
    log = tmp_path / "log"
    out = run_probe(RUN_AHEAD, quarter_mib_tensors, "keep", 0, env=cuda_sim.env(fake_cuda, log))
    assert out == {"n": 64, "bad": []}
    counters = cuda_sim.log(log)
    assert counters["device_peak"] >= 16 << 20
    assert counters["device_now"] == 0 and counters["violations"] == 0, counters


def test_device_memory_run_ahead_is_bounded(fake_cuda, quarter_mib_tensors, tmp_path):
    # A consumer that takes 20 ms a tensor and drops it: fastload's device memory for tensors
    # not yet handed out stays within memory_limit (1 MiB), plus the tensor being consumed.
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log)
    out = run_probe(RUN_AHEAD, quarter_mib_tensors, "drop", 0.02, env=env)
    assert out == {"n": 64, "bad": []}
    counters = cuda_sim.log(log)
    assert counters["device_now"] == 0 and counters["violations"] == 0, counters
    assert counters["device_peak"] <= (1 << 20) + (256 << 10), counters
