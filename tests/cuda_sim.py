"""The simulated CUDA driver (tests/fake_cuda/fake_cuda.c): building it, running processes on it.

The simulator is a libcuda.so.1 that runs the real CUDA engine (its own driver loading, contexts,
page-locked staging, async copies, events) on machines without a GPU, with host memory standing in
for device memory, and that reports misuse the real driver would punish on a GPU (see the rules in
the C file's header comment). A process uses it through `LD_LIBRARY_PATH` and the `FAKE_CUDA_*`
variables that `env` sets; at exit it writes its counters to `FAKE_CUDA_LOG`, read back by `log`.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from pathlib import Path

SOURCES = Path(__file__).resolve().parent / "fake_cuda"

# The counters the simulator writes at exit, in order.
LOG_KEYS = (
    "copies",  # asynchronous host-to-device copies queued
    "bytes",  # bytes those copies carried
    "pinned_peak",  # most page-locked bytes allocated at once
    "pinned_now",  # page-locked bytes still allocated at exit
    "host_allocs",  # successful cuMemHostAlloc calls
    "host_frees",  # successful cuMemFreeHost calls
    "device_peak",  # most device bytes allocated at once on any one device
    "device_now",  # device bytes still allocated at exit (all devices)
    "violations",  # misuse detected (each also printed to stderr as "fake_cuda: violation: ...")
    "copy_streams",  # streams that carried host-to-device copies (the legacy one counts)
)


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc) to build the simulated CUDA driver")
    return cc


def _compile(source: str, out: Path) -> None:
    flags = ["-shared", "-fPIC", "-O1", "-Wall"]
    cmd = [_compiler(), *flags, "-o", str(out), str(SOURCES / source), "-lpthread"]
    subprocess.run(cmd, check=True)


def build(out_dir: Path) -> Path:
    """Compiles the simulator into `out_dir/libcuda.so.1` (and a `libcuda.so` link); returns
    `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _compile("fake_cuda.c", out_dir / "libcuda.so.1")
    link = out_dir / "libcuda.so"
    if not link.exists():
        link.symlink_to("libcuda.so.1")
    return out_dir


def build_stub(out_dir: Path) -> Path:
    """Compiles a toolkit-style stub `out_dir/libcuda.so` (as in cuda/lib64/stubs: no `.so.1`),
    whose entry points return CUDA_ERROR_STUB_LIBRARY (34); returns `out_dir`."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _compile("stub_cuda.c", out_dir / "libcuda.so")
    return out_dir


def env(
    lib_dir: Path | None,
    log: Path | None,
    *,
    devices: int = 1,
    memory: int | None = None,
    fail: str | None = None,
    visible: str | None = None,
    **extra: str,
) -> dict[str, str]:
    """A full environment for a subprocess on the simulator in `lib_dir` (os.environ, then
    LD_LIBRARY_PATH and the FAKE_CUDA_* variables; CUDA_VISIBLE_DEVICES=`visible` if given, else
    removed). `memory` is each device's capacity in bytes; `fail` is e.g. "cuEventSynchronize:3";
    `extra` adds or overrides variables: FAKE_CUDA_LAG_US (how late queued work runs at the
    earliest, default 2000) and FAKE_CUDA_COPY_RATE (bytes a second a stream carries, default
    unlimited) make late work later, for tests that must see a skipped wait; FAKE_CUDA_PIN_RATE
    (bytes a second cuMemHostAlloc pins, default unlimited) makes pinning cost time."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("FAKE_CUDA_")}
    out.pop("CUDA_VISIBLE_DEVICES", None)
    if lib_dir is not None:
        paths = [str(lib_dir), os.environ.get("LD_LIBRARY_PATH")]
        out["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in paths if p)
    if log is not None:
        out["FAKE_CUDA_LOG"] = str(log)
    out["FAKE_CUDA_DEVICES"] = str(devices)
    if memory is not None:
        out["FAKE_CUDA_DEVICE_MEMORY"] = str(memory)
    if fail is not None:
        out["FAKE_CUDA_FAIL"] = fail
    if visible is not None:
        out["CUDA_VISIBLE_DEVICES"] = visible
    out.update({k: str(v) for k, v in extra.items()})
    return out


def run_cli(lib_dir: Path, log: Path, *argv: str, timeout: float = 300):
    """`python -m fastload._cli ARGV...` on the simulator in `lib_dir`, counters to `log`."""
    import sys

    return subprocess.run(
        [sys.executable, "-m", "fastload._cli", *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(lib_dir, log),
    )


def log(path: Path) -> dict[str, int]:
    """The counters the simulator wrote at exit to `path` (FAKE_CUDA_LOG): LOG_KEYS, then
    `calls.NAME` for every entry point called."""
    fields = Path(path).read_text().split()
    return {k: int(v) for k, v in (f.split("=", 1) for f in fields)}


def calls(name: str = "libcuda.so.1") -> dict[str, int]:
    """Inside a process on the simulator: how many times each driver entry point was called so
    far (`{"cuMemHostAlloc": 3, ...}`; names without their _v2 suffix). The difference of two
    calls counts what happened between them (one load)."""
    fn = ctypes.CDLL(name).fake_cuda_calls
    fn.argtypes, fn.restype = [ctypes.c_char_p, ctypes.c_size_t], ctypes.c_int
    buf = ctypes.create_string_buffer(8192)
    n = fn(buf, len(buf))
    fields = buf.raw[:n].decode().split()
    return {k: int(v) for k, v in (f.split("=", 1) for f in fields)}


# ---------------------------------------------------------------------------------------------
# Inside a process that runs on the simulator: the driver through ctypes.

_P = ctypes.c_void_p
_SIGNATURES = {
    "cuInit": [ctypes.c_uint],
    "cuDeviceGetCount": [ctypes.POINTER(ctypes.c_int)],
    "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
    "cuDevicePrimaryCtxRetain": [ctypes.POINTER(_P), ctypes.c_int],
    "cuCtxSetCurrent": [_P],
    "cuCtxGetCurrent": [ctypes.POINTER(_P)],
    "cuCtxGetDevice": [ctypes.POINTER(ctypes.c_int)],
    "cuCtxSynchronize": [],
    "cuStreamCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuStreamDestroy_v2": [_P],
    "cuStreamSynchronize": [_P],
    "cuStreamWaitEvent": [_P, _P, ctypes.c_uint],
    "cuEventCreate": [ctypes.POINTER(_P), ctypes.c_uint],
    "cuEventRecord": [_P, _P],
    "cuEventSynchronize": [_P],
    "cuEventDestroy_v2": [_P],
    "cuMemHostAlloc": [ctypes.POINTER(_P), ctypes.c_size_t, ctypes.c_uint],
    "cuMemFreeHost": [_P],
    "cuMemAlloc_v2": [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t],
    "cuMemFree_v2": [ctypes.c_uint64],
    "cuMemcpyHtoDAsync_v2": [ctypes.c_uint64, _P, ctypes.c_size_t, _P],
    "cuMemcpyDtoHAsync_v2": [_P, ctypes.c_uint64, ctypes.c_size_t, _P],
    "cuMemcpyHtoD_v2": [ctypes.c_uint64, _P, ctypes.c_size_t],
    "cuMemcpyDtoH_v2": [_P, ctypes.c_uint64, ctypes.c_size_t],
    "cuMemsetD8_v2": [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "fake_cuda_hold": [_P, ctypes.c_uint],
}


class DriverError(RuntimeError):
    def __init__(self, call: str, code: int):
        super().__init__(f"{call} returned {code}")
        self.call, self.code = call, code


class Driver:
    """The driver in this process (`libcuda.so.1` from LD_LIBRARY_PATH), through ctypes:
    `rc(name, *args)` returns a call's code; `ok` and the helpers raise DriverError on any other
    code than 0. Used by the simulator's own tests and by probes that play a consumer."""

    def __init__(self, name: str = "libcuda.so.1"):
        self.lib = ctypes.CDLL(name)
        for fn, args in _SIGNATURES.items():
            if hasattr(self.lib, fn):
                getattr(self.lib, fn).argtypes = args
                getattr(self.lib, fn).restype = ctypes.c_int

    def rc(self, name: str, *args) -> int:
        return getattr(self.lib, name)(*args)

    def ok(self, name: str, *args) -> None:
        code = self.rc(name, *args)
        if code != 0:
            raise DriverError(name, code)

    def _out(self, name: str, kind, *args):
        value = kind()
        self.ok(name, ctypes.byref(value), *args)
        return value.value

    def init(self) -> None:
        self.ok("cuInit", 0)

    def count(self) -> int:
        return self._out("cuDeviceGetCount", ctypes.c_int)

    def context(self, ordinal: int = 0) -> int:
        """Device `ordinal`'s primary context (retained, not bound)."""
        return self._out("cuDevicePrimaryCtxRetain", _P, ordinal)

    def bind(self, ctx: int | None) -> None:
        self.ok("cuCtxSetCurrent", ctx)

    def current(self) -> int | None:
        return self._out("cuCtxGetCurrent", _P)

    def stream(self, flags: int = 1) -> int:
        """A stream of the current context (1: CU_STREAM_NON_BLOCKING)."""
        return self._out("cuStreamCreate", _P, flags)

    def hold(self, stream: int, ms: int) -> None:
        """Keeps `stream`'s work (queued or to come) from running until `hold(stream, 0)`, or at
        most `ms` milliseconds, after which it runs and the log counts a violation: a producer
        that is late whatever the machine's load (the simulator's own control, not the driver's).
        """
        self.ok("fake_cuda_hold", stream, ms)

    def event(self, flags: int = 2) -> int:
        """An event of the current context (2: CU_EVENT_DISABLE_TIMING)."""
        return self._out("cuEventCreate", _P, flags)

    def pinned(self, n: int, flags: int = 1) -> int:
        """`n` bytes of page-locked memory (1: CU_MEMHOSTALLOC_PORTABLE)."""
        return self._out("cuMemHostAlloc", _P, n, flags)

    def alloc(self, n: int) -> int:
        return self._out("cuMemAlloc_v2", ctypes.c_uint64, n)

    def name(self, code: int) -> str | None:
        text = ctypes.c_char_p()
        if self.rc("cuGetErrorName", code, ctypes.byref(text)) != 0:
            return None
        return text.value.decode() if text.value else None

    def allocator(self, ordinal: int = 0, stream: int | None = None):
        """An `allocate` callback for `_fastload.Stream` that takes destinations from device
        `ordinal`'s memory (cuMemAlloc, one block per tensor, so the log's device_peak counts
        them) and hands them out as uint8 torch tensors over that memory (the simulator's device
        memory is host memory). A block is freed (cuMemFree) when its tensor and every view of
        it are gone. `stream` is what the callback says the copies must wait for (None: nothing).
        The calling thread's current context is left as it was."""
        import weakref

        import torch

        ctx = self.context(ordinal)

        def borrowed(f):
            previous = self.current()
            self.bind(ctx)
            try:
                return f()
            finally:
                self.bind(previous)

        def free(addr: int) -> None:
            borrowed(lambda: self.ok("cuMemFree_v2", addr))

        def one(n: int):
            addr = self.alloc(max(n, 1))
            memory = (ctypes.c_uint8 * max(n, 1)).from_address(addr)
            weakref.finalize(memory, free, addr)
            return torch.frombuffer(memory, dtype=torch.uint8)[:n], addr

        def allocate(sizes):
            return stream, borrowed(lambda: [one(n) for n in sizes])

        return allocate

    @staticmethod
    def write(addr: int, data: bytes) -> None:
        """Host-side write (the simulator's device memory is host memory too)."""
        ctypes.memmove(addr, data, len(data))

    @staticmethod
    def read(addr: int, n: int) -> bytes:
        """Host-side read, without any synchronisation."""
        return ctypes.string_at(addr, n)
