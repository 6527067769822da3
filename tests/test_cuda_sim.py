"""The simulated CUDA driver's rules (tests/fake_cuda/fake_cuda.c), each shown twice with a small
pipeline driven through ctypes: written correctly it gives the right bytes (or succeeds), and the
deliberately broken variant shows what the simulator catches (stale or wrong bytes, the driver's
error, a counted violation). Each pipeline runs in its own process on the simulator (see
cuda_sim.py), without torch.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import cuda_sim
import pytest

TESTS = Path(__file__).resolve().parent

PRELUDE = f"""
import json, os, sys
sys.path.insert(0, {str(TESTS)!r})
from cuda_sim import Driver, DriverError
cu = Driver(os.environ.get("SIM_LIBRARY", "libcuda.so.1"))
broken = sys.argv[1:] == ["broken"]
def emit(**kw):
    print("RESULT " + json.dumps(kw), flush=True)
def start(ordinal=0):
    cu.init()
    ctx = cu.context(ordinal)
    cu.bind(ctx)
    return ctx
"""

# A late copy is late by far more than the time between its queueing and the host's read, so a
# read that skips its wait sees the old bytes whatever the machine's load.
LATE = {"FAKE_CUDA_LAG_US": "300000"}
# A 4 MiB copy takes 500 ms at 8 MiB/s: a stream busy with one runs its later work late.
SLOW = {"FAKE_CUDA_LAG_US": "1000", "FAKE_CUDA_COPY_RATE": str(8 << 20)}

VARIANTS = pytest.mark.parametrize("broken", [False, True], ids=["correct", "broken"])


class Run:
    def __init__(self, out: dict, stderr: str, counters: dict[str, int]):
        self.out, self.stderr, self.counters = out, stderr, counters

    @property
    def violations(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if ln.startswith("fake_cuda: violation:")]


def run(lib: Path, tmp_path: Path, code: str, broken: bool = False, **env_kw) -> Run:
    log = tmp_path / "log"
    log.unlink(missing_ok=True)
    env = cuda_sim.env(lib, log, **env_kw)
    args = ["broken"] if broken else []
    proc = subprocess.run(
        [sys.executable, "-c", PRELUDE + code, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    counters = cuda_sim.log(log) if log.exists() else {}
    return Run(json.loads(lines[-1][len("RESULT ") :]), proc.stderr, counters)


def _pattern(n: int, seed: int) -> bytes:
    return bytes((i * 7 + seed) % 251 + 1 for i in range(n))


# ---------------------------------------------------------------------------------------------
# Late, asynchronous execution


@VARIANTS
def test_reading_before_the_copy_fence_sees_stale_bytes(fake_cuda, tmp_path, broken):
    # pinned staging -> async copy on a non-blocking stream -> event -> wait -> read back.
    code = """
start()
n = 4096
data = bytes(range(1, 256)) * 17
src, dst = cu.pinned(n), cu.alloc(n)
cu.ok("cuMemsetD8_v2", dst, 0, n)  # what the consumer would see before the copy
cu.ok("cuCtxSynchronize")
cu.write(src, data[:n])
stream, done = cu.stream(), cu.event()
cu.ok("cuMemcpyHtoDAsync_v2", dst, src, n, stream)
cu.ok("cuEventRecord", done, stream)
if not broken:
    cu.ok("cuEventSynchronize", done)
got = cu.read(dst, n)
cu.ok("cuEventSynchronize", done)
emit(right=got == data[:n], zeros=got == bytes(n))
"""
    r = run(fake_cuda, tmp_path, code, broken, **LATE)
    if broken:
        assert r.out == {"right": False, "zeros": True}
    else:
        assert r.out == {"right": True, "zeros": False}
    assert r.counters["copies"] == 1 and r.counters["bytes"] == 4096
    assert r.counters["violations"] == 0


@VARIANTS
def test_reusing_staging_before_its_fence_sends_the_new_bytes(fake_cuda, tmp_path, broken):
    code = """
start()
n = 4096
a, b = bytes([0xAA]) * n, bytes([0xBB]) * n
staging, first, second = cu.pinned(n), cu.alloc(n), cu.alloc(n)
stream, fence = cu.stream(), cu.event()
cu.write(staging, a)
cu.ok("cuMemcpyHtoDAsync_v2", first, staging, n, stream)
cu.ok("cuEventRecord", fence, stream)
if not broken:
    cu.ok("cuEventSynchronize", fence)  # staging may be rewritten once its copy ran
cu.write(staging, b)
cu.ok("cuMemcpyHtoDAsync_v2", second, staging, n, stream)
cu.ok("cuStreamSynchronize", stream)
emit(first=cu.read(first, n).hex()[:4], second=cu.read(second, n).hex()[:4])
"""
    r = run(fake_cuda, tmp_path, code, broken, **LATE)
    assert r.out == {"first": "bbbb" if broken else "aaaa", "second": "bbbb"}
    assert r.counters["violations"] == 0


# ---------------------------------------------------------------------------------------------
# Ordering between streams


@VARIANTS
def test_missing_stream_wait_reads_before_the_producer_wrote(fake_cuda, tmp_path, broken):
    # A producer stream fills device memory (4 MiB: busy for 500 ms); the copy stream copies it
    # out after the producer's event, which cuStreamWaitEvent orders; without it the copy runs
    # first.
    code = """
start()
n, head = 4 << 20, 4096
src, dev, out = cu.pinned(n), cu.alloc(n), cu.pinned(head)
cu.write(src, bytes([0x5A]) * n)
producer, copier = cu.stream(), cu.stream()
produced, copied = cu.event(), cu.event()
cu.ok("cuMemcpyHtoDAsync_v2", dev, src, n, producer)
cu.ok("cuEventRecord", produced, producer)
if not broken:
    cu.ok("cuStreamWaitEvent", copier, produced, 0)
cu.ok("cuMemcpyDtoHAsync_v2", out, dev, head, copier)
cu.ok("cuEventRecord", copied, copier)
cu.ok("cuEventSynchronize", copied)
got = cu.read(out, head)
cu.ok("cuCtxSynchronize")
emit(right=got == bytes([0x5A]) * head)
"""
    r = run(fake_cuda, tmp_path, code, broken, **SLOW)
    assert r.out == {"right": not broken}
    assert r.counters["violations"] == 0


@VARIANTS
def test_held_stream_runs_after_its_release_or_its_deadline(fake_cuda, tmp_path, broken):
    # fake_cuda_hold keeps a producer's work back whatever the load: a copy that does not wait
    # for it reads the old bytes, and the held work runs once released. Waiting for held work
    # (the broken pipeline) returns only at the hold's deadline, with a violation counted.
    code = """
start()
n = 4096
src, dev, out = cu.pinned(n), cu.alloc(n), cu.pinned(n)
cu.write(src, bytes([0x5A]) * n)
cu.write(dev, bytes([0xEE]) * n)
producer, copier = cu.stream(), cu.stream()
cu.hold(producer, 300 if broken else 60_000)
cu.ok("cuMemcpyHtoDAsync_v2", dev, src, n, producer)
if broken:
    cu.ok("cuStreamSynchronize", producer)
cu.ok("cuMemcpyDtoHAsync_v2", out, dev, n, copier)
cu.ok("cuStreamSynchronize", copier)
stale = cu.read(out, n) == bytes([0xEE]) * n
cu.hold(producer, 0)
cu.ok("cuCtxSynchronize")
emit(stale=stale, written=cu.read(dev, n) == bytes([0x5A]) * n)
"""
    r = run(fake_cuda, tmp_path, code, broken)
    assert r.out == {"stale": not broken, "written": True}
    assert r.counters["violations"] == int(broken), r.stderr
    assert any("held stream" in v for v in r.violations) == broken, r.violations


@VARIANTS
def test_legacy_default_stream_waits_for_blocking_streams_only(fake_cuda, tmp_path, broken):
    # cuMemcpyDtoH runs on stream 0, the legacy default stream: it waits for the work queued
    # before it on blocking streams (flags 0), not on CU_STREAM_NON_BLOCKING ones.
    code = """
start()
n, head = 4 << 20, 4096
src, dev = cu.pinned(n), cu.alloc(n)
out = cu.pinned(head)
cu.write(src, bytes([0x33]) * n)
side = cu.stream(1 if broken else 0)
cu.ok("cuMemcpyHtoDAsync_v2", dev, src, n, side)
cu.ok("cuMemcpyDtoH_v2", out, dev, head)
got = cu.read(out, head)
cu.ok("cuCtxSynchronize")
emit(right=got == bytes([0x33]) * head)
"""
    r = run(fake_cuda, tmp_path, code, broken, **SLOW)
    assert r.out == {"right": not broken}


def test_blocking_stream_waits_for_the_legacy_stream(fake_cuda, tmp_path):
    # The other direction: work on a blocking stream runs after stream 0's earlier work (a
    # 4 MiB memset, busy for 500 ms), work on a non-blocking stream does not wait for it.
    code = """
start()
n, head = 4 << 20, 4096
dev = cu.alloc(n)
src = cu.pinned(head)
cu.write(src, bytes([0x77]) * head)
got = {}
for flags in (0, 1):
    s = cu.stream(flags)
    cu.ok("cuMemsetD8_v2", dev, 0, n)
    cu.ok("cuMemcpyHtoDAsync_v2", dev, src, head, s)
    cu.ok("cuCtxSynchronize")
    got[flags] = cu.read(dev, head) == bytes([0x77]) * head
emit(blocking=got[0], non_blocking=got[1])
"""
    r = run(fake_cuda, tmp_path, code, **SLOW)
    # Non-blocking: the copy lands first, then the memset of the legacy stream clears it.
    assert r.out == {"blocking": True, "non_blocking": False}


@VARIANTS
def test_synchronize_waits_for_exactly_the_work_before_it(fake_cuda, tmp_path, broken):
    # Two streams: cuStreamSynchronize of one does not wait for the other (syncing the wrong
    # stream is the broken pipeline), cuCtxSynchronize waits for both.
    code = """
start()
n = 4 << 20
src, a, b = cu.pinned(n), cu.alloc(n), cu.alloc(n)
cu.write(src, bytes([0x11]) * n)
slow, fast = cu.stream(), cu.stream()
cu.ok("cuMemcpyHtoDAsync_v2", a, src, n, slow)
cu.ok("cuMemcpyHtoDAsync_v2", b, src, 4096, fast)
cu.ok("cuStreamSynchronize", fast if broken else slow)
a_now = cu.read(a, 4096) == bytes([0x11]) * 4096
cu.ok("cuCtxSynchronize")
emit(a_now=a_now, a=cu.read(a, n) == bytes([0x11]) * n, b=cu.read(b, 4096) == bytes([0x11]) * 4096)
"""
    r = run(fake_cuda, tmp_path, code, broken, **SLOW)
    assert r.out == {"a_now": not broken, "a": True, "b": True}


# ---------------------------------------------------------------------------------------------
# Contexts own their objects


def test_calls_without_a_current_context_fail(fake_cuda, tmp_path):
    code = """
import ctypes
ctx = start()
stream, event, host, dev = cu.stream(), cu.event(), cu.pinned(64), cu.alloc(64)
cu.bind(None)
p = ctypes.c_void_p()
codes = {
    "cuStreamCreate": cu.rc("cuStreamCreate", ctypes.byref(p), 0),
    "cuMemcpyHtoDAsync": cu.rc("cuMemcpyHtoDAsync_v2", dev, host, 64, stream),
    "cuEventRecord": cu.rc("cuEventRecord", event, stream),
    "cuEventSynchronize": cu.rc("cuEventSynchronize", event),
    "cuEventDestroy": cu.rc("cuEventDestroy_v2", event),
    "cuStreamDestroy": cu.rc("cuStreamDestroy_v2", stream),
    "cuMemFree": cu.rc("cuMemFree_v2", dev),
    "cuMemFreeHost": cu.rc("cuMemFreeHost", host),
}
names = sorted({cu.name(c) for c in codes.values()})
cu.bind(ctx)
after = [cu.rc("cuEventDestroy_v2", event), cu.rc("cuStreamDestroy_v2", stream),
         cu.rc("cuMemFree_v2", dev), cu.rc("cuMemFreeHost", host)]
emit(codes=codes, names=names, after=after)
"""
    r = run(fake_cuda, tmp_path, code)
    assert set(r.out["codes"].values()) == {201}, r.out
    assert r.out["names"] == ["CUDA_ERROR_INVALID_CONTEXT"]
    assert r.out["after"] == [0, 0, 0, 0]
    assert r.counters["violations"] == len(r.out["codes"]) == len(r.violations)
    assert "cuEventDestroy with no current context" in r.stderr
    assert r.counters["pinned_now"] == r.counters["device_now"] == 0


@VARIANTS
def test_work_on_another_devices_stream_fails(fake_cuda, tmp_path, broken):
    # Two devices, two primary contexts: queuing work on device 0's stream while device 1's
    # context is current is "invalid resource handle" (what a copy thread that does not re-bind
    # its context before copying gets).
    code = """
ctx0 = start(0)
ctx1 = cu.context(1)
stream, event = cu.stream(), cu.event()
host, dev = cu.pinned(64), cu.alloc(64)
cu.bind(ctx1 if broken else ctx0)
codes = [cu.rc("cuMemcpyHtoDAsync_v2", dev, host, 64, stream),
         cu.rc("cuEventRecord", event, stream)]
cu.bind(ctx0)
cu.ok("cuCtxSynchronize")
emit(codes=codes, distinct=ctx0 != ctx1)
"""
    r = run(fake_cuda, tmp_path, code, broken, devices=2)
    assert r.out["distinct"]
    if broken:
        assert r.out["codes"] == [400, 400]
        assert r.counters["violations"] == 2
        assert "on a stream of device 0 while device 1's context is current" in r.stderr
    else:
        assert r.out["codes"] == [0, 0]
        assert r.counters["violations"] == 0


def test_two_devices_have_their_own_primary_contexts(fake_cuda, tmp_path):
    code = """
import ctypes
cu.init()
ctx0, ctx1, again = cu.context(0), cu.context(1), cu.context(0)
devs = []
for ctx in (ctx0, ctx1):
    cu.bind(ctx)
    d = ctypes.c_int()
    cu.ok("cuCtxGetDevice", ctypes.byref(d))
    devs.append(d.value)
# An event of device 1 recorded on device 1's stream; device 0's stream may wait for it (the
# driver allows events of other contexts there), but not record device 0's event on it.
s1, e1 = cu.stream(), cu.event()
cu.ok("cuEventRecord", e1, s1)
cu.bind(ctx0)
s0, e0 = cu.stream(), cu.event()
wait = cu.rc("cuStreamWaitEvent", s0, e1, 0)
mixed = cu.rc("cuEventRecord", e1, s0)
emit(count=cu.count(), same=[ctx0 == again, ctx0 == ctx1], devs=devs, wait=wait, mixed=mixed)
"""
    r = run(fake_cuda, tmp_path, code, devices=2)
    assert r.out == {"count": 2, "same": [True, False], "devs": [0, 1], "wait": 0, "mixed": 400}
    assert r.counters["violations"] == 1


# ---------------------------------------------------------------------------------------------
# Memory


@VARIANTS
def test_freeing_page_locked_memory_with_pending_copies(fake_cuda, tmp_path, broken):
    code = """
start()
n = 4096
staging, dev = cu.pinned(n), cu.alloc(n)
cu.write(staging, b"x" * n)
stream = cu.stream()
cu.ok("cuMemcpyHtoDAsync_v2", dev, staging, n, stream)
if not broken:
    cu.ok("cuStreamSynchronize", stream)
first = cu.rc("cuMemFreeHost", staging)
cu.ok("cuStreamSynchronize", stream)
later = cu.rc("cuMemFreeHost", staging) if first else None
emit(first=first, later=later, landed=cu.read(dev, n) == b"x" * n)
"""
    r = run(fake_cuda, tmp_path, code, broken, **LATE)
    if broken:
        assert r.out == {"first": 1, "later": 0, "landed": True}
        assert r.counters["violations"] == 1
        assert "cuMemFreeHost of page-locked memory that 1 queued copies still use" in r.stderr
    else:
        assert r.out == {"first": 0, "later": None, "landed": True}
        assert r.counters["violations"] == 0
    assert r.counters["host_allocs"] == r.counters["host_frees"] == 1
    assert r.counters["pinned_now"] == 0 and r.counters["pinned_peak"] == 4096


def test_device_capacity_out_of_memory_and_peak(fake_cuda, tmp_path):
    code = """
import ctypes
start()
a, b = cu.alloc(600 << 10), cu.alloc(400 << 10)
d = ctypes.c_uint64()
over = cu.rc("cuMemAlloc_v2", ctypes.byref(d), 100 << 10)
cu.ok("cuMemFree_v2", a)
c = cu.alloc(500 << 10)
zero = cu.rc("cuMemAlloc_v2", ctypes.byref(d), 0)
emit(over=over, name=cu.name(over), zero=zero)
"""
    r = run(fake_cuda, tmp_path, code, memory=1 << 20)
    assert r.out == {"over": 2, "name": "CUDA_ERROR_OUT_OF_MEMORY", "zero": 1}
    assert r.counters["device_peak"] == 1000 << 10
    assert r.counters["device_now"] == 900 << 10


def test_device_peak_is_per_device(fake_cuda, tmp_path):
    code = """
ctx0 = start(0)
cu.alloc(700 << 10)
cu.bind(cu.context(1))
cu.alloc(700 << 10)  # fits: device 1 has its own capacity
emit(ok=True)
"""
    r = run(fake_cuda, tmp_path, code, devices=2, memory=1 << 20)
    assert r.counters["device_peak"] == 700 << 10 and r.counters["device_now"] == 1400 << 10


def test_async_copy_from_pageable_memory_is_a_violation(fake_cuda, tmp_path):
    # The driver copies pageable memory synchronously: staging must be page-locked.
    code = """
import ctypes
start()
buf = ctypes.create_string_buffer(b"p" * 64, 64)
dev, stream = cu.alloc(64), cu.stream()
code = cu.rc("cuMemcpyHtoDAsync_v2", dev, ctypes.addressof(buf), 64, stream)
buf.raw = b"q" * 64  # the driver has taken the bytes already
cu.ok("cuStreamSynchronize", stream)
emit(code=code, got=cu.read(dev, 64).decode())
"""
    r = run(fake_cuda, tmp_path, code)
    assert r.out == {"code": 0, "got": "p" * 64}
    assert r.counters["violations"] == 1 and "not page-locked" in r.stderr


# ---------------------------------------------------------------------------------------------
# Flags


def test_flags_are_checked(fake_cuda, tmp_path):
    code = """
import ctypes
start()
p = ctypes.c_void_p()
bad = {
    "cuMemHostAlloc": cu.rc("cuMemHostAlloc", ctypes.byref(p), 64, 0x8),
    "cuStreamCreate": cu.rc("cuStreamCreate", ctypes.byref(p), 0x2),
    "cuEventCreate": cu.rc("cuEventCreate", ctypes.byref(p), 0x8),
    "cuEventCreate interprocess with timing": cu.rc("cuEventCreate", ctypes.byref(p), 0x4),
}
s, e = cu.stream(0), cu.event(0)
bad["cuStreamWaitEvent"] = cu.rc("cuStreamWaitEvent", s, e, 0x4)
good = [cu.rc("cuMemHostAlloc", ctypes.byref(p), 64, 0x1 | 0x2 | 0x4),
        cu.rc("cuStreamCreate", ctypes.byref(p), 0x1),
        cu.rc("cuEventCreate", ctypes.byref(p), 0x1 | 0x2 | 0x4),
        cu.rc("cuStreamWaitEvent", s, e, 0)]
emit(bad=bad, good=good)
"""
    r = run(fake_cuda, tmp_path, code)
    assert set(r.out["bad"].values()) == {1}, r.out  # CUDA_ERROR_INVALID_VALUE
    assert r.out["good"] == [0, 0, 0, 0]
    assert r.counters["violations"] == len(r.out["bad"])


# ---------------------------------------------------------------------------------------------
# Fork


def test_forked_child_calls_fail_not_initialized(fake_cuda, tmp_path):
    # The real driver answers CUDA_ERROR_NOT_INITIALIZED (3) to every call of a child forked
    # after cuInit; a child forked before cuInit initialises normally.
    code = """
import ctypes
def in_child(fn):
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.write(w, json.dumps(fn()).encode())
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    return json.loads(os.read(r, 65536))
before = in_child(lambda: [cu.rc("cuInit", 0), cu.count()])
ctx = start()
stream = cu.stream()
def calls():
    p = ctypes.c_void_p()
    n = ctypes.c_int()
    return [cu.rc("cuInit", 0), cu.rc("cuDeviceGetCount", ctypes.byref(n)),
            cu.rc("cuCtxSetCurrent", ctx), cu.rc("cuMemHostAlloc", ctypes.byref(p), 64, 1),
            cu.rc("cuStreamSynchronize", stream), cu.rc("cuStreamCreate", ctypes.byref(p), 1)]
after = in_child(calls)
emit(before=before, after=after, name=cu.name(3), parent=cu.rc("cuStreamSynchronize", stream))
"""
    r = run(fake_cuda, tmp_path, code)
    assert r.out["before"] == [0, 1]
    assert set(r.out["after"]) == {3}, r.out
    assert r.out["name"] == "CUDA_ERROR_NOT_INITIALIZED" and r.out["parent"] == 0
    # The children wrote no log of their own: the parent's has its counters.
    assert r.counters["violations"] == 0


# ---------------------------------------------------------------------------------------------
# Devices, fault injection, error names, the toolkit stub


@pytest.mark.parametrize(
    ("visible", "want"),
    [(None, [0, 3]), ("", [100, None]), ("2", [0, 1]), ("2,0", [0, 2]), ("1,9,0", [0, 1])],
)
def test_cuda_visible_devices(fake_cuda, tmp_path, visible, want):
    code = """
import ctypes
code = cu.rc("cuInit", 0)
emit(code=code, count=cu.count() if code == 0 else None, name=cu.name(code))
"""
    r = run(fake_cuda, tmp_path, code, devices=3, visible=visible)
    assert [r.out["code"], r.out["count"]] == want
    if visible == "":
        assert r.out["name"] == "CUDA_ERROR_NO_DEVICE"


def test_fault_injection_fails_the_nth_call(fake_cuda, tmp_path):
    code = """
start()
s, e = cu.stream(), cu.event()
cu.ok("cuEventRecord", e, s)
codes = [cu.rc("cuEventSynchronize", e) for _ in range(3)]
emit(codes=codes, name=cu.name(codes[1]))
"""
    r = run(fake_cuda, tmp_path, code, fail="cuEventSynchronize:2,cuMemAlloc:9")
    assert r.out == {"codes": [0, 999, 0], "name": "CUDA_ERROR_UNKNOWN"}


def test_error_names_and_destroyed_handles(fake_cuda, tmp_path):
    code = """
start()
e = cu.event()
unrecorded = cu.rc("cuEventSynchronize", e)  # no record: nothing to wait for
cu.ok("cuEventDestroy_v2", e)
again = cu.rc("cuEventSynchronize", e)
names = {c: cu.name(c) for c in [0, 1, 2, 3, 100, 101, 201, 400, 600, 999, 12345]}
emit(unrecorded=unrecorded, again=again, names=names)
"""
    r = run(fake_cuda, tmp_path, code)
    assert r.out["unrecorded"] == 0 and r.out["again"] == 400
    names = r.out["names"]
    assert names["0"] == "CUDA_SUCCESS" and names["400"] == "CUDA_ERROR_INVALID_HANDLE"
    assert names["12345"] is None
    assert all(n and n.startswith("CUDA_") for c, n in names.items() if c != "12345")


def test_toolkit_stub_library(stub_cuda, tmp_path):
    assert not (stub_cuda / "libcuda.so.1").exists()
    code = """
code = cu.rc("cuInit", 0)
emit(code=code, name=cu.name(code))
"""
    r = run(stub_cuda, tmp_path, code, SIM_LIBRARY="libcuda.so")
    assert r.out == {"code": 34, "name": "CUDA_ERROR_STUB_LIBRARY"}
