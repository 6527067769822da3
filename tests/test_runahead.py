"""Destination memory run-ahead (issue 13 item 1): with a consumer slower than the reads, the
memory fastload allocated for tensors the consumer has not received stays within
``memory_limit`` (plus the tensor the consumer holds), on the simulated GPU and through the host
engine; a consumer that keeps every tensor is not limited by it.

The checkpoint: 128 int32 tensors of 16 MiB (2 GiB), tensor i holding arange(i*N, (i+1)*N), so
any misplaced byte shows.
"""

from __future__ import annotations

import pytest
import torch
from helpers import run_probe
from safetensors.torch import save_file

MiB = 1 << 20
COUNT, ELEMS = 128, 4 * MiB  # 16 MiB each
LIMIT = 256 * MiB

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_gib(tmp_path_factory):
    path = tmp_path_factory.mktemp("runahead") / "two_gib.safetensors"
    save_file(
        {
            f"layer.{i:03d}": torch.arange(i * ELEMS, (i + 1) * ELEMS, dtype=torch.int32)
            for i in range(COUNT)
        },
        str(path),
    )
    return path


# Checks a tensor against its pattern; `raw` is its bytes (bytes or a uint8 tensor).
CHECK = """
N = 4 * MiB
def check(name, data):
    i = int(name.split(".")[1])
    got = torch.frombuffer(bytearray(data), dtype=torch.int32)
    return torch.equal(got, torch.arange(i * N, (i + 1) * N, dtype=torch.int32))
"""

HOST_ENGINE = (
    CHECK
    + """
from fastload import Stream
path = sys.argv[1]
# Warm-up: the staging ring lands in the host pool, so the slow run measures destinations.
for _ in Stream(path, _target="host", memory_limit="256MiB"):
    pass
base = settle(0)
bad, n = [], 0
with PeakRss() as peak:
    for name, t in Stream(path, _target="host", memory_limit="256MiB"):
        time.sleep(0.02)
        n += 1
        if n % 16 == 0 and not check(name, t.numpy().tobytes()):
            bad.append(name)
        del t
emit(growth=peak.peak - base, n=n, bad=bad)
"""
)


def test_host_engine_rss_growth_within_the_limit(two_gib):
    # glibc serves 16 MiB allocations from mmap and gives them back on free, so RSS is what is
    # alive. Before the budget the reads outran the consumer and RSS grew by about 2 GiB.
    out = run_probe(HOST_ENGINE, two_gib, env={"MALLOC_MMAP_THRESHOLD_": "65536"}, timeout=300)
    assert out["n"] == COUNT and out["bad"] == [], out
    print(f"RSS growth {out['growth'] / MiB:.0f} MiB (limit {LIMIT // MiB} MiB)")
    slack = 32 * MiB  # interpreter, torch and the pool's bookkeeping
    assert out["growth"] <= LIMIT + 16 * MiB + slack, out


KEEPS_EVERYTHING = """
from fastload import Stream
path = sys.argv[1]
got = dict(Stream(path, _target="host", memory_limit="256MiB"))
emit(n=len(got), total=sum(t.numel() * t.element_size() for t in got.values()))
"""


def test_a_consumer_that_keeps_everything_is_not_limited(two_gib):
    out = run_probe(KEEPS_EVERYTHING, two_gib, timeout=300)
    assert out == {"n": COUNT, "total": COUNT * 16 * MiB}, out


# Reads a dltensor capsule's memory: on the simulator device memory is host memory.
DLPACK = """
import ctypes
class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]
class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]
class DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]
_get = ctypes.pythonapi.PyCapsule_GetPointer
_get.restype, _get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
def dl(capsule):
    t = DLTensor.from_address(_get(capsule, b"dltensor"))
    n = t.dtype.bits // 8
    for i in range(t.ndim):
        n *= t.shape[i]
    data = ctypes.string_at(t.data + t.byte_offset, n) if n else b""
    return (t.device.device_type, t.device.device_id), data
"""

SIMULATED = (
    CHECK
    + DLPACK
    + """
from fastload import _fastload
s = _fastload.Stream([sys.argv[1]], target="cuda:0", memory_limit="256MiB")
n, bad, devices = 0, [], set()
for batch in s:
    while batch:
        item = batch.pop(0)
        time.sleep(0.02)
        n += 1
        if n % 16 == 0:
            device, data = dl(item.data)
            devices.add(device)
            if not check(item.name, data):
                bad.append(item.name)
        del item
emit(n=n, bad=bad, devices=sorted(devices))
"""
)


def test_simulated_device_peak_within_the_limit(fake_cuda, two_gib, tmp_path):
    import cuda_sim

    log = tmp_path / "log"
    out = run_probe(SIMULATED, two_gib, env=cuda_sim.env(fake_cuda, log), timeout=300)
    assert out["n"] == COUNT and out["bad"] == [] and out["devices"] == [[2, 0]], out
    counters = cuda_sim.log(log)
    print(f"device peak {counters['device_peak'] / MiB:.0f} MiB (limit {LIMIT // MiB} MiB)")
    # The budget (undelivered segments) plus the tensor the consumer holds; before the budget
    # the peak was the whole 2 GiB.
    assert counters["device_peak"] <= LIMIT + 16 * MiB, counters
    assert counters["device_now"] == 0 and counters["violations"] == 0, counters
