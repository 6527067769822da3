"""A process's first GPU load of a real-sized checkpoint, against the hardware's own rates and the
peers, all in one run (needs a CUDA device; ``--device cpu`` runs the harness without one).

    python benches/gpu_cold_start.py --json out.json     # Llama-3-8B's shapes, 4 shards, 16.06 GB
    python benches/gpu_cold_start.py --size 4MiB --device cpu --json out.json   # the harness only

On the same files (generated here: benches/make_checkpoint.py ``--family llama3``), each row one
load in a fresh process whose CUDA context exists before the clock, timed until every tensor is
usable (``torch.cuda.synchronize``):

- ``copy``: the device's page-locked host-to-device copy rate (1 GiB, CUDA events, best of 3);
- ``limits``: the disk's O_DIRECT read rate of the files at fastload's queue depth, 8 buffered
  readers, and the page-cache read rate (``fastload bench --limits-only``, as benches/limits.py);
- ``fastload``: ``fastload.load(dir, device=...)`` (as ``stream``, for its ``stats()``: where the
  time went, what it pinned), then a second load in the same process; the page-locked memory it
  keeps against ``memory_limit`` and torch's device memory peak against the tensors' bytes;
- ``fastload-mmap``: the same with ``method="mmap"``: the files' pages lent to the device
  (registered read-only where they are) and copied with no CPU copy out of the page cache;
- ``fastload-direct`` (cold only: warm, it reads as ``fastload`` does): ``method="direct"``, the
  blocks read around the page cache (``O_DIRECT``) straight into the page-locked ring (4 MiB
  blocks, the GPU default for local files); ``fastload-direct-b16`` the same with 16 MiB blocks
  (the block size for cold reads);
- ``fastload-streams2`` / ``fastload-mmap-streams2`` (warm, one run: cold, the disk is the limit):
  ``fastload`` and ``fastload-mmap`` with ``copy_streams=2``, blocks copied on two CUDA streams
  in turn (the device has more than one copy engine: one stream or several);
- ``fastload-b16`` (warm, one run, and cold): ``fastload`` with 16 MiB blocks instead of the
  default 4 MiB (block size for warm vs cold: a 512 MiB ring to pin, a quarter of the blocks);
- peers: ``safetensors`` (``load_file(device=)``), ``fastsafetensors`` (``nogds=True``),
  ``instanttensor`` and ``runai`` (runai-model-streamer), where they import (``--peers DIR``: a
  folder their wheels were installed in); a peer that cannot run is reported with why;
- ``parts-tp2`` / ``parts-tp8`` (``load(parts=)``) and ``lazy-tp2`` / ``lazy-tp8`` (the lazy
  tensors narrowed into preallocated parameters, benches/tp_gpu_bench.py's ``sliced``): rank 0's
  slices, rated by the bytes they read against the whole warm load's rate.

Warm rows run with the files in the page cache, cold ones after evicting them. The verdicts are
the cold-start targets: warm first load >= 0.8x the page-locked copy rate, second load >= 0.9x,
cold >= 0.95x the O_DIRECT rate, >= 1.2x the best warm peer and >= 1.0x the best cold one, the
slices >= 0.8x the whole load's rate. Beside them, the fastest of fastload's ways (warm first,
warm second, cold) against the same targets, so a run says which way a default should take; and
where a peer target is not met, the most the hardware allows (the copy rate, or the disk's, over
the best peer's). ``--json`` writes every number.
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

import limits  # noqa: E402
from gpu_bench import measure, run_fastsafetensors, run_runai  # noqa: E402
from make_checkpoint import checkpoint_files, generate, make_spec, parse_size  # noqa: E402

GiB = 1 << 30
PEERS = ("safetensors", "fastsafetensors", "instanttensor", "runai")
# What each row imports before its clock (no row pays for another's import).
IMPORTS = {
    "fastload": ["fastload", "fastload._torch"],
    "fastload-mmap": ["fastload", "fastload._torch"],
    "fastload-direct": ["fastload", "fastload._torch"],
    "fastload-streams2": ["fastload", "fastload._torch"],
    "fastload-mmap-streams2": ["fastload", "fastload._torch"],
    "fastload-direct-b16": ["fastload", "fastload._torch"],
    "fastload-b16": ["fastload", "fastload._torch"],
    "parts-tp2": ["fastload", "fastload._torch"],
    "parts-tp8": ["fastload", "fastload._torch"],
    "lazy-tp2": ["fastload", "fastload._lazy"],
    "lazy-tp8": ["fastload", "fastload._lazy"],
    "safetensors": ["safetensors.torch"],
    "fastsafetensors": ["fastsafetensors"],
    "instanttensor": ["instanttensor"],
    "runai": ["runai_model_streamer"],
}


# ---------------------------------------------------------------------------------------------
# In a fresh process: one row


def _sync(device: str) -> None:
    if device != "cpu":
        import torch

        torch.cuda.synchronize(device)


def _timed(fn, device: str) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def _nbytes(tensors) -> int:
    return sum(t.nbytes for t in tensors)


def row_copy(job: dict) -> dict:
    import torch

    if job["device"] == "cpu":
        return {"skipped": "no CUDA device (--device cpu)"}
    size = job.get("copy_bytes", GiB)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(size, dtype=torch.uint8, device=job["device"])
    best = float("inf")
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return {"seconds": best, "bytes": size}


def _fastload_once(job: dict, **options) -> dict:
    import fastload

    def run():
        with fastload.stream(job["dir"], device=job["device"], **options) as s:
            got = dict(s)
            return got, s.stats()

    seconds, (got, stats) = _timed(run, job["device"])
    return {"seconds": seconds, "got": got, "stats": stats, "bytes": _nbytes(got.values())}


def _stats_of(stats: dict) -> dict:
    keys = ("pinned_bytes", "pinned_ms", "staging_peak_bytes", "first_segment_ms", "concurrency",
            "block_size", "memory_limit", "bytes_read", "phases_ms", "part_bytes", "method",
            "method_reason", "lent_bytes", "lend_refused", "direct_bytes",
            "direct_refused", "copy_streams")  # fmt: skip
    return {k: stats[k] for k in keys if k in stats}


def row_fastload(job: dict) -> dict:
    """The first load of the process, then a second; memory kept against the limits."""
    import fastload
    import torch

    options = job.get("options", {})
    first = _fastload_once(job, **options)
    out: dict[str, Any] = {"seconds": first["seconds"], "bytes": first["bytes"],
                           "stats": _stats_of(first["stats"])}  # fmt: skip
    cached = fastload.cached_memory()
    out["pinned_cached"] = cached["pinned"]
    if job["device"] != "cpu":
        # torch's allocator holds the tensors; anything beyond them (rounding to 512 bytes
        # aside) is memory the load used on the way.
        out["device_peak"] = torch.cuda.max_memory_allocated(job["device"])
        out["device_rounding"] = sum(-(-t.nbytes // 512) * 512 for t in first["got"].values())
    del first
    if job.get("second", True):
        second = _fastload_once(job, **options)
        out["second"] = {"seconds": second["seconds"], "bytes": second["bytes"],
                         "stats": _stats_of(second["stats"])}  # fmt: skip
    return out


def row_parts(job: dict) -> dict:
    """Rank 0's slices of every 2-D tensor (as vLLM's linear layers cut them), through parts=."""
    from tp_gpu_bench import _layout, _part

    parts = {}
    for name, shape, _ in _layout(job["files"]):
        part = _part(name, shape, 0, job["tp"])
        if part is not None:
            dim, start, size = part
            index = [slice(None)] * len(shape)
            index[dim] = slice(start, start + size)
            parts[name] = tuple(index)
    res = _fastload_once(job, parts=parts)
    # The rate of a rank's load is of the bytes it read (its slices, gaps included, and the
    # whole tensors it keeps).
    return {"seconds": res["seconds"], "bytes": res["stats"]["bytes_read"],
            "kept": res["bytes"], "stats": _stats_of(res["stats"])}  # fmt: skip


def row_lazy(job: dict) -> dict:
    """benches/tp_gpu_bench.py's ``sliced`` row (lazy tensors into preallocated parameters)."""
    import tp_gpu_bench

    res = tp_gpu_bench.one({**job, "row": "sliced", "rank": 0})
    return {"seconds": res["seconds"], "bytes": res["kept"], "check": res["check"]}


def row_safetensors(job: dict) -> dict:
    from safetensors.torch import load_file

    def run():
        out: list = []
        for f in job["files"]:
            out.extend(load_file(f, device=job["device"]).values())
        return _nbytes(out)

    seconds, nbytes = _timed(run, job["device"])
    return {"seconds": seconds, "bytes": nbytes}


def row_instanttensor(job: dict) -> dict:
    if job["device"] == "cpu":
        return {"skipped": "needs a CUDA device"}
    import torch
    from instanttensor import safe_open

    index = torch.device(job["device"]).index or 0

    def run():
        # All files in one call: it plans reads across them (its README).
        with safe_open(job["files"], framework="pt", device=index) as f:
            return _nbytes([t for _, t in f.tensors()])

    seconds, nbytes = _timed(run, job["device"])
    return {"seconds": seconds, "bytes": nbytes}


def row_peer(run):
    def row(job: dict) -> dict:
        t0 = time.perf_counter()
        nbytes = run(job["files"], job["device"])
        return {"seconds": time.perf_counter() - t0, "bytes": nbytes}

    return row


ROWS = {
    "copy": row_copy,
    "fastload": row_fastload,
    "fastload-mmap": lambda job: row_fastload({**job, "options": {"method": "mmap"}}),
    "fastload-direct": lambda job: row_fastload({**job, "options": {"method": "direct"}}),
    "fastload-direct-b16": lambda job: row_fastload(
        {**job, "options": {"method": "direct", "block_size": "16MiB"}}
    ),
    "fastload-streams2": lambda job: row_fastload({**job, "options": {"copy_streams": 2}}),
    "fastload-mmap-streams2": lambda job: row_fastload(
        {**job, "options": {"method": "mmap", "copy_streams": 2}}
    ),
    "safetensors": row_safetensors,
    "fastsafetensors": row_peer(run_fastsafetensors),
    "instanttensor": row_instanttensor,
    "runai": row_peer(run_runai),
    # After the peers: a cold run cut short by the check's time limit loses this one first.
    "fastload-b16": lambda job: row_fastload({**job, "options": {"block_size": "16MiB"}}),
    "parts-tp2": row_parts,
    "parts-tp8": row_parts,
    "lazy-tp2": row_lazy,
    "lazy-tp8": row_lazy,
}


def one(job: dict) -> dict:
    import torch

    try:
        for module in IMPORTS.get(job["row"], []):
            __import__(module)
        if job["row"].startswith("lazy"):
            import torch.distributed.tensor  # as tp_gpu_bench.one does
    except Exception as e:  # ImportError, or a wheel built for another torch
        return {"skipped": f"{type(e).__name__}: {e}"}
    if job["device"] != "cpu":
        torch.empty(1, device=job["device"])  # the CUDA context, before the clock
        torch.cuda.synchronize(job["device"])
    return ROWS[job["row"]](job)


# ---------------------------------------------------------------------------------------------
# The parent: checkpoint, rows, verdicts


def _gbps(res: dict) -> float | None:
    return res["bytes"] / res["seconds"] / 1e9 if res.get("seconds") else None


def _fastest(rates: dict[str, float | None], cache: str, suffix: str = "") -> str | None:
    """The fastload row (whole loads: not the slices) fastest in `cache` by `rates`, or None
    (verdicts() passes each row's first run: a row run twice must not win on its better draw)."""
    keys = [k for k, v in rates.items() if v and k.startswith(f"{cache} fastload")
            and k.endswith(suffix) and (suffix or not k.endswith(" second"))]  # fmt: skip
    best = max(keys, key=lambda k: rates[k], default=None)
    return None if best is None else best[len(cache) + 1 : len(best) - len(suffix)]


def verdicts(rates: dict[str, float | None], firsts: dict[str, float] | None = None) -> list[dict]:
    """Each target of the cold start against what this run measured (None: not measured); a
    peer target also says how far the hardware lets it go (``bound``: the copy or disk rate over
    the best peer's) and whether that is short of the target (``out_of_reach``). The fastest of
    fastload's ways is picked on each row's first run (`firsts`; default `rates`) and rated on
    its best, as every row is."""

    def ratio(a, b):
        return None if rates.get(a) is None or not rates.get(b) else rates[a] / rates[b]

    best = {c: max((rates[f"{c} {p}"] for p in PEERS if rates.get(f"{c} {p}")), default=None)
            for c in ("warm", "cold")}  # fmt: skip
    disk = "disk O_DIRECT" if rates.get("disk O_DIRECT") or not rates.get("disk buffered x8") \
        else "disk buffered x8"  # fmt: skip
    ceiling = {"warm": rates.get("copy"), "cold": rates.get(disk)}

    def over_best(row, cache):
        rate = rates.get(f"{cache} {row}")
        return rate / best[cache] if best[cache] and rate else None

    def peer(name, row, cache, need):
        # A peer measured above the hardware's rate (noise, or a disk rate measured short)
        # shows the hardware reaches at least the peer: never a bound below 1.
        top, peak = ceiling[cache], best[cache]
        bound = max(top, peak) / peak if top and peak else None
        return (name, over_best(row, cache), need, bound)

    rows = [
        ("warm first load / page-locked copy rate", ratio("warm fastload", "copy"), 0.8),
        ("warm second load / page-locked copy rate", ratio("warm fastload second", "copy"), 0.9),
        ("cold load / disk O_DIRECT rate", ratio("cold fastload", "disk O_DIRECT"), 0.95)
        if disk == "disk O_DIRECT"
        else ("cold load / disk rate (buffered x8: no O_DIRECT here)",
              ratio("cold fastload", "disk buffered x8"), 0.95),
        peer("warm load / best warm peer", "fastload", "warm", 1.2),
        peer("cold load / best cold peer", "fastload", "cold", 1.0),
    ]  # fmt: skip

    def way(label, row, warm=True, cold=True):
        """The hardware targets of another of fastload's ways (its row in the rates)."""
        out = []
        if warm:
            out += [(f"warm first load, {label} / page-locked copy rate",
                     ratio(f"warm {row}", "copy"), 0.8),
                    (f"warm second load, {label} / page-locked copy rate",
                     ratio(f"warm {row} second", "copy"), 0.9)]  # fmt: skip
        if cold:
            out.append((f"cold load, {label} / disk O_DIRECT rate",
                        ratio(f"cold {row}", "disk O_DIRECT"), 0.95))  # fmt: skip
        return out

    # The same targets with method="mmap" (the files' pages lent to the device): which of the
    # two ways reaches them, side by side.
    rows += way("mmap", "fastload-mmap")
    # And cold with method="direct" (blocks read around the page cache into the ring).
    rows += way("direct", "fastload-direct", warm=False)
    rows.append(peer("cold load, direct / best cold peer", "fastload-direct", "cold", 1.0))
    rows += way("direct 16 MiB blocks", "fastload-direct-b16", warm=False)
    # And warm with two copy streams (blocks on each in turn), with and without lending.
    rows += way("2 copy streams", "fastload-streams2", cold=False)
    rows += way("mmap, 2 copy streams", "fastload-mmap-streams2", cold=False)
    # And 16 MiB blocks through the page cache, warm and cold (the default is 4 MiB).
    rows += way("16 MiB blocks", "fastload-b16")
    for tp in (2, 8):
        for kind in ("parts", "lazy"):
            rows.append((f"TP {tp} {kind} / whole load", ratio(f"warm {kind}-tp{tp}",
                                                              "warm fastload"), 0.8))  # fmt: skip
    # The fastest way fastload has, whichever row it was: what a default should be.
    pick = rates if firsts is None else firsts
    warm, second = _fastest(pick, "warm"), _fastest(pick, "warm", " second")
    cold = _fastest(pick, "cold")
    if warm:
        first = f"fastest warm first load ({warm})"
        rows.append((f"{first} / page-locked copy rate", ratio(f"warm {warm}", "copy"), 0.8))
        rows.append(peer(f"{first} / best warm peer", warm, "warm", 1.2))
    if second:
        name = f"fastest warm second load ({second}) / page-locked copy rate"
        rows.append((name, ratio(f"warm {second} second", "copy"), 0.9))
    if cold:
        name = f"fastest cold load ({cold})"
        rows.append((f"{name} / {disk} rate", ratio(f"cold {cold}", disk), 0.95))
        rows.append(peer(f"{name} / best cold peer", cold, "cold", 1.0))
    out = []
    for name, r, need, *bound in rows:
        v = {"target": name, "ratio": r, "needs": need, "met": None if r is None else r >= need}
        if bound:  # a peer target: out of reach when not met and the hardware stops short
            b = bound[0]
            v.update(bound=b, out_of_reach=v["met"] is False and b is not None and b < need)
        out.append(v)
    return out


def _memory_checks(res: dict, block: int) -> dict:
    """Pinned host memory within memory_limit; device memory within the tensors' own bytes
    plus one block per copy stream."""
    stats = res.get("stats", {})
    out: dict[str, Any] = {}
    if "memory_limit" in stats:
        out["pinned_cached"] = res.get("pinned_cached")
        out["pinned_within_limit"] = (res.get("pinned_cached") or 0) <= stats["memory_limit"]
    if "device_peak" in res:
        extra = res["device_peak"] - res["device_rounding"]
        out["device_beyond_tensors"] = extra
        out["device_within_a_block_per_stream"] = extra <= block * (stats.get("copy_streams") or 1)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="16GiB", help="16GiB: Llama-3-8B itself; less: scaled down")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--ckpt-dir", default=str(HERE / "ckpt"))
    ap.add_argument("--reps", type=int, default=2, help="warm loads per row (cold: one)")
    ap.add_argument("--cache", default="warm,cold")
    ap.add_argument("--rows", default=",".join(r for r in ROWS if r != "copy"))
    ap.add_argument("--peers", help="a folder the peers' wheels are installed in (PYTHONPATH)")
    ap.add_argument("--timeout", type=int, default=180, help="seconds per row")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.one:
        print(json.dumps(one(json.loads(args.one)), default=str), flush=True)
        os._exit(0)
    if args.peers:
        paths = [args.peers, os.environ.get("PYTHONPATH", "")]
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)

    started = time.perf_counter()
    spec = make_spec(size=parse_size(args.size), shards=args.shards, dtype="bf16",
                     family="llama3")  # fmt: skip
    stamp = generate(spec, args.ckpt_dir, quiet=True)
    files = checkpoint_files(stamp)
    report: dict[str, Any] = {"complete": False, "dir": stamp["dir"], "files": len(files),
                              "bytes": stamp["tensor_bytes"], "tensors": stamp["tensors"],
                              "checkpoint_s": time.perf_counter() - started, "rows": [],
                              "notes": {}, "limits": {}}  # fmt: skip
    print(f"gpu_cold_start: {report['bytes'] / 1e9:.2f} GB, {len(files)} files "
          f"({report['checkpoint_s']:.0f} s to write or find)", file=sys.stderr)  # fmt: skip
    rows = [r for r in args.rows.split(",") if r]
    base = {"dir": stamp["dir"], "files": files, "device": args.device}

    def run(cache: str, row: str) -> None:
        if row in report["notes"]:
            return
        if cache == "cold":
            limits.evict(*files)
        # A cold load's second load would be a warm one: the warm rows have it.
        job = {**base, "row": row, "tp": int(row[-1]) if row[-1].isdigit() else 1,
               "second": cache == "warm"}  # fmt: skip
        try:
            res = measure(sys.executable, job, args.timeout, __file__)
        except subprocess.TimeoutExpired:
            res = {"error": f"timed out after {args.timeout} s"}
        if "seconds" not in res:
            why = res.get("skipped") or res.get("error", "?").strip().splitlines()[-1]
            report["notes"][row] = why
            print(f"gpu_cold_start: {cache} {row}: not run: {why}", file=sys.stderr)
            return
        res.update(cache=cache, row=row, gb_per_s=_gbps(res))
        report["rows"].append(res)
        if args.json:  # after every row: a run stopped from outside leaves what it measured
            Path(args.json).write_text(json.dumps(report, indent=1, default=str))
        print(f"gpu_cold_start: {cache:4} {row:15} {res['seconds']:8.3f} s "
              f"{res['gb_per_s']:7.2f} GB/s", file=sys.stderr)  # fmt: skip

    run("warm", "copy")
    for cache in args.cache.split(","):
        if cache == "warm":  # once: 16 GB stay in the page cache between the warm rows
            limits.warm(*files)
        report["limits"][cache] = limits.storage(files, cache)
        reps = args.reps if cache == "warm" else 1
        for rep in range(reps):
            for i in range(len(rows)):
                row = rows[(i + rep) % len(rows)]  # rotated: drift hits every row alike
                if "tp" in row and (cache == "cold" or rep > 0):
                    continue  # the slices' targets are warm ones; one run each keeps it short
                if row.startswith("fastload-direct") and cache == "warm":
                    continue  # warm, its blocks are cached: it reads as the fastload row does
                if row.endswith("streams2") and (cache == "cold" or rep > 0):
                    continue  # cold, the disk is the limit, not the copies; one run keeps it short
                if row == "fastload-b16" and rep > 0:
                    continue  # one warm run keeps it short
                run(cache, row)
    report.update(summarise(report), complete=True)
    report["seconds"] = time.perf_counter() - started
    print_report(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1, default=str))
    return 0


def summarise(report: dict) -> dict:
    """Best rate per (cache, row), the verdicts, and the memory checks of the fastload rows."""
    rates: dict[str, float | None] = {}
    firsts: dict[str, float] = {}  # each row's first run: the fastest way is picked on these
    for r in report["rows"]:
        key = "copy" if r["row"] == "copy" else f"{r['cache']} {r['row']}"
        rates[key] = max(rates.get(key) or 0.0, r["gb_per_s"])
        firsts.setdefault(key, r["gb_per_s"])
        if "second" in r:
            second = f"{r['cache']} {r['row']} second"
            rate = r["second"]["bytes"] / r["second"]["seconds"] / 1e9
            rates[second] = max(rates.get(second) or 0.0, rate)
            firsts.setdefault(second, rate)
    # The disk's rate: O_DIRECT reads; where the filesystem refuses O_DIRECT, 8 buffered readers
    # of the evicted files (the verdict then says so).
    cold = report["limits"].get("cold", {})
    for label in ("disk O_DIRECT", "disk buffered x8"):
        rates[label] = cold.get(label, {}).get("gb_per_s")
    memory = [_memory_checks(r, r.get("stats", {}).get("block_size", 0))
              for r in report["rows"] if r["row"].startswith("fastload")]  # fmt: skip
    return {"rates": rates, "verdicts": verdicts(rates, firsts), "memory": memory}


def print_report(report: dict) -> None:
    print(f"\n{report['bytes'] / 1e9:.2f} GB, {report['tensors']} tensors in {report['files']} "
          f"files; best GB/s per row")  # fmt: skip
    for key, rate in report["rates"].items():
        print(f"  {key:28} {'-' if rate is None else f'{rate:8.2f}'}")
    for name, why in report["notes"].items():
        print(f"  {name:28} not run: {why}")
    print("targets:")
    for v in report["verdicts"]:
        r = "-" if v["ratio"] is None else f"{v['ratio']:.2f}x"
        met = {True: "met", False: "NOT MET", None: "not measured"}[v["met"]]
        if v.get("out_of_reach"):
            met += f" (the hardware allows at most {v['bound']:.2f}x: that limit over the best"
            met += " peer)"
        print(f"  {v['target']:42} {r:>8} (needs {v['needs']}x): {met}")
    for m in report["memory"]:
        print(f"  memory: {m}")


if __name__ == "__main__":
    sys.exit(main())
