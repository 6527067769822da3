"""What every check script shares: checkpoints written by the reference writer, bytewise
comparison, the result line the runner reads, and a load that works on a real GPU and on the
simulated driver alike.

A check is a function ``(work: Path) -> dict`` returning ``result(...)``; ``main`` runs one by
name in this process (the runner starts one process per check) and prints its result as the
last line, after ``RESULT_TAG``. Anything a check raises becomes a failure with its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import traceback
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

RESULT_TAG = "GPU-KIT-RESULT "
MiB = 1 << 20

Check = Callable[[Path], dict]


def result(status: str, details: str, **numbers: Any) -> dict:
    assert status in ("pass", "fail", "not-run"), status
    return {"status": status, "details": details, "numbers": numbers}


def verdict(ok: bool, good: str, bad: str, **numbers: Any) -> dict:
    return result("pass" if ok else "fail", good if ok else bad, **numbers)


def small() -> bool:
    """The simulated driver copies on one CPU thread: its runs use small checkpoints."""
    return simulated()


def pattern(nbytes: int, seed: int):
    """Deterministic bytes that differ per position and per seed (as tests/helpers.py does)."""
    import torch

    raw = (torch.arange(nbytes, dtype=torch.int64) * 131 + seed * 17 + 7) % 251
    return raw.to(torch.uint8)


# Dtypes the checkpoints cycle through: floats whose patterns hold NaNs and infinities, which
# only a bytewise comparison handles.
_VIEWS = ["bfloat16", "float32", "int64", "float16", "uint8", "int32"]


def checkpoint(work: Path, name: str, count: int, each: int) -> Path:
    """``count`` tensors of ``each`` bytes in one file, written once per kit run by safetensors."""
    import torch
    from safetensors.torch import save_file

    path = work / f"{name}.safetensors"
    if path.exists():
        return path
    base = pattern(each, seed=0)
    tensors = {}
    for i in range(count):
        dtype = getattr(torch, _VIEWS[i % len(_VIEWS)])
        # Each tensor's bytes differ from the others' (a shifted pattern: cheap for big files).
        tensors[f"layer.{i}.weight"] = base.roll(i * 7919 + i).view(dtype)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    save_file(tensors, str(tmp))
    tmp.replace(path)
    return path


def flat_bytes(t):
    import torch

    return t.detach().reshape(-1).view(torch.uint8)


def differing(got: dict, want: dict) -> list[str]:
    """Names whose dtype, shape or bytes differ (``got`` may live on a device)."""
    import torch

    bad = [n for n in want if n not in got]
    for name, ref in want.items():
        if name not in got:
            continue
        t = got[name]
        if t.dtype != ref.dtype or tuple(t.shape) != tuple(ref.shape):
            bad.append(name)
        elif not torch.equal(flat_bytes(t).cpu(), flat_bytes(ref)):
            bad.append(name)
    return bad


def raw(tensors: dict) -> dict[str, bytes]:
    """Each CPU tensor's bytes, read without running a torch operator (a forked child must not
    enter torch's OpenMP pool, which hangs after fork once the parent used it)."""
    import ctypes

    return {n: ctypes.string_at(t.data_ptr(), t.nbytes) for n, t in tensors.items()}


def reference(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def simulated() -> bool:
    """Set by the runner where the driver is the simulated one (tests/fake_cuda)."""
    return os.environ.get("GPU_KIT_SIM") == "1"


def driver_load(path: Path, device: str = "cuda:0", **options: Any) -> dict:
    """Loads to ``device`` through the CUDA driver: on a GPU with ``fastload.load`` (torch's
    allocator); with the simulated driver, whose device memory is host memory, through the native
    stream with host tensors standing in for device memory, as tests/test_gpu.py does. (Asking
    torch instead would initialise its CUDA, which a forked child must not.)"""
    import fastload

    if not simulated():
        return fastload.load(path, device=device, **options)
    import torch
    from fastload import _fastload, _torch

    def allocate(sizes):
        ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        return None, [(t, t.data_ptr()) for t in ts]

    out = {}
    for batch in _fastload.Stream([str(path)], target=device, allocate=allocate, **options):
        for item in batch:
            out[item.name] = _torch.from_bytes(item.dtype, item.shape, item.data, str(path))
    return out


def short(text: str, limit: int = 1500) -> str:
    text = text.strip()
    return text if len(text) <= limit else "..." + text[-limit:]


def main(checks: Mapping[str, Check]) -> None:
    name, work = sys.argv[1], Path(sys.argv[2])
    try:
        out = checks[name](work)
    except Exception as e:
        out = result("fail", f"{type(e).__name__}: {e}\n{short(traceback.format_exc())}")
    print(RESULT_TAG + json.dumps(out, default=str), flush=True)
    # A thread a failed check left blocked (a deadlock is what some checks look for) must not
    # keep the process alive; otherwise exit normally, so that the simulated driver writes its
    # counters at exit.
    if any(t.is_alive() and not t.daemon for t in threading.enumerate()[1:]):
        os._exit(0)
    sys.exit(0)
