"""The simulated CUDA driver (tests/fake_cuda/fake_cuda.c): building it, running processes on it.

The simulator is a libcuda.so.1 that runs the real CUDA engine (cudarc's loading, contexts,
page-locked staging, async copies, events) on machines without a GPU, with host memory standing in
for device memory, and that reports misuse the real driver would punish on a GPU (see the rules in
the C file's header comment). A process uses it through `LD_LIBRARY_PATH` and the `FAKE_CUDA_*`
variables that `env` sets; at exit it writes its counters to `FAKE_CUDA_LOG`, read back by `log`.
"""

from __future__ import annotations

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
)


def _compiler() -> str:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise FileNotFoundError("no C compiler (cc) to build the simulated CUDA driver")
    return cc


def _compile(source: str, out: Path) -> None:
    flags = ["-shared", "-fPIC", "-O1", "-Wall", "-Werror"]
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
    `extra` adds or overrides variables (FAKE_CUDA_LAG_US=...)."""
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


def log(path: Path) -> dict[str, int]:
    """The counters the simulator wrote at exit to `path` (FAKE_CUDA_LOG)."""
    fields = Path(path).read_text().split()
    return {k: int(v) for k, v in (f.split("=", 1) for f in fields)}
