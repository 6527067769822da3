"""hf:// through the mock Hub (tests/servers/hub.py, in its own process) against
`huggingface_hub.snapshot_download` + `safetensors.torch.load_file`, and against fastload from
local disk, unlimited and at rate-limited storage links.

    python benches/hub_bench.py --size 512MiB --rates 0,1e9,2e8 --reps 2

Each row is the best of `--reps` runs, in a fresh subprocess each (no buffers kept between runs),
every page of every tensor read inside the clock (fastload._peers.touch);
the snapshot_download rows download into a fresh cache directory every run (they then read the
files back, warm in the page cache, as a server would right after downloading). Prints a markdown
table and writes benches/out/hub_bench.json.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import hub_runs
from make_checkpoint import parse_size

ROOT = hub_runs.ROOT
REPO = "org/bench"

_RUN = r"""
import json, os, sys, time, tempfile, shutil
sys.path.insert(0, os.environ["BENCH_DIR"])
from fastload._peers import touch  # every page read inside the clock (mmap-backed tensors are lazy)
kind, target = sys.argv[1], sys.argv[2]
start = time.perf_counter()
if kind == "fastload":
    import fastload
    tensors = fastload.load(target)
elif kind == "snapshot":
    import huggingface_hub
    from safetensors.torch import load_file
    cache = tempfile.mkdtemp(dir=os.environ["BENCH_TMP"])
    patterns = ["*.safetensors", "*.json"]
    folder = huggingface_hub.snapshot_download(target, cache_dir=cache, allow_patterns=patterns)
    tensors = {}
    for name in sorted(os.listdir(folder)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(folder, name)))
touch(tensors.values())
seconds = time.perf_counter() - start
nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
if kind == "snapshot":
    shutil.rmtree(cache)
print(json.dumps({"seconds": seconds, "bytes": nbytes}))
"""


def make_checkpoint(directory: Path, size: int, shards: int = 2) -> None:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    per_shard = size // shards
    weight_map = {}
    gen = torch.Generator().manual_seed(0)
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        rows = per_shard // (4096 * 2) // 8
        tensors = {
            f"layers.{s}.{k}.weight": torch.randn(rows, 4096, generator=gen).to(torch.bfloat16)
            for k in range(8)
        }
        save_file(tensors, str(directory / name))
        weight_map.update({t: name for t in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text("{}")


def run(kind: str, target: str, env: dict) -> dict:
    return hub_runs.run(_RUN, kind, target, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", default="512MiB")
    parser.add_argument("--rates", default="0,1e9,2e8", help="storage bytes/s; 0: unlimited")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "out")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=args.out, prefix="hub_"))
    ckpt = args.out / f"hub_ckpt_{args.size}"
    if not (ckpt / "model.safetensors.index.json").exists():
        make_checkpoint(ckpt, parse_size(args.size))
    base_env = hub_runs.clean_env()
    base_env.update(
        BENCH_TMP=str(tmp),
        BENCH_DIR=str(ROOT / "benches"),
        HF_HUB_DISABLE_PROGRESS_BARS="1",
        HF_HOME=str(tmp / "home"),
    )
    rows = []

    def best(label: str, kind: str, target: str, env: dict) -> None:
        runs = [run(kind, target, env) for _ in range(args.reps)]
        top = min(runs, key=lambda r: r["seconds"])
        rows.append({"row": label, **top, "gb_per_s": top["bytes"] / top["seconds"] / 1e9})
        print(f"{label}: {top['seconds']:.2f} s, {rows[-1]['gb_per_s']:.2f} GB/s", flush=True)

    run("fastload", str(ckpt), base_env)  # page cache warm for the local rows
    best("fastload, local disk (warm page cache)", "fastload", str(ckpt), base_env)
    for rate in (float(r) for r in args.rates.split(",")):
        with hub_runs.mock_hub(ckpt, REPO, rate) as url:
            env = {**base_env, "HF_ENDPOINT": url}
            link = hub_runs.link_name(rate)
            best(f"fastload hf:// ({link})", "fastload", f"hf://{REPO}", env)
            best(f"snapshot_download + load_file ({link})", "snapshot", REPO, env)
    size = rows[0]["bytes"]
    print(f"\n{size / 2**20:.0f} MiB, 2 shards + index, best of {args.reps}\n")
    print("| row | seconds | GB/s |\n|---|---|---|")
    for r in rows:
        print(f"| {r['row']} | {r['seconds']:.2f} | {r['gb_per_s']:.2f} |")
    (args.out / "hub_bench.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
