"""Raw limits measured in the same run as the loaders.

- Storage and page cache: `fastload bench --limits-only --json` on the same files, so the benches
  and the CLI compare with one measurement (src/cli/limits.rs): "disk O_DIRECT" (O_DIRECT reads,
  `concurrency` in flight), "disk buffered x8" (8 readers of evicted files through the page cache,
  readahead running ahead of each; on these virtual disks often faster than O_DIRECT, so both count
  as the cold limit) and "page-cache read" (the warm copy rate, one reader per core).
- memcpy: 1 GiB copy between pre-faulted buffers, 1 thread (numpy) and torch's intra-op threads.
- The page-cache helpers (evict, warm, resident_bytes) are fastload's own (fastload._pagecache).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from fastload import _pagecache

# --- page cache: fastload's own helpers ---

evict = _pagecache.evict
warm = _pagecache.warm
resident_bytes = _pagecache.resident_bytes


# --- storage: measured by `fastload bench --limits-only`, the same code the CLI compares with ---

# The names fastload bench gives its limits -> the labels benches/report.py shows.
LABELS = {
    "storage_direct": "disk O_DIRECT",
    "storage_buffered": "disk buffered x8",
    "page_cache": "page-cache read",
}


def storage(paths: list[str], cache: str, repeat: int = 1) -> dict[str, dict]:
    """The limits of `paths` for `cache` ("cold": O_DIRECT and buffered reads of evicted files;
    "warm": the page-cache copy rate), each the best of `repeat` passes, keyed by report label:
    {"gb_per_s", "bytes", "tool"} or {"error"}."""
    cmd = [sys.executable, "-m", "fastload._cli", "bench", *paths, "--limits-only", "--json"]
    cmd += [f"--{cache}", "--repeat", str(repeat)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if r.returncode != 0:
        return {"fastload bench": {"error": r.stderr.strip()[-500:]}}
    out = {}
    for name, limit in json.loads(r.stdout)["limits"].items():
        label = LABELS.get(name, name)
        if limit["gb_per_s"] is None:
            out[label] = {"error": limit["what"]}
        else:
            out[label] = {
                "gb_per_s": limit["gb_per_s"],
                "bytes": limit["bytes"],
                "seconds": limit["bytes"] / limit["gb_per_s"] / 1e9,
                "tool": limit["what"],
            }
    return out


# --- memory ---


def memcpy(size: int = 2**30, repeat: int = 5) -> dict:
    """Copy between two pre-faulted buffers; best of repeat. Runs in this process."""
    import numpy as np
    import torch

    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    best_t = min(_timed(lambda: td.copy_(ts)) for _ in range(repeat))
    fresh = _timed(lambda: np.ones(size, dtype=np.uint8))
    return {
        "numpy_1thread_gb_per_s": size / best / 1e9,
        "torch_gb_per_s": size / best_t / 1e9,
        "torch_threads": torch.get_num_threads(),
        "fresh_fill_gb_per_s": size / fresh / 1e9,
        "bytes": size,
    }


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    # python benches/limits.py memcpy  -> one JSON line (run.py calls this in a fresh process)
    if sys.argv[1:] == ["memcpy"]:
        print(json.dumps(memcpy()))
    else:
        for cache in ("cold", "warm"):
            for label, limit in storage(sys.argv[1:], cache).items():
                print(f"{cache:5} {label:18} {limit}")
