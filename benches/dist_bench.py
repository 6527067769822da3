"""Many ranks, one checkpoint on S3: with the group sharing the reads, and without.

    python benches/dist_bench.py                       # 4 ranks, 256 MiB in 4 shards, 2 rounds
    python benches/dist_bench.py --ranks 4 --size 1GiB --reps 3 --loaders fastload,runai

One run starts `weed mini` on 127.0.0.1 (tests/servers/s3.py, with its Prometheus metrics port on),
uploads the checkpoint made by benches/make_checkpoint.py, then measures each row with a fresh
group of processes (torch.distributed, gloo, env:// on 127.0.0.1), rows interleaved per round:

- fastload group:  `fastload.load("s3://...", process_group=WORLD)`: each rank reads 1/N of the
                   bytes and the ranks exchange the rest point to point.
- fastload alone:  `fastload.load("s3://...")` on every rank at once (what N workers do today).
- runai dist:      runai-model-streamer 0.17 `SafetensorsStreamer().stream_files(files,
                   is_distributed=True)` with RUNAI_STREAMER_DIST=1 (its gloo opt-in; "auto" only
                   distributes over NCCL), each tensor cloned (they are views into its reused
                   buffers).
- runai alone:     the same with is_distributed=False, owned=True.

seconds: from a barrier before the load to a barrier after it, on rank 0 (so the slowest rank
counts). fetched: bytes the S3 server sent (SeaweedFS_s3_bucket_traffic_sent_bytes_total, headers
included), per group run. Every rank checks its tensors against the reference checksum. The
server shares the VM's cores with all ranks, so compare rows of one run, not absolute rates.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BUCKET = "bench"
PREFIX = "dist"
ROWS = {
    "fastload group": ("fastload", True),
    "fastload alone": ("fastload", False),
    "runai dist": ("runai", True),
    "runai alone": ("runai", False),
}


def checksum(tensors) -> int:
    """One byte of every 4 KiB page of every tensor plus its last byte, summed (order-free)."""
    acc = 0
    for t in tensors:
        if t.numel():
            a = t.detach().reshape(-1).view(__import__("torch").uint8).numpy()
            acc += int(a[::4096].sum(dtype="int64")) + int(a[-1])
    return acc


# ---------------------------------------------------------------- one rank ----------------------


def rank_main(job: dict) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    loader, grouped = ROWS[job["row"]]
    if loader == "runai":
        os.environ["RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING"] = "0"
        os.environ.setdefault("RUNAI_STREAMER_LOG_LEVEL", "WARNING")
        if grouped:
            os.environ["RUNAI_STREAMER_DIST"] = "1"
        from runai_model_streamer import SafetensorsStreamer
    else:
        import fastload
        import fastload.distributed
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    stats: dict = {}
    dist.barrier()
    t0 = time.perf_counter()
    if loader == "fastload":
        if grouped:
            tensors = fastload.load(job["uri"], process_group=dist.group.WORLD)
            stats = fastload.distributed.last_stats() or {}
        else:
            with fastload.stream(job["uri"]) as s:
                tensors = dict(s)
                stats = s.stats()
    else:
        with SafetensorsStreamer() as s:
            s.stream_files(job["files"], None, "cpu", grouped, owned=not grouped)
            tensors = {n: (t.clone() if grouped else t) for n, t in s.get_tensors()}
    mine = time.perf_counter() - t0
    dist.barrier()
    seconds = time.perf_counter() - t0
    out = {
        "rank": rank,
        "seconds": seconds,
        "own_seconds": mine,
        "tensors": len(tensors),
        "checksum": checksum(tensors.values()),
        "bytes_read": stats.get("bytes_read"),
    }
    Path(job["out"]).with_suffix(f".{rank}.json").write_text(json.dumps(out))
    dist.destroy_process_group()


# ---------------------------------------------------------------- driver ------------------------


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def served_bytes(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
    m = re.search(
        rf'^SeaweedFS_s3_bucket_traffic_sent_bytes_total\{{bucket="{BUCKET}"\}} (\S+)$',
        text,
        re.M,
    )
    return float(m.group(1)) if m else 0.0


def run_group(row: str, ranks: int, job: dict, env: dict, tmp: Path, timeout: float) -> dict:
    out = tmp / f"{row.replace(' ', '-')}-{time.monotonic_ns()}"
    job = {**job, "row": row, "out": str(out)}
    base = {**env, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    base.update(WORLD_SIZE=str(ranks), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--rank-job", json.dumps(job)],
            env={**base, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        for r in range(ranks)
    ]
    deadline = time.monotonic() + timeout
    logs = []
    for p in procs:
        try:
            logs.append(p.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            return {"error": f"timed out after {timeout:.0f} s"}
    if any(p.returncode for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode)
        tail = logs[bad].decode(errors="replace").strip().splitlines()[-3:]
        return {"error": f"rank {bad} exited {procs[bad].returncode}: " + " | ".join(tail)}
    results = [json.loads(out.with_suffix(f".{r}.json").read_text()) for r in range(ranks)]
    return {"ranks": results}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--size", default="256MiB", help="checkpoint tensor bytes (default 256MiB)")
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2, help="rounds of every row (default 2)")
    ap.add_argument("--loaders", default="fastload,runai")
    ap.add_argument("--timeout", type=float, default=600.0, help="per group run, seconds")
    ap.add_argument("--out", default=str(HERE / "out" / "dist_results.md"))
    args = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT / "tests"))
    sys.path.insert(0, str(HERE))
    import make_checkpoint
    from servers import s3 as s3_server

    stamp = make_checkpoint.generate(
        make_checkpoint.make_spec(args.size, "bf16", args.shards), HERE / "out" / "ckpt"
    )
    files = make_checkpoint.checkpoint_files(stamp)
    total = stamp["tensor_bytes"]
    from safetensors.torch import load_file

    want = sum(checksum(load_file(f).values()) for f in files)

    loaders = set(args.loaders.split(","))
    rows = [r for r, (loader, _) in ROWS.items() if loader in loaders]
    if "runai" in loaders:
        try:
            import runai_model_streamer  # noqa: F401
        except ImportError:
            print("runai-model-streamer is not installed: its rows are skipped", file=sys.stderr)
            rows = [r for r in rows if not r.startswith("runai")]

    metrics_port = free_port()
    command = s3_server.seaweed_command
    s3_server.seaweed_command = lambda *a: [*command(*a), f"-metricsPort={metrics_port}"]
    tmp = Path(tempfile.mkdtemp(prefix="dist-bench-"))
    server = s3_server.start_seaweed(tmp / "seaweed")
    metrics = f"http://127.0.0.1:{metrics_port}/metrics"
    results: dict[str, list[dict]] = {r: [] for r in rows}
    try:
        s3 = server.client()
        s3_server.upload(s3, BUCKET, {})
        for f in sorted(Path(stamp["dir"]).iterdir()):
            if f.suffix in (".safetensors", ".json") and f.name != make_checkpoint.STAMP:
                s3_server.upload(s3, BUCKET, {f"{PREFIX}/{f.name}": f})
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("AWS_", "FASTLOAD_", "RUNAI_STREAMER_"))
        }
        env.update(server.env())
        job = {
            "uri": f"s3://{BUCKET}/{PREFIX}/",
            "files": [f"s3://{BUCKET}/{PREFIX}/{Path(f).name}" for f in files],
        }
        for rep in range(args.reps):
            order = rows[rep % len(rows) :] + rows[: rep % len(rows)]
            for row in order:
                before = served_bytes(metrics)
                res = run_group(row, args.ranks, job, env, tmp, args.timeout)
                res["fetched"] = served_bytes(metrics) - before
                if "ranks" in res:
                    res["ok"] = all(
                        r["checksum"] == want and r["tensors"] == stamp["tensors"]
                        for r in res["ranks"]
                    )
                    res["seconds"] = res["ranks"][0]["seconds"]
                results[row].append(res)
                print(
                    f"[{rep}] {row}: "
                    + (
                        res.get("error")
                        or f"{res['seconds']:.2f} s, fetched {res['fetched'] / 1e6:.0f} MB, "
                        f"ok={res['ok']}"
                    ),
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        server.stop()

    table = report(results, args, total)
    print(table)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(table)
    Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=1))


def report(results: dict, args, total: int) -> str:
    lines = [
        f"{args.ranks} ranks (gloo, one VM), checkpoint {total / 1e6:.0f} MB of tensors in "
        f"{args.shards} files on SeaweedFS; {args.reps} rounds; seconds: median (min-max).",
        "",
        "| loader | seconds | GB/s per rank | fetched from S3 | x checkpoint | read per rank (MB)"
        " | bitwise ok |",
        "|---|---|---|---|---|---|---|",
    ]
    for row, runs in results.items():
        good = [r for r in runs if "ranks" in r]
        if not good:
            err = runs[0].get("error", "no runs") if runs else "no runs"
            lines.append(f"| {row} | failed: {err} | | | | | |")
            continue
        secs = [r["seconds"] for r in good]
        med = statistics.median(secs)
        fetched = statistics.median(r["fetched"] for r in good)
        per_rank = good[-1]["ranks"]
        read = [r["bytes_read"] for r in per_rank if r.get("bytes_read") is not None]
        read_cell = "/".join(f"{b / 1e6:.0f}" for b in read) if read else "n/a"
        lines.append(
            f"| {row} | {med:.2f} ({min(secs):.2f}-{max(secs):.2f}) | {total / med / 1e9:.2f} "
            f"| {fetched / 1e6:.0f} MB | {fetched / total:.2f} | {read_cell} "
            f"| {all(r['ok'] for r in good)} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--rank-job":
        rank_main(json.loads(sys.argv[2]))
    else:
        main()
