"""Checks that need torch with a CUDA device (a real GPU): each runs in its own process.

python checks_gpu.py NAME WORKDIR
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from kit_common import MiB, checkpoint, differing, main, reference, result, verdict

GiB = 1 << 30


def _torch():
    import torch

    torch.cuda.init()
    return torch


def _busy_for(torch, seconds: float) -> float:
    """Queues ~``seconds`` of GPU work on the current stream (torch.cuda._sleep spins cycles;
    calibrated here), returns the seconds it was calibrated to."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles = 50_000_000
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_cycle = start.elapsed_time(end) / 1000 / cycles
    torch.cuda._sleep(int(seconds / per_cycle))
    return seconds


def busy_stream(work: Path) -> dict:
    """Ordering under a busy stream: the current stream is kept busy, then a tensor is filled on
    it and freed, so torch hands its memory to the load at once while the fill has not run yet.
    fastload's copies must wait for the fill: every loaded byte must match the file."""
    torch = _torch()
    dev = torch.device("cuda", 0)
    path = checkpoint(work, "busy", count=8, each=8 * MiB)
    want = reference(path)
    total = sum(t.nbytes for t in want.values())
    import fastload

    fastload.load(path, device=dev)  # first-time costs (pinning the ring) out of the way
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the filled tensor's block is the only free memory torch caches
    fill = torch.empty(total + 4 * MiB, dtype=torch.uint8, device=dev)
    span = (fill.data_ptr(), fill.data_ptr() + fill.numel())
    busy_s = _busy_for(torch, 1.0)
    fill.fill_(0xAB)
    filled = torch.cuda.Event()
    filled.record()
    del fill  # back to torch's cache on the current stream, the fill still queued
    t0 = time.perf_counter()
    got = fastload.load(path, device=dev)
    load_s = time.perf_counter() - t0
    fill_done_at_return = filled.query()
    torch.cuda.synchronize()
    reused = sum(span[0] <= t.data_ptr() < span[1] for t in got.values())
    bad = differing(got, want)
    numbers = {
        "bytes": total,
        "busy_s": busy_s,
        "load_s": load_s,
        "tensors_in_reused_memory": reused,
        "tensors": len(got),
        "fill_done_when_load_returned": fill_done_at_return,
        "allocator": torch.cuda.get_allocator_backend(),
    }
    if bad:
        return result(
            "fail",
            f"{len(bad)} of {len(want)} tensors differ (e.g. {bad[:3]}): the fill queued before "
            "the load landed after fastload's copies",
            **numbers,
        )
    if not reused:
        return result(
            "fail",
            "bytes right, but no tensor landed in the freed memory, so the ordering was not "
            "tested (the allocator did not reuse it)",
            **numbers,
        )
    return result(
        "pass",
        f"{reused}/{len(got)} tensors in memory freed with a fill still queued; bytes equal",
        **numbers,
    )


_LIBCUDA: list[ctypes.CDLL] = []


def _driver_context() -> int | None:
    """The calling thread's current CUDA context, as the driver has it (None: none)."""
    if not _LIBCUDA:
        _LIBCUDA.append(ctypes.CDLL("libcuda.so.1"))
    ctx = ctypes.c_void_p()
    _LIBCUDA[0].cuCtxGetCurrent(ctypes.byref(ctx))
    return ctx.value


def context_threads(work: Path) -> dict:
    """The current device and driver context of the calling thread are the same before and after
    ``load`` and ``release_memory()``, from fresh threads as well as the main one."""
    torch = _torch()
    import fastload

    path = checkpoint(work, "small", count=12, each=256 << 10)
    want = reference(path)
    n_dev = torch.cuda.device_count()

    def snap():
        return {"ctx": _driver_context(), "device": torch.cuda.current_device()}

    def scenario(set_device: int | None, load_to: str | None) -> dict:
        out: dict = {"set_device": set_device, "load_to": load_to}
        if set_device is not None:
            torch.cuda.set_device(set_device)
            torch.ones(1, device=f"cuda:{set_device}")  # the thread's context exists and is current
        else:
            out["ctx_at_start"] = _driver_context()
        out["before"] = snap() if set_device is not None else {"ctx": out["ctx_at_start"]}
        if load_to is not None:
            got = fastload.load(path, device=load_to)
            out["bad"] = differing(got, want)
            out["devices"] = sorted({str(t.device) for t in got.values()})
            out["after_load"] = snap()
            del got
        out["freed"] = fastload.release_memory()
        out["after_release"] = snap() if set_device is not None else {"ctx": _driver_context()}
        return out

    def in_thread(*args) -> dict:
        box: dict = {}

        def run():
            try:
                box.update(scenario(*args))
            except Exception as e:
                box["error"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=run)
        t.start()
        t.join(120)
        return box if not t.is_alive() else {"error": "the thread did not finish in 120 s"}

    runs = [
        scenario(0, "cuda:0"),  # the main thread
        in_thread(None, None),  # a thread that never used CUDA: release only
        in_thread(0, "cuda:0"),
        in_thread(0, "cuda"),
    ]
    if n_dev > 1:
        runs.append(in_thread(1, "cuda:0"))  # another device current: it stays current
        runs.append(in_thread(0, "cuda:1"))
    problems = []
    for i, r in enumerate(runs):
        if "error" in r:
            problems.append(f"scenario {i}: {r['error']}")
            continue
        if r.get("bad"):
            problems.append(f"scenario {i}: tensors differ {r['bad'][:3]}")
        for when in ("after_load", "after_release"):
            if when in r and r[when] != {k: v for k, v in r["before"].items() if k in r[when]}:
                problems.append(f"scenario {i}: {when} {r[when]} != before {r['before']}")
    return verdict(
        not problems,
        f"{len(runs)} scenarios ({n_dev} device(s)): device and context unchanged",
        "; ".join(problems),
        scenarios=runs,
    )


def run_ahead(work: Path) -> dict:
    """A consumer that sleeps 20 ms per tensor and drops it: the device memory fastload holds
    for tensors not yet received stays within ``memory_limit``, so the peak of torch's
    allocated memory stays within ``memory_limit`` plus the largest tensor (the one held)."""
    torch = _torch()
    import fastload

    path = checkpoint(work, "runahead", count=64, each=16 * MiB)
    limit = 128 * MiB
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    largest = count = 0
    t0 = time.perf_counter()
    with fastload.stream(path, device="cuda:0", memory_limit=limit, block_size="8MiB") as s:
        for _name, t in s:
            largest = max(largest, t.nbytes)
            count += 1
            time.sleep(0.02)
            del t
        stats = s.stats()
    seconds = time.perf_counter() - t0
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated(0) - base
    bound = limit + largest
    return verdict(
        peak <= bound,
        f"peak {peak / MiB:.0f} MiB <= memory_limit {limit / MiB:.0f} MiB + largest tensor "
        f"{largest / MiB:.0f} MiB ({count} tensors, {path.stat().st_size / MiB:.0f} MiB file)",
        f"peak {peak / MiB:.0f} MiB > memory_limit {limit / MiB:.0f} MiB + largest tensor "
        f"{largest / MiB:.0f} MiB: the load ran ahead of the consumer",
        peak_bytes=peak,
        bound_bytes=bound,
        memory_limit=limit,
        largest_tensor=largest,
        tensors=count,
        file_bytes=path.stat().st_size,
        seconds=seconds,
        stats=stats,
    )


def stats_thread(work: Path) -> dict:
    """A thread calling ``stats()`` every millisecond during a GPU load never stalls it (nor is
    stalled by it); ``close()`` from another thread ends a consumer's iteration."""
    torch = _torch()
    import fastload

    faulthandler.dump_traceback_later(240, exit=True)  # a deadlock shows where, then ends
    path = checkpoint(work, "runahead", count=64, each=16 * MiB)
    want = reference(path)
    s = fastload.stream(path, device="cuda:0", memory_limit="64MiB", block_size="4MiB")
    stop = threading.Event()
    calls: list[float] = []

    def poll():
        while not stop.is_set():
            t0 = time.perf_counter()
            s.stats()
            calls.append(time.perf_counter() - t0)
            time.sleep(0.001)

    poller = threading.Thread(target=poll, daemon=True)
    t0 = time.perf_counter()
    poller.start()
    got, gaps, last = {}, [], time.perf_counter()
    for name, t in s:
        got[name] = t
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    load_s = time.perf_counter() - t0
    stop.set()
    poller.join(30)
    s.close()
    torch.cuda.synchronize()
    bad = differing(got, want)
    del got

    # close() from another thread while the consumer waits for its next tensor.
    s2 = fastload.stream(path, device="cuda:0", memory_limit="64MiB", block_size="4MiB")
    closer = threading.Timer(0.05, s2.close)
    t1 = time.perf_counter()
    closer.start()
    received, end = 0, "exhausted"
    try:
        for _ in s2:
            received += 1
            time.sleep(0.01)
    except fastload.FastloadError as e:
        end = f"{type(e).__name__}: {e}"
    close_s = time.perf_counter() - t1
    closer.join()
    faulthandler.cancel_dump_traceback_later()
    worst = max(calls) if calls else 0.0
    numbers = {
        "load_s": load_s,
        "stats_calls": len(calls),
        "stats_worst_ms": worst * 1e3,
        "stats_median_ms": statistics.median(calls) * 1e3 if calls else None,
        "worst_gap_between_tensors_ms": max(gaps) * 1e3,
        "poller_finished": not poller.is_alive(),
        "close_from_thread": {"received": received, "ended": end, "seconds": close_s},
    }
    problems = []
    if bad:
        problems.append(f"tensors differ: {bad[:3]}")
    if poller.is_alive():
        problems.append("the stats() thread was still blocked 30 s after the load")
    if worst > 0.1:
        problems.append(f"a stats() call took {worst * 1e3:.0f} ms")
    if received >= len(want):
        problems.append("close() from another thread did not end the stream")
    return verdict(
        not problems,
        f"{len(calls)} stats() calls during a {load_s:.2f} s load, worst {worst * 1e3:.1f} ms; "
        f"close() from a thread ended the stream after {received} tensors",
        "; ".join(problems),
        **numbers,
    )


def cancellations(work: Path) -> dict:
    """50 streams closed after 0 to 3 tensors: device memory back to where it was, page-locked
    memory cached by fastload within ``memory_limit``, tensors received before close intact."""
    torch = _torch()
    import fastload

    path = checkpoint(work, "cancel", count=32, each=4 * MiB)
    want = reference(path)
    limit = 32 * MiB
    opts: dict[str, Any] = {"device": "cuda:0", "memory_limit": limit, "block_size": "1MiB"}
    fastload.load(path, **opts)  # the ring is pinned before the baseline
    torch.cuda.synchronize()
    gc.collect()
    base = torch.cuda.memory_allocated(0)
    pinned_max, bad = 0, []
    t0 = time.perf_counter()
    for i in range(50):
        s = fastload.stream(path, **opts)
        kept = [next(s) for _ in range(i % 4)]
        s.close()
        pinned_max = max(pinned_max, fastload.cached_memory()["pinned"])
        torch.cuda.synchronize()
        bad += differing(dict(kept), {n: want[n] for n, _ in kept})
        del kept, s
    seconds = time.perf_counter() - t0
    deadline = time.monotonic() + 10  # closed pipelines may free their last memory from threads
    while True:
        gc.collect()
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated(0)
        if after == base or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    problems = []
    if after != base:
        problems.append(f"device memory {after - base:+d} bytes against before")
    if pinned_max > limit:
        problems.append(f"page-locked cache {pinned_max} > memory_limit {limit}")
    if bad:
        problems.append(f"received tensors differ: {bad[:3]}")
    return verdict(
        not problems,
        f"50 cancellations in {seconds:.1f} s: device memory back to baseline, page-locked "
        f"cache at most {pinned_max / MiB:.0f} MiB (limit {limit / MiB:.0f} MiB)",
        "; ".join(problems),
        base_bytes=base,
        after_bytes=after,
        pinned_max=pinned_max,
        memory_limit=limit,
        seconds=seconds,
    )


def block_size_change(work: Path) -> dict:
    """After loads with one block size, loads with another are as fast as in a process that
    only ever used that one (no page-locked allocation per block), and the page-locked cache
    stays within ``memory_limit``; both directions."""
    torch = _torch()
    import fastload

    path = checkpoint(work, "blocks", count=32, each=16 * MiB)
    limit = 128 * MiB
    pinned_max = 0

    def timed(block: str) -> float:
        nonlocal pinned_max
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = fastload.load(path, device="cuda:0", block_size=block, memory_limit=limit)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        pinned_max = max(pinned_max, fastload.cached_memory()["pinned"])
        del got
        return dt

    rows: list[dict[str, Any]] = []
    for first, second in (("4MiB", "16MiB"), ("16MiB", "4MiB")):
        # The first load of each series pins its ring; the best of the next three is the rate.
        fastload.release_memory()
        alone = [timed(second) for _ in range(4)]
        fastload.release_memory()
        for _ in range(2):
            timed(first)
        switched = [timed(second) for _ in range(4)]
        rows.append(
            {
                "first": first,
                "second": second,
                "alone_s": min(alone[1:]),
                "after_switch_s": min(switched[1:]),
                "ratio": min(switched[1:]) / min(alone[1:]),
            }
        )
    slow = [r for r in rows if r["after_switch_s"] > 1.25 * r["alone_s"] + 0.02]
    problems = [
        f"{r['first']} -> {r['second']}: {r['after_switch_s']:.3f} s against "
        f"{r['alone_s']:.3f} s alone"
        for r in slow
    ]
    if pinned_max > limit:
        problems.append(f"page-locked cache {pinned_max} > memory_limit {limit}")
    return verdict(
        not problems,
        "; ".join(
            f"{r['first']} -> {r['second']}: {r['after_switch_s']:.3f} s vs {r['alone_s']:.3f} s"
            for r in rows
        )
        + f"; page-locked cache at most {pinned_max / MiB:.0f} MiB",
        "; ".join(problems),
        rows=rows,
        pinned_max=pinned_max,
        memory_limit=limit,
    )


def pinned_h2d(work: Path) -> dict:
    """The device's page-locked host-to-device copy rate: a 1 GiB pinned tensor
    ``.to("cuda", non_blocking=True)``, timed with CUDA events, best of 5."""
    torch = _torch()
    n = 1 * GiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev = host.to("cuda", non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(n / (start.elapsed_time(end) / 1000) / 1e9)
        del dev
    return result(
        "pass",
        f"{max(rates):.2f} GB/s ({torch.cuda.get_device_name(0)})",
        gb_per_s=max(rates),
        runs_gb_per_s=rates,
        bytes=n,
    )


def sanitizer_load(work: Path) -> dict:
    """The small load that compute-sanitizer watches (the runner parses its summary)."""
    _torch()
    import fastload

    path = checkpoint(work, "small", count=12, each=256 << 10)
    bad = differing(fastload.load(path, device="cuda:0", block_size="64KiB"), reference(path))
    return verdict(not bad, "bytes equal", f"tensors differ: {bad[:3]}")


CHECKS = {
    "busy_stream": busy_stream,
    "context_threads": context_threads,
    "run_ahead": run_ahead,
    "stats_thread": stats_thread,
    "cancellations": cancellations,
    "block_size_change": block_size_change,
    "pinned_h2d": pinned_h2d,
    "sanitizer_load": sanitizer_load,
}

if __name__ == "__main__":
    main(CHECKS)
