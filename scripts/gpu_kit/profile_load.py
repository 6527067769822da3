"""Where the time of ``fastload.load(device="cuda")`` goes, beside safetensors on the same file.

    python kit/profile_load.py --work DIR [--out DIR] [--size 2GiB]     # standalone, in gpu-kit/
    bash run.sh --only profile_load                                     # as a check of the kit

A llama-like checkpoint (benches/make_checkpoint.py, as benches/gpu_bench.py loads), page cache
warm. Every row runs in a fresh process whose CUDA context exists before the clock starts (as in
gpu_bench.py, and in a server), each load timed until its tensors are on the device
(``torch.cuda.synchronize``):

- ``fastload``: three loads in one process: the first (what gpu_bench.py and a server measure:
  page-locked staging pinned, torch's allocator empty), a second (both reused), and a third after
  ``fastload.release_memory()`` and ``torch.cuda.empty_cache()`` (pinning and device allocation
  paid again, the process's other one-time costs not). Each with ``stats()`` (``pinned_bytes``,
  ``pinned_ms``: what that load pinned and how long it took; ``staging_peak_bytes``;
  ``first_segment_ms``) and when its tensors arrived (first, half and all of the bytes), and
  ``where_ms``: its wall time split by what held it up (``stats()["phases_ms"]``: pinning, reads,
  a full ring, torch's allocations, copies on the device, the consumer wrapping tensors; the
  CUDA context's creation before the clock beside them) and the stage it waited on most.
- ``fastload_b16``: the same first and second loads with ``block_size="16MiB"``: a 512 MiB ring
  (2 x 16 blocks) instead of the default's 128 MiB (4 MiB blocks, the GPU default for local
  files): four times the pinning, a quarter of the blocks (and of the per-block costs).
- ``fastload_c64``: the same first and second loads with ``concurrency=64``: a 512 MiB ring (2 x
  64 blocks of 4 MiB), 64 reads in flight instead of 16.
- ``fastload_mmap`` / ``fastload_mmap_b32``: the same first and second loads with
  ``method="mmap"``: each block's pages of the file lent to the device (registered read-only
  where they are, ``cuMemHostRegister``) and copied from the page cache with no CPU copy, at the
  default block size and at 32 MiB (fewer registrations); ``lent_bytes`` and ``lend_refused``
  say whether they were.
- ``fastload_s2``: the same first and second loads with ``copy_streams=2``: blocks copied on two
  CUDA streams in turn (the device has more than one copy engine) instead of one.
- ``safetensors``: ``load_file(device=...)`` twice in one process.
- ``costs``: the pieces on their own, in a fresh process: torch allocating the checkpoint's
  tensors on the device one ``torch.empty`` each (what fastload's allocator does, cold then from
  torch's cache), and pinning 256 MiB and 1 GiB (``torch.empty(pin_memory=True)``, the driver's
  ``cuMemHostAlloc`` as fastload's staging uses it); and the warm file's own pages registered
  read-only (``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_READ_ONLY``) and copied to the
  device from there (whether the copy engine can read the page cache without a CPU copy).
- every fastload load's checksum (its tensors' bytes summed on the device, after the clock):
  the check fails if two loads of the file disagree.
- ``profile``: one first load under ``torch.profiler`` (CPU and CUDA activities): the host-to-device
  copies on the GPU (count, busy time, first start and last end after the load started) and the
  CUDA API calls seen (count and time per name); the trace is written beside the JSON.

Writes ``profile_load.json`` (and ``profile_load_trace.json``) to ``--out`` ($OUT if set, else
the work folder); the last line is the kit's result line. On the simulated driver (GPU_KIT_SIM=1,
torch without CUDA) the fastload rows load through the native stream into host memory and the
torch-only rows are skipped: that runs the script in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# In the kit: kit/ beside benches/; in the repository: scripts/gpu_kit/ two levels below it.
for _benches in (HERE.parent / "benches", HERE.parent.parent / "benches"):
    if (_benches / "make_checkpoint.py").exists():
        sys.path.insert(0, str(_benches))
        break

from kit_common import RESULT_TAG, result, short, simulated  # noqa: E402

MiB, GiB = 1 << 20, 1 << 30


# ---------------------------------------------------------------------------------------------
# In a child process: one row


CONTEXT_S: float | None = None  # how long making the CUDA context took (before the clock)


def _torch_on(device: str):
    """torch, with the CUDA context created (not timed); None for the device on the simulator."""
    global CONTEXT_S
    import torch

    if simulated():
        return torch, None
    dev = torch.device(device)
    t0 = time.perf_counter()
    torch.empty(1, device=dev)
    torch.cuda.synchronize(dev)
    CONTEXT_S = time.perf_counter() - t0
    return torch, dev


def _sync(torch, dev) -> None:
    if dev is not None:
        torch.cuda.synchronize(dev)


def _fastload_load(path: str, dev, options: dict) -> tuple[dict, dict, list[tuple[float, int]]]:
    """One load: its tensors, its stats() and (seconds since the start, bytes so far) per tensor.
    The clock starts before the stream is opened."""
    import fastload

    t0 = time.perf_counter()
    arrivals: list[tuple[float, int]] = []
    got: dict = {}
    total = 0
    if dev is None:  # the simulated driver: host tensors stand in for device memory
        import torch
        from fastload import _fastload, _torch

        def allocate(sizes):
            ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
            return None, [(t, t.data_ptr()) for t in ts]

        s = _fastload.Stream([path], target="cuda:0", allocate=allocate, **options)
        for batch in s:
            for item in batch:
                got[item.name] = _torch.from_bytes(item.dtype, item.shape, item.data, path)
                total += item.data.nbytes
                arrivals.append((time.perf_counter() - t0, total))
        stats = dict(s.stats().as_dict())
        s.close()
        return got, stats, arrivals
    with fastload.stream(path, device=dev, **options) as s:
        for name, t in s:
            got[name] = t
            total += t.nbytes
            arrivals.append((time.perf_counter() - t0, total))
        stats = s.stats()
    return got, stats, arrivals


def _timeline(arrivals: list[tuple[float, int]]) -> dict:
    """When the first tensor, half of the bytes and all of them had arrived (seconds)."""
    if not arrivals:
        return {}
    total = arrivals[-1][1]
    half = next(t for t, b in arrivals if b >= total / 2)
    return {"first_tensor_s": arrivals[0][0], "half_bytes_s": half, "all_s": arrivals[-1][0]}


STAT_KEYS = (
    "pinned_bytes",
    "pinned_ms",
    "staging_peak_bytes",
    "first_segment_ms",
    "concurrency",
    "block_size",
    "memory_limit",
    "bytes_copied",
    "lent_bytes",
    "lend_refused",
    "copy_streams",
    "phases_ms",
)


def where_the_time_went(load: dict) -> dict:
    """One load's wall time split by what held it up, in milliseconds, from its ``phases_ms``
    (``stats()``) and the consumer's clock. Reads and their waits for a staging buffer add up
    over the reads in flight: divided by ``concurrency`` they are a wall-time share. ``wrap``
    is the consumer's time outside its waits for segments (making torch tensors of the delivered
    memory, the loop itself). ``limit`` names the stage the load waited on most."""
    phases = load.get("phases_ms") or {}
    wall = load["seconds"] * 1e3
    n = max(1, load.get("concurrency") or 1)
    out = {
        "wall": wall,
        "context_before_clock": (load.get("context_s") or 0.0) * 1e3,
        "pinning": load.get("pinned_ms") or 0.0,
        "staging_wait_per_read": phases.get("staging_wait", 0.0) / n,
        "lending_per_read": phases.get("lend", 0.0) / n,
        "unlending": phases.get("unlend", 0.0),
        "reads_per_read": phases.get("read", 0.0) / n,
        "ring_full": phases.get("ring_wait", 0.0),
        "torch_alloc": phases.get("alloc", 0.0),
        "copy_enqueue": phases.get("copy", 0.0),
        "copy_thread_idle": phases.get("copy_idle", 0.0),
        "copies_on_device": phases.get("fence_wait", 0.0),
        "consumer_wait": phases.get("consumer_wait", 0.0),
        "wrap": max(0.0, wall - phases.get("consumer_wait", 0.0)),
    }
    # What the load waited on: pinning (reads waiting for a buffer), the reads themselves (the
    # copy thread idle), torch's allocations, the device's copies (the ring full, fences
    # waited), or the consumer's own work (wrapping).
    candidates = {
        "pinning": out["staging_wait_per_read"],
        "reads (host side)": out["copy_thread_idle"] - out["staging_wait_per_read"],
        "torch allocations": out["torch_alloc"],
        "device copies": max(out["ring_full"], out["copies_on_device"] - out["copy_thread_idle"]),
        "consumer (wrapping tensors)": out["wrap"],
    }
    out["limit"] = max(candidates, key=lambda k: candidates[k]) if phases else None
    return out


def breakdown_line(name: str, load: dict) -> str:
    w = load.get("where_ms")
    if not w:
        return ""
    parts = ", ".join(f"{k} {v:.0f}" for k, v in w.items() if k not in ("limit", "wall"))
    return f"{name} {load['load']}: {w['wall']:.0f} ms = {parts} (ms); waited most on {w['limit']}"


def checksum(torch, tensors: dict) -> int:
    """The tensors' bytes summed per tensor (on their device), combined in name order: the
    fastload rows of one run load one file, so any two that differ got other bytes (a lent
    page copied before it was read, a stale staging buffer)."""
    total = 0
    for name in sorted(tensors):
        flat = tensors[name].reshape(-1).view(torch.uint8)
        total = (total * 1_000_003 + int(flat.sum(dtype=torch.int64)) + flat.numel()) % (1 << 61)
    return total


def row_fastload(job: dict) -> dict:
    import fastload

    torch, dev = _torch_on(job["device"])
    loads = []
    for label in job["loads"]:
        released = None
        if label == "after_release":
            t0 = time.perf_counter()
            freed = fastload.release_memory()
            if dev is not None:
                torch.cuda.empty_cache()
            released = {**freed, "seconds": time.perf_counter() - t0}
        t0 = time.perf_counter()
        got, stats, arrivals = _fastload_load(job["path"], dev, job["options"])
        _sync(torch, dev)
        seconds = time.perf_counter() - t0
        nbytes = sum(t.nbytes for t in got.values())
        one = {
            "load": label,
            "seconds": seconds,
            "gb_per_s": nbytes / seconds / 1e9,
            "bytes": nbytes,
            "tensors": len(got),
            "context_s": CONTEXT_S if label == "first" else None,
            **{k: stats.get(k) for k in STAT_KEYS},
            **_timeline(arrivals),
            "cached_after": fastload.cached_memory(),
            **({"released_before": released} if released else {}),
            "checksum": checksum(torch, got),  # after the clock
        }
        one["where_ms"] = where_the_time_went(one)
        loads.append(one)
        del got
    return {"loads": loads}


def row_safetensors(job: dict) -> dict:
    from safetensors.torch import load_file

    torch, dev = _torch_on(job["device"])
    loads = []
    for label in ("first", "second"):
        t0 = time.perf_counter()
        got = load_file(job["path"], device=str(dev) if dev is not None else "cpu")
        _sync(torch, dev)
        seconds = time.perf_counter() - t0
        nbytes = sum(t.nbytes for t in got.values())
        loads.append({"load": label, "seconds": seconds, "gb_per_s": nbytes / seconds / 1e9})
        del got
    return {"loads": loads}


def _tensor_bytes(path: str) -> list[int]:
    """Each tensor's size in bytes, in file order, from the safetensors header."""
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
    spans = sorted(v["data_offsets"] for k, v in header.items() if k != "__metadata__")
    return [end - begin for begin, end in spans]


def row_costs(job: dict) -> dict:
    """torch's device allocations for the checkpoint's tensors, and pinning, each on its own."""
    torch, dev = _torch_on(job["device"])
    if dev is None:
        return {"skipped": "simulated driver: torch has no CUDA here"}
    nbytes = _tensor_bytes(job["path"])
    out: dict[str, Any] = {"tensors": len(nbytes), "bytes": sum(nbytes)}
    for label in ("alloc_cold_s", "alloc_cached_s"):
        t0 = time.perf_counter()
        ts = [torch.empty(n, dtype=torch.uint8, device=dev) for n in nbytes]
        torch.cuda.synchronize(dev)
        out[label] = time.perf_counter() - t0
        del ts
    torch.cuda.empty_cache()
    kept = []  # torch caches freed page-locked blocks: keep them, so each size is pinned anew
    for n, label in ((256 * MiB, "pin_256MiB_s"), (GiB, "pin_1GiB_s")):
        t0 = time.perf_counter()
        kept.append(torch.empty(n, dtype=torch.uint8, pin_memory=True))
        out[label] = time.perf_counter() - t0
        out[label.replace("_s", "_gb_per_s")] = n / out[label] / 1e9
    del kept
    for huge in (False, True):
        key = "register_1GiB_thp" if huge else "register_1GiB"
        try:
            out[key] = _register(GiB, huge)
        except Exception as e:  # an experiment: its failure is a number too
            out[key] = {"error": f"{type(e).__name__}: {e}"}
    try:
        size = min(GiB, os.path.getsize(job["path"]) // (2 * MiB) * (2 * MiB))
        out["register_file_ro"] = _register_file(job["path"], size, dev)
    except Exception as e:
        out["register_file_ro"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            out["thp"] = f.read().strip()
    except OSError as e:
        out["thp"] = str(e)
    return out


def _register(n: int, huge: bool) -> dict:
    """The other way to page-lock memory: anonymous memory (with transparent huge pages asked for,
    or not) faulted in, then ``cuMemHostRegister``: the time of each step. Huge pages may pin much
    faster than cuMemHostAlloc's 4 KiB pages (a candidate for fastload's staging)."""
    import ctypes
    import mmap

    cuda = ctypes.CDLL("libcuda.so.1")
    register, unregister = cuda.cuMemHostRegister_v2, cuda.cuMemHostUnregister
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    unregister.argtypes = [ctypes.c_void_p]
    mm = mmap.mmap(-1, n + 2 * MiB)
    if huge:
        mm.madvise(mmap.MADV_HUGEPAGE)
    base = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    addr = (base + 2 * MiB - 1) // (2 * MiB) * (2 * MiB)  # 2 MiB aligned, for huge pages
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    ctypes.memset(addr, 1, n)
    out["touch_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    code = register(addr, n, 1)  # CU_MEMHOSTREGISTER_PORTABLE
    out["register_s"] = time.perf_counter() - t0
    out["register_gb_per_s"] = n / out["register_s"] / 1e9
    out["code"] = code
    if code == 0:
        t0 = time.perf_counter()
        out["unregister_code"] = unregister(addr)
        out["unregister_s"] = time.perf_counter() - t0
    try:
        with open("/proc/self/smaps_rollup") as f:
            out["anon_huge_kib"] = next(
                int(line.split()[1]) for line in f if line.startswith("AnonHugePages:")
            )
    except (OSError, StopIteration):
        pass
    return out


def _register_file(path: str, n: int, dev) -> dict:
    """Whether the copy engine can read a warm file's page cache directly: the file's first
    ``n`` bytes mapped (private: its pages are the page cache's until written, and nothing
    writes them), registered with ``cuMemHostRegister(CU_MEMHOSTREGISTER_READ_ONLY)`` and copied
    to the device by ``cuMemcpyHtoD`` with no CPU copy: the time of each step (against a read
    into page-locked memory then a copy, what fastload's staging does)."""
    import ctypes
    import mmap

    import torch

    cuda = ctypes.CDLL("libcuda.so.1")
    register, unregister = cuda.cuMemHostRegister_v2, cuda.cuMemHostUnregister
    register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    unregister.argtypes = [ctypes.c_void_p]
    copy = cuda.cuMemcpyHtoD_v2
    copy.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), n, flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)  # fmt: skip
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    torch.cuda.synchronize(dev)
    out: dict[str, Any] = {"bytes": n}
    t0 = time.perf_counter()
    out["code"] = register(addr, n, 8)  # CU_MEMHOSTREGISTER_READ_ONLY
    out["register_s"] = time.perf_counter() - t0
    if out["code"] != 0:
        return out
    for label in ("copy_s", "copy_again_s"):
        t0 = time.perf_counter()
        out[label + "_code"] = copy(dst.data_ptr(), addr, n)
        torch.cuda.synchronize(dev)
        out[label] = time.perf_counter() - t0
    out["copy_gb_per_s"] = n / min(out["copy_s"], out["copy_again_s"]) / 1e9
    t0 = time.perf_counter()
    out["unregister_code"] = unregister(addr)
    out["unregister_s"] = time.perf_counter() - t0
    return out


def _union(spans: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def row_profile(job: dict) -> dict:
    """One first load under torch.profiler: the copies on the GPU and the CUDA API calls."""
    torch, dev = _torch_on(job["device"])
    if dev is None:
        return {"skipped": "simulated driver: torch has no CUDA here"}
    from torch.profiler import ProfilerActivity, profile, record_function

    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        with record_function("fastload_load"):
            t0 = time.perf_counter()
            got, stats, _ = _fastload_load(job["path"], dev, job["options"])
            torch.cuda.synchronize(dev)
            seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"seconds": seconds, "pinned_ms": stats.get("pinned_ms")}
    del got
    events = list(prof.events())
    load = next((e for e in events if e.name == "fastload_load"), None)
    base = load.time_range.start if load is not None else 0.0
    copies = [
        (e.time_range.start - base, e.time_range.end - base)
        for e in events
        if "memcpy" in e.name.lower()
        and "htod" in e.name.lower().replace(" ", "")
        and e.device_type == torch.autograd.DeviceType.CUDA
    ]
    if copies:
        out["copies"] = {
            "count": len(copies),
            "busy_ms": _union(copies) / 1e3,
            "first_start_ms": min(a for a, _ in copies) / 1e3,
            "last_end_ms": max(b for _, b in copies) / 1e3,
        }
    calls: dict[str, list[float]] = {}
    for e in events:
        if e.name.startswith("cu") and e.device_type == torch.autograd.DeviceType.CPU:
            calls.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
    out["api_calls"] = {
        name: {"count": len(d), "ms": sum(d) / 1e3}
        for name, d in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:25]
    }
    empties = [e for e in events if e.name == "aten::empty"]
    out["aten_empty"] = {
        "count": len(empties),
        "ms": sum(e.time_range.end - e.time_range.start for e in empties) / 1e3,
    }
    trace = job.get("trace")
    if trace:
        try:
            prof.export_chrome_trace(trace)
            out["trace"] = trace
        except Exception as e:  # the numbers above stand without it
            out["trace_error"] = f"{type(e).__name__}: {e}"
    return out


ROWS = {
    "fastload": row_fastload,
    "safetensors": row_safetensors,
    "costs": row_costs,
    "profile": row_profile,
}


def child(job: dict) -> None:
    try:
        out = ROWS[job["row"]](job)
    except Exception as e:
        import traceback

        out = {"error": f"{type(e).__name__}: {e}", "traceback": short(traceback.format_exc())}
    # A normal exit: the simulated driver writes its counters at exit.
    print("ROW " + json.dumps(out, default=str), flush=True)


# ---------------------------------------------------------------------------------------------
# The parent: checkpoint, rows, summary


def run_row(job: dict, timeout: float, sim_log: Path | None) -> dict:
    """One row in a fresh process (page cache warmed first). On the simulated driver each row's
    process writes its counters to a log of its own (`sim_log`), merged by `merge_sim_logs`."""
    from fastload import _pagecache

    _pagecache.warm(job["path"])
    env = dict(os.environ)
    if sim_log is not None:
        env["FAKE_CUDA_LOG"] = str(sim_log)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [sys.executable, __file__, "--child", json.dumps(job)],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:g} s"}
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if not lines:
        return {"error": f"exit {proc.returncode}: {short(proc.stdout + proc.stderr)}"}
    out = json.loads(lines[-1][4:])
    out["process_s"] = time.perf_counter() - t0
    return out


def merge_sim_logs(target: Path, logs: list[Path]) -> None:
    """The simulated driver's counters of every row's process, in one log where the runner reads
    them (FAKE_CUDA_LOG): peaks are the highest, the other counters add up."""
    total: dict[str, int] = {}
    for log in logs:
        if not log.exists():
            continue
        for k, v in (f.split("=", 1) for f in log.read_text().split() if "=" in f):
            total[k] = max(total.get(k, 0), int(v)) if "peak" in k else total.get(k, 0) + int(v)
    if total:
        target.write_text(" ".join(f"{k}={v}" for k, v in total.items()) + "\n")


def _first(row: dict, load: str = "first") -> dict:
    return next((x for x in row.get("loads", []) if x["load"] == load), {})


def summary(rows: dict) -> str:
    """One line: each fastload load, safetensors, and the costs on their own."""
    parts = []
    names = ("fastload", "fastload_b16", "fastload_c64", "fastload_mmap", "fastload_mmap_b32",
             "fastload_s2")  # fmt: skip
    for name in names:
        for ld in rows.get(name, {}).get("loads", []):
            pinned = ld.get("pinned_bytes") or 0
            lent = ld.get("lent_bytes") or 0
            refused = f", lending refused: {ld['lend_refused']}" if ld.get("lend_refused") else ""
            parts.append(
                f"{name} {ld['load']} {ld['seconds']:.3f} s ({ld['gb_per_s']:.2f} GB/s; pinned "
                f"{pinned / MiB:.0f} MiB in {ld.get('pinned_ms') or 0:.0f} ms, staging peak "
                f"{(ld.get('staging_peak_bytes') or 0) / MiB:.0f} MiB"
                + (f", lent {lent / MiB:.0f} MiB" if lent else "")
                + f"{refused})"
            )
    for name in names:
        for ld in rows.get(name, {}).get("loads", []):
            if ld["load"] == "first":
                parts.append(breakdown_line(name, ld))
    for ld in rows.get("safetensors", {}).get("loads", []):
        parts.append(f"safetensors {ld['load']} {ld['seconds']:.3f} s ({ld['gb_per_s']:.2f} GB/s)")
    costs = rows.get("costs", {})
    if "alloc_cold_s" in costs:
        parts.append(
            f"torch.empty x{costs['tensors']} cold {costs['alloc_cold_s']:.3f} s, cached "
            f"{costs['alloc_cached_s']:.3f} s; pin 256 MiB {costs['pin_256MiB_s']:.3f} s, 1 GiB "
            f"{costs['pin_1GiB_s']:.3f} s ({costs['pin_1GiB_gb_per_s']:.1f} GB/s)"
        )
        ro = costs.get("register_file_ro", {})
        if "register_s" in ro:
            parts.append(
                f"file pages registered read-only (code {ro['code']}) in {ro['register_s']:.3f} s"
                + (f", copied at {ro['copy_gb_per_s']:.1f} GB/s" if "copy_gb_per_s" in ro else "")
            )
        for key in ("register_1GiB", "register_1GiB_thp"):
            r = costs.get(key, {})
            if "register_s" in r:
                parts.append(
                    f"{key}: touch {r['touch_s']:.3f} s + cuMemHostRegister "
                    f"{r['register_s']:.3f} s (code {r['code']})"
                )
    copies = rows.get("profile", {}).get("copies")
    if copies:
        parts.append(
            f"profiled first load: {copies['count']} copies busy {copies['busy_ms']:.0f} ms, "
            f"from {copies['first_start_ms']:.0f} to {copies['last_end_ms']:.0f} ms"
        )
    return "; ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--work", help="checkpoint folder [a temporary one]")
    ap.add_argument("--out", help="where the JSON goes [$OUT, else --work]")
    ap.add_argument("--size", help="checkpoint size [2GiB; 64MiB on the simulated driver]")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rows", default="fastload,fastload_b16,fastload_c64,fastload_mmap,"
                    "fastload_mmap_b32,fastload_s2,safetensors,costs,profile")  # fmt: skip
    ap.add_argument("--timeout", type=float, default=60, help="seconds per row")
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0

    import tempfile

    from make_checkpoint import checkpoint_files, generate, make_spec, parse_size

    work = Path(args.work or tempfile.mkdtemp(prefix="profile_load."))
    out_dir = Path(args.out or os.environ.get("OUT") or work)
    out_dir.mkdir(parents=True, exist_ok=True)
    size = args.size or ("64MiB" if simulated() else "2GiB")
    started = time.perf_counter()
    spec = make_spec(size=parse_size(size), dtype="bf16")
    # gpu_bench.py's folder in a kit run: one of the two checks writes the checkpoint.
    files = checkpoint_files(generate(spec, work / "gpu_bench_ckpt", quiet=True))
    path = files[0]
    report: dict[str, Any] = {
        "file": path,
        "bytes": os.path.getsize(path),
        "checkpoint_s": time.perf_counter() - started,
        "simulated": simulated(),
        "rows": {},
    }
    base = {"path": path, "device": args.device}
    jobs = {
        "fastload": {"row": "fastload", "options": {},
                     "loads": ["first", "second", "after_release"]},
        "fastload_b16": {"row": "fastload", "options": {"block_size": "16MiB"},
                         "loads": ["first", "second"]},
        "fastload_c64": {"row": "fastload", "options": {"concurrency": 64},
                         "loads": ["first", "second"]},
        "fastload_mmap": {"row": "fastload", "options": {"method": "mmap"},
                          "loads": ["first", "second"]},
        "fastload_mmap_b32": {"row": "fastload",
                              "options": {"method": "mmap", "block_size": "32MiB"},
                              "loads": ["first", "second"]},
        "fastload_s2": {"row": "fastload", "options": {"copy_streams": 2},
                        "loads": ["first", "second"]},
        "safetensors": {"row": "safetensors"},
        "costs": {"row": "costs"},
        "profile": {"row": "profile", "options": {},
                    "trace": str(out_dir / "profile_load_trace.json")},
    }  # fmt: skip
    names = [r for r in args.rows.split(",") if r]
    if simulated():  # torch has no CUDA there: only fastload's rows mean anything
        names = [n for n in names if n.startswith("fastload")]
    sim_target = os.environ.get("FAKE_CUDA_LOG")
    sim_logs = []
    for name in names:
        sim_log = Path(f"{sim_target}.{name}") if sim_target else None
        report["rows"][name] = run_row({**base, **jobs[name]}, args.timeout, sim_log)
        sim_logs += [sim_log] if sim_log else []
        print(f"profile_load: {name}: {json.dumps(report['rows'][name])[:300]}", file=sys.stderr)
        for ld in report["rows"][name].get("loads", []):
            line = breakdown_line(name, ld) if "where_ms" in ld else ""
            if line:  # where the time went, readable in the kit's log as the run goes
                print(f"profile_load: {line}", file=sys.stderr)
    if sim_target:
        merge_sim_logs(Path(sim_target), sim_logs)
    report["seconds"] = time.perf_counter() - started
    sums = {f"{name} {ld['load']}": ld["checksum"] for name, row in report["rows"].items()
            for ld in row.get("loads", []) if "checksum" in ld}  # fmt: skip
    report["checksums_agree"] = len(set(sums.values())) <= 1
    (out_dir / "profile_load.json").write_text(json.dumps(report, indent=1, default=str))
    errors = {k: v["error"] for k, v in report["rows"].items() if "error" in v}
    first = _first(report["rows"].get("fastload", {}))
    ok = not errors and bool(first) and report["checksums_agree"]
    details = (
        summary(report["rows"])
        if ok
        else f"rows failed: {errors}"
        if errors or not first
        else f"the loads got different bytes: checksums {sums}"
    )
    report["json"] = str(out_dir / "profile_load.json")
    res = result("pass" if ok else "fail", details, **report)
    print(RESULT_TAG + json.dumps(res, default=str), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
