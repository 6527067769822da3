"""What the local cache (``cache=``) costs and gives.

Serves a generated checkpoint from tests/servers/http.py's Range server (ETags, in a process of
its own) and times, each ``--reps`` times (the best and median reported):

- ``local``: ``fastload.load(path)`` of the same file on local disk (warm page cache);
- ``cached``: ``fastload.load(url, cache=DIR)`` once DIR holds the copy (a HEAD for the ETag,
  then the local fast path on the copy, warm page cache): the target is within 10% of ``local``;
- ``remote``: ``fastload.load(url)``, no cache;
- ``filling``: ``fastload.load(url, cache=EMPTY_DIR)``: the remote load plus the positioned
  writes of every block; the flush (fsync), check and rename of the copy happen after the load
  returned and are reported apart.

Every run reads every page of every tensor inside the clock (``fastload._peers.touch``).

    python benches/cache_bench.py --size 512MiB --reps 3
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import fastload
import torch
from fastload._pagecache import evict
from fastload._peers import touch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent

SERVER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from servers.http import start_server
server = start_server({"m/model.safetensors": sys.argv[1]})
print(server.url("m/model.safetensors"), flush=True)
time.sleep(1e9)
"""


def checkpoint(path: Path, size: int) -> Path:
    per = 16 << 20  # bytes per tensor (bf16)
    g = torch.Generator().manual_seed(0)
    tensors = {
        f"layer.{i}.weight": torch.randn(per // 2, generator=g).to(torch.bfloat16)
        for i in range(max(1, size // per))
    }
    save_file(tensors, str(path))
    return path


def timed(fn, reps: int, after=None, before=None) -> dict:
    """Each run: `fn()` (a load), then every page of every tensor read (`fastload._peers.touch`, as
    benches/run.py's `load` workload does), inside the clock; `after()` outside it."""
    runs = []
    for _ in range(reps):
        if before is not None:
            before()
        t0 = time.perf_counter()
        out = fn()
        touch(out.values())
        runs.append(time.perf_counter() - t0)
        del out
        if after is not None:
            after()
    return {"best_s": min(runs), "median_s": statistics.median(runs), "runs": runs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="512MiB", help="checkpoint size (default 512MiB)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument(
        "--cold", action="store_true", help="evict the local file and the copy before each run"
    )
    args = ap.parse_args()
    size = fastload._fastload.parse_size(args.size)
    with tempfile.TemporaryDirectory(prefix="fastload-cache-bench-") as tmp:
        work = Path(tmp)
        path = checkpoint(work / "model.safetensors", size)
        server = subprocess.Popen(
            [sys.executable, "-c", SERVER, str(path), str(ROOT / "tests")],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            url = server.stdout.readline().strip()
            cache = work / "cache"
            fastload.load(url, cache=cache)  # fills the copy the `cached` runs read
            fastload.cache_stats()  # waits until it is published
            fill = work / "fill"
            published = []

            def filling():
                return fastload.load(url, cache=fill)

            def drop_copy():
                # The load returned before its copy was flushed and published: time that too.
                t0 = time.perf_counter()
                fastload.cache_stats()
                published.append(time.perf_counter() - t0)
                shutil.rmtree(fill)

            (copy,) = (cache / "objects").glob("*.safetensors")
            cold_local = (lambda: evict(path)) if args.cold else None
            cold_copy = (lambda: evict(copy)) if args.cold else None
            results = {
                "bytes": path.stat().st_size,
                "cold": args.cold,
                "local": timed(lambda: fastload.load(path), args.reps, before=cold_local),
                "cached": timed(
                    lambda: fastload.load(url, cache=cache), args.reps, before=cold_copy
                ),
                "remote": timed(lambda: fastload.load(url), args.reps),
                "filling": timed(filling, args.reps, after=drop_copy),
                "publish_after_return_s": published,
                "cache_stats": fastload.cache_stats(),
            }
        finally:
            server.kill()
            server.wait()
    if args.json:
        print(json.dumps(results, indent=2))
        return
    gb = results["bytes"] / 1e9
    state = "cold" if args.cold else "warm"
    print(f"{gb:.2f} GB, best of {args.reps} (median), every page read, {state} page cache")
    for key in ("local", "cached", "remote", "filling"):
        r = results[key]
        print(
            f"  {key:8s} {r['best_s']:7.3f} s ({r['median_s']:.3f})  {gb / r['best_s']:6.2f} GB/s"
        )
    ratio = results["cached"]["best_s"] / results["local"]["best_s"]
    cost = results["filling"]["best_s"] / results["remote"]["best_s"]
    print(f"  cached/local: {ratio:.2f}x   filling/remote: {cost:.2f}x")
    flush = statistics.median(results["publish_after_return_s"])
    print(f"  after a filling load returned, its copy was published {flush:.3f} s later (median)")


if __name__ == "__main__":
    main()
