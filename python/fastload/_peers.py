"""The peer loaders' drivers: one timed load of one loader, in a fresh process.

Used by ``fastload bench --compare`` (which ships in the wheel, so the drivers live in the package)
and by benches/run.py (through benches/loaders.py):

    python -m fastload._peers '{"loader": "safetensors", "workload": "load", "files": [...], ...}'
    python -m fastload._peers --probe     # which peers are installed: {name: null | why not}

Prints one JSON line on stdout: seconds, bytes, tensors, first_tensor_s (stream only), checksum,
peak RSS growth, the modules imported before and inside the clock, or {"skipped": why} /
{"error": why}. Imports (torch, numpy and the loader's modules, the same for every row) and
destination allocation happen before the clock starts; everything the loader does to deliver the
bytes happens inside it.

The two workloads:
- load:   the loader's own "every tensor on the CPU" call, then every 4 KiB page of every tensor
          is read (``touch``). For mmap-based loaders this is where the reading happens, so it is
          inside the clock for everyone.
- stream: each tensor is copied into a destination allocated and pre-faulted beforehand (as a
          GPU loader's destination would be), ``dst[name].copy_(t)``, as soon as it is handed over.
"""

from __future__ import annotations

import inspect
import json
import os
import resource
import sys
import time
import traceback
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

# numpy and torch are imported where they are used: `--probe` answers in a Python without them.

PAGE = 4096


def touch(tensors: Iterable[torch.Tensor]) -> int:
    """Read one byte in every 4 KiB page of every tensor, plus its last byte; return their sum.

    Byte k*4096 of a tensor lies in page (first page + k) whatever the tensor's alignment, so the
    stride visits every page the tensor spans except possibly the one holding its last byte, which
    is read separately. numpy does it with the least per-tensor overhead (about 3 us), which
    matters for many tiny tensors; the sum doubles as a checksum compared across loaders.
    """
    import numpy as np
    import torch

    acc = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        a = t.detach().reshape(-1).view(torch.uint8).numpy()
        acc += int(a[::PAGE].sum(dtype=np.int64)) + int(a[-1])
    return acc


# --- loaders ---
# Each loader is two functions: load(job) -> dict[name, tensor], and
# stream(job) -> iterator of (name, tensor) whose tensors are valid until the next step.


def _fastload_opts(job: dict) -> dict:
    opts = dict(job.get("options") or {})
    if job.get("memory_limit") and job["workload"] == "stream":
        opts.setdefault("memory_limit", job["memory_limit"])
    return opts


def fastload_load(job: dict) -> dict:
    import fastload

    return fastload.load(job["uri"], **_fastload_opts(job))


def fastload_stream(job: dict) -> Iterator:
    import fastload

    yield from fastload.stream(job["uri"], **_fastload_opts(job))


def safetensors_load(job: dict) -> dict:
    from safetensors.torch import load_file

    out: dict = {}
    for f in job["files"]:
        out.update(load_file(f))
    return out


def safetensors_stream(job: dict) -> Iterator:
    from safetensors import safe_open

    for f in job["files"]:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                yield name, st.get_tensor(name)


def _runai_env(job: dict) -> None:
    # Set before the library is imported: the C++ side reads its settings at first use.
    os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
    if job.get("memory_limit") and job["workload"] == "stream":
        os.environ["RUNAI_STREAMER_MEMORY_LIMIT"] = str(job["memory_limit"])
    for k, v in (job.get("env") or {}).items():
        os.environ[k] = str(v)


def runai_load(job: dict) -> dict:
    _runai_env(job)
    from runai_model_streamer import SafetensorsStreamer  # type: ignore[import-not-found,unused-ignore]

    # owned=True (0.17's default) hands each ring buffer to the caller, so tensors stay valid after
    # the iterator moves on: no clone needed. run.py checks this through the checksum.
    with SafetensorsStreamer() as s:
        s.stream_files(job["files"], owned=True)
        return dict(s.get_tensors())


def runai_stream(job: dict) -> Iterator:
    _runai_env(job)
    from runai_model_streamer import SafetensorsStreamer  # type: ignore[import-not-found,unused-ignore]

    # owned=False: views into reused ring buffers, consumed (copied) before the next step.
    with SafetensorsStreamer() as s:
        s.stream_files(job["files"], owned=False)
        yield from s.get_tensors()


def tensorizer_load(job: dict) -> dict:
    from tensorizer import TensorDeserializer  # type: ignore[import-not-found,unused-ignore]

    d = TensorDeserializer(job["tensorizer_file"], device="cpu")
    out = dict(d.items())
    d.close()
    return out


def fastsafetensors_load(job: dict) -> dict:
    from fastsafetensors import fastsafe_open  # type: ignore[import-not-found,unused-ignore]

    # nogds=True: no GPUDirect Storage here; pread into a host buffer, tensors viewed from it.
    with fastsafe_open(job["files"], framework="pt", device="cpu", nogds=True) as f:
        return {k: f.get_tensor(k) for k in f.keys()}


# tensorizer and fastsafetensors have no per-tensor streaming (the whole checkpoint lands in their
# buffers before the first tensor is handed out), so they are measured on "load" only.
LOADERS: dict[str, tuple[Callable, Callable | None]] = {
    "fastload": (fastload_load, fastload_stream),
    "safetensors": (safetensors_load, safetensors_stream),
    "runai-model-streamer": (runai_load, runai_stream),
    "tensorizer": (tensorizer_load, None),
    "fastsafetensors": (fastsafetensors_load, None),
}
IMPORTS = {
    "fastload": "fastload",
    "safetensors": "safetensors.torch",
    "runai-model-streamer": "runai_model_streamer",
    "tensorizer": "tensorizer",
    "fastsafetensors": "fastsafetensors",
}


# --- measurement ---


def _rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _destination(files: list[str], shm_path: str | None) -> dict[str, torch.Tensor]:
    """One pre-faulted CPU tensor per checkpoint tensor, laid out from the headers alone.

    All are views into one buffer. With shm_path it is a tmpfs file shared by every measurement of
    the run and mapped with MAP_POPULATE: its pages exist already, so setting it up costs ~0.2 s
    instead of the several seconds fresh memory takes to fault in on these VMs. It is overwritten
    with a fill pattern each time, so a loader that skipped a tensor still fails the checksum.
    """
    import mmap

    import torch
    from safetensors import safe_open

    from ._torch import DTYPES

    layout, total = [], 0
    for f in files:
        with safe_open(f, framework="pt") as st:
            for name in st.keys():
                sl = st.get_slice(name)
                dtype, shape = DTYPES.get(sl.get_dtype()), list(sl.get_shape())
                nbytes = torch.empty((), dtype=dtype).element_size()
                for d in shape:
                    nbytes *= d
                layout.append((name, dtype, shape, total, nbytes))
                total += (nbytes + 63) // 64 * 64
    if shm_path:
        fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size != max(total, 1):
                os.ftruncate(fd, max(total, 1))
            mm = mmap.mmap(fd, max(total, 1), flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        finally:
            os.close(fd)
        buf = torch.frombuffer(mm, dtype=torch.uint8)
    else:
        buf = torch.empty(max(total, 1), dtype=torch.uint8)
    buf.fill_(1)  # writes every page: mapped, and no stale data from an earlier run
    dst = {}
    for name, dtype, shape, off, nbytes in layout:
        if nbytes == 0:
            dst[name] = torch.empty(shape, dtype=dtype)
        else:
            assert dtype is not None, name
            dst[name] = buf[off : off + nbytes].view(dtype).view(shape)
    return dst


# Imported before the clock by every row, whatever its loader: the tensors' library and what
# `touch` reads them with. fastload's own module does not import torch (the CLI does not need it),
# so without this its first load would pay torch's import (seconds) where a peer's did not.
PRELOAD = ("torch", "numpy")
# The loader's module for torch tensors beside IMPORTS (its import also checks it is installed):
# fastload's torch glue is imported by its first load, as safetensors.torch is by the import.
TORCH_GLUE = {"fastload": "fastload._torch"}


def _preload(name: str) -> None:
    for module in (*PRELOAD, IMPORTS[name], TORCH_GLUE.get(name, IMPORTS[name])):
        __import__(module)


def measure(job: dict) -> dict:
    name, workload = job["loader"], job["workload"]
    try:
        __import__(IMPORTS[name])
    except Exception as e:  # a missing/broken peer is a row note, not a crash
        return {"skipped": f"import {IMPORTS[name]} failed: {type(e).__name__}: {e}"}
    if name == "fastload" and job.get("options"):
        import fastload

        # An installed fastload older than the options asked for (a released version's row).
        taken = inspect.signature(fastload.load).parameters
        missing = [f"{o}=" for o in job["options"] if o not in taken]
        if missing:
            return {"skipped": f"fastload.load has no {', '.join(missing)} option"}

    if name == "tensorizer" and not job.get("tensorizer_file"):
        return {"skipped": job.get("tensorizer_error") or "no tensorizer copy of the checkpoint"}
    load_fn, stream_fn = LOADERS[name]
    if workload == "stream" and stream_fn is None:
        return {"skipped": f"{name} has no per-tensor streaming"}
    dst = _destination(job["files"], job.get("dst_shm")) if workload == "stream" else None
    _preload(name)
    rss0 = _rss_peak_bytes()

    first = None
    before = set(sys.modules)
    t0 = time.perf_counter()
    if workload == "load":
        tensors = load_fn(job)
        checksum = touch(tensors.values())
        seconds = time.perf_counter() - t0
        in_clock = set(sys.modules) - before
        count, nbytes = len(tensors), sum(t.nbytes for t in tensors.values())
        t1 = time.perf_counter()
        touch(tensors.values())  # again, on resident pages: the touch's own cost
        touch_s = time.perf_counter() - t1
    else:
        assert stream_fn is not None and dst is not None
        count = nbytes = 0
        for tname, t in stream_fn(job):
            if first is None:
                first = time.perf_counter() - t0
            dst[tname].copy_(t)
            count += 1
            nbytes += t.nbytes
        seconds = time.perf_counter() - t0
        in_clock = set(sys.modules) - before
        checksum = touch(dst.values())
        touch_s = None
    return {
        "seconds": seconds,
        "bytes": nbytes,
        "tensors": count,
        "first_tensor_s": first,
        "touch_s": touch_s,
        "checksum": checksum,
        "rss_growth_bytes": max(0, _rss_peak_bytes() - rss0),
        # What this process had imported when the clock started, and what the timed section
        # imported: a row's clock must not pay for an import another row made before its own.
        "modules_before_clock": sorted(before),
        "modules_in_clock": sorted(in_clock),
    }


def probe() -> dict[str, str | None]:
    """Each loader: None when its module can be found (without importing it), else why not
    (starting "not installed" when it is not)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        # Every driver loads into torch tensors.
        why = f"not installed: torch is not installed in {sys.executable}"
        return dict.fromkeys(IMPORTS, why)
    out: dict[str, str | None] = {}
    for name, module in IMPORTS.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError) as e:
            found, why = False, f"{type(e).__name__}: {e}"
        else:
            why = f"not installed (no module {module!r} in {sys.executable})"
        out[name] = None if found else why
    return out


def main() -> None:
    if sys.argv[1:] == ["--probe"]:
        sys.stdout.write(json.dumps(probe()) + "\n")
        sys.stdout.flush()
        return
    job = json.loads(sys.argv[1])
    try:
        result = measure(job)
    except Exception as e:
        result = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-4000:]}
    sys.stdout.write("\n" + json.dumps(result) + "\n")
    sys.stdout.flush()
    # Skip interpreter teardown: some peers' native threads make it slow or noisy; it is untimed.
    os._exit(0)


if __name__ == "__main__":
    main()
