"""Storage → GPU: fastload beside its peers on the same files, in one run (needs a CUDA device).

    python benches/gpu_bench.py                      # 2 GiB llama-like checkpoint, 3 rounds
    python benches/gpu_bench.py --size 8GiB --reps 5 --device cuda:0
    python benches/gpu_bench.py --cache warm          # page cache only (PCIe + pipeline)

Rows, each measured in a fresh process with the CUDA context already created (a server has one
before it loads weights; creating it is the same for everyone), timed until every tensor is on
the device (``torch.cuda.synchronize``):
- fastload ``load(device=...)``: reads into a page-locked ring, async copies on its own stream;
- safetensors ``load_file(device=...)`` and runai-model-streamer (tensors ``.to(device)`` as they
  are handed over), fastsafetensors (``nogds=True``) where installed;
- the two legs on their own: ``read`` (fastload to host memory with ``method="read"``, the same
  reads without copies) and ``copy`` (one pinned host buffer of the checkpoint's size copied to
  the device): a load that overlaps them well takes about ``max(read, copy)``, not their sum.
Rounds are interleaved so drift lands on every row alike. Prints a table; ``--json`` writes it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import limits  # noqa: E402
from make_checkpoint import checkpoint_files, generate, make_spec, parse_size  # noqa: E402


def _sync(device: str) -> None:
    # --device cpu runs the harness without a GPU (a smoke test of this script).
    if device != "cpu":
        import torch

        torch.cuda.synchronize(device)


def _sync_all(tensors, device) -> int:
    _sync(device)
    return sum(t.nbytes for t in tensors)


def run_fastload(files: list[str], device: str) -> int:
    import fastload

    return _sync_all(fastload.load(files, device=device).values(), device)


def run_read_leg(files: list[str], device: str) -> int:
    import fastload

    return sum(t.nbytes for t in fastload.load(files, method="read").values())


def run_copy_leg(files: list[str], device: str) -> int:
    import torch

    size = sum(os.path.getsize(f) for f in files)
    host = torch.ones(size, dtype=torch.uint8)
    if device != "cpu":
        host = host.pin_memory()
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    _sync(device)
    global _CLOCK_START  # the pinned allocation is setup, not copying
    _CLOCK_START = time.perf_counter()
    dev.copy_(host, non_blocking=True)
    _sync(device)
    return size


def run_safetensors(files: list[str], device: str) -> int:
    from safetensors.torch import load_file

    out: list = []
    for f in files:
        out.extend(load_file(f, device=device).values())
    return _sync_all(out, device)


def run_runai(files: list[str], device: str) -> int:
    os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
    from runai_model_streamer import SafetensorsStreamer

    out = []
    with SafetensorsStreamer() as s:
        s.stream_files(files, owned=False)
        for _, t in s.get_tensors():
            out.append(t.to(device))
    return _sync_all(out, device)


def run_fastsafetensors(files: list[str], device: str) -> int:
    from fastsafetensors import fastsafe_open

    with fastsafe_open(files, framework="pt", device=device, nogds=True) as f:
        out = [f.get_tensor(k).clone() for k in f.keys()]
    return _sync_all(out, device)


ROWS = {
    "fastload": run_fastload,
    "safetensors": run_safetensors,
    "runai": run_runai,
    "fastsafetensors": run_fastsafetensors,
    "leg:read": run_read_leg,
    "leg:copy": run_copy_leg,
}
_CLOCK_START = 0.0


def one(job: dict) -> dict:
    """Runs in a fresh process: one row, one measurement."""
    global _CLOCK_START
    import torch

    device = job["device"]
    # Every row imports its loader before the clock (as fastload bench --compare's driver does):
    # no row's clock pays for an import another row made before its own.
    modules = {
        "runai": ["runai_model_streamer"],
        "fastsafetensors": ["fastsafetensors"],
        "fastload": ["fastload", "fastload._torch"],
        "leg:read": ["fastload", "fastload._torch"],
        "safetensors": ["safetensors.torch"],
    }
    try:
        for module in modules.get(job["row"], []):
            __import__(module)
    except ImportError as e:
        return {"skipped": str(e)}
    torch.empty(1, device=device)  # the CUDA context exists before the clock starts
    _sync(device)
    _CLOCK_START = time.perf_counter()
    nbytes = ROWS[job["row"]](job["files"], device)
    return {"seconds": time.perf_counter() - _CLOCK_START, "bytes": nbytes}


def measure(python: str, job: dict, timeout: int, script: str = __file__) -> dict:
    """One row in a fresh process: ``script --one JOB``, whose last JSON line is the result."""
    proc = subprocess.run(
        [python, script, "--one", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        return {"error": (proc.stderr or proc.stdout)[-1500:]}
    return json.loads(lines[-1])


def bench_args(description: str, rows: dict, reps: int, cache: str, timeout: int):
    """The options this script and benches/tp_gpu_bench.py share (``--one JOB``: one row in
    this process, see :func:`measure`)."""
    ap = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--size", default="2GiB")
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--reps", type=int, default=reps)
    ap.add_argument("--cache", default=cache)
    ap.add_argument("--rows", default=",".join(rows))
    ap.add_argument("--ckpt-dir", default=str(HERE / "ckpt"))
    ap.add_argument("--timeout", type=int, default=timeout)
    ap.add_argument("--json", help="write the results here")
    return ap


def run_one(args, one) -> None:
    """With ``--one JOB``: runs that row here, prints its result and exits."""
    if args.one:
        print(json.dumps(one(json.loads(args.one))), flush=True)
        os._exit(0)


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, ROWS, reps=3, cache="cold,warm", timeout=600)
    ap.add_argument("--shards", type=int, default=1)
    args = ap.parse_args(argv)
    run_one(args, one)

    spec = make_spec(size=parse_size(args.size), shards=args.shards, dtype="bf16")
    files = checkpoint_files(generate(spec, args.ckpt_dir, quiet=True))
    total = sum(os.path.getsize(f) for f in files)
    rows = [r for r in args.rows.split(",") if r]
    results: dict[tuple[str, str], list[float]] = {}
    notes: dict[str, str] = {}
    for cache in args.cache.split(","):
        for rep in range(args.reps):
            for i in range(len(rows)):
                row = rows[(i + rep) % len(rows)]  # rotated order: drift hits every row alike
                if row in notes:
                    continue
                if cache == "cold":
                    limits.evict(*files)
                else:
                    limits.warm(*files)
                job = {"row": row, "files": files, "device": args.device}
                res = measure(sys.executable, job, args.timeout)
                if "seconds" not in res:
                    notes[row] = (
                        res.get("skipped") or res.get("error", "?").strip().splitlines()[-1]
                    )
                    continue
                results.setdefault((row, cache), []).append(res["seconds"])
                print(f"{cache:5} {row:16} {res['seconds']:8.3f} s", file=sys.stderr)

    import torch

    name = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device))
    print(
        f"\n{total / 1e9:.2f} GB in {len(files)} file(s) → {args.device} ({name}), "
        f"best of {args.reps}\n"
    )
    table = []
    for cache in args.cache.split(","):
        best = {r: min(v) for (r, c), v in results.items() if c == cache}
        peers = [best[r] for r in ("safetensors", "runai", "fastsafetensors") if r in best]
        legs = [best[r] for r in ("leg:read", "leg:copy") if r in best]
        print(f"{cache}:  row               seconds     GB/s   vs best peer   vs max(read, copy)")
        for row in rows:
            if row not in best:
                print(f"       {row:16} {'-':>8}   ({notes.get(row, 'not run')})")
                continue
            s = best[row]
            vs_peer = f"{min(peers) / s:11.2f}x" if peers and row == "fastload" else " " * 12
            vs_legs = f"{s / max(legs):10.2f}x" if len(legs) == 2 and row == "fastload" else ""
            print(f"       {row:16} {s:8.3f} {total / s / 1e9:8.2f}   {vs_peer}   {vs_legs}")
            table.append({"cache": cache, "row": row, "seconds": s, "gb_per_s": total / s / 1e9})
        print()
    if args.json:
        Path(args.json).write_text(
            json.dumps({"device": name, "bytes": total, "rows": table, "notes": notes}, indent=1)
        )


if __name__ == "__main__":
    main()
