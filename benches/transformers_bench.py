"""transformers `from_pretrained` of a generated Llama (about 1 GB of bf16 weights by default):
`fastload.transformers.from_pretrained` against plain transformers, from a local folder and from
the mock Hub (tests/servers/hub.py, its own process) behind a bandwidth limit, where plain
transformers downloads into a fresh Hugging Face cache and then loads.

    python benches/transformers_bench.py --layers 8 --rates 0,2e8 --reps 3

Each run is a fresh process, fastload's and transformers' alternated; the clock runs from before
the call to a usable model (every parameter's pages read: fastload._peers.touch). Memory, of that
process alone: its peak RSS (VmHWM), its RSS before the call (the interpreter with torch and
transformers imported), and its anonymous RSS at the end (RssAnon: memory the model holds that
the kernel cannot drop, where a model on mmapped safetensors files holds page cache instead,
counted in RSS but reclaimable).
Prints a markdown table with the load average, and writes benches/out/transformers_bench.json.

Needs a release build of fastload (`maturin develop --release`): a debug build's HTTP path is
several times slower, and the bench refuses one unless --allow-debug-build.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import hub_runs

ROOT = hub_runs.ROOT
REPO = "org/llama-bench"

_RUN = r"""
import json, os, shutil, sys, tempfile, time
import torch
from transformers import AutoModelForCausalLM
from fastload._peers import touch
kind, target = sys.argv[1], sys.argv[2]


def status(field):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(field))


base_rss = status("VmRSS:")
start = time.perf_counter()
if kind == "fastload":
    import fastload.transformers
    model = fastload.transformers.from_pretrained(AutoModelForCausalLM, target)
else:
    model = AutoModelForCausalLM.from_pretrained(target)
touch(list(model.state_dict().values()))
seconds = time.perf_counter() - start
nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
# VmHWM: this process's own peak (ru_maxrss counts the parent's at fork).
print(json.dumps({"seconds": seconds, "bytes": nbytes, "peak_rss": status("VmHWM:"),
                  "base_rss": base_rss, "anon_rss": status("RssAnon:")}))
"""


def make_model(directory: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=16,
        tie_word_embeddings=False,
        dtype="bfloat16",
    )
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(directory, max_shard_size="500MB")


def is_debug_build(path: Path) -> bool:
    """Whether the ELF shared object at ``path`` has DWARF sections (a debug-profile build)."""
    import struct

    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:  # 64-bit ELF only
            return False
        (shoff,) = struct.unpack_from("<Q", head, 0x28)
        shentsize, _, shstrndx = struct.unpack_from("<HHH", head, 0x3A)
        f.seek(shoff + shstrndx * shentsize)
        sh = f.read(shentsize)
        offset, size = struct.unpack_from("<QQ", sh, 0x18)
        f.seek(offset)
        names = f.read(size)
    return b".debug_info\0" in names


def run(kind: str, target: str, env: dict) -> dict:
    return hub_runs.run(_RUN, kind, target, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", type=int, default=8, help="8: about 1.07 GB of bf16")
    parser.add_argument("--rates", default="0,2e8", help="storage bytes/s; 0: unlimited")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benches" / "out")
    parser.add_argument("--allow-debug-build", action="store_true")
    args = parser.parse_args()
    import fastload._fastload

    if is_debug_build(Path(fastload._fastload.__file__)) and not args.allow_debug_build:
        sys.exit(
            f"{fastload._fastload.__file__} is a debug build: build with `maturin develop "
            "--release` (or pass --allow-debug-build)"
        )
    load_before = os.getloadavg()
    args.out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=args.out, prefix="tf_"))
    ckpt = args.out / f"llama_{args.layers}_layers"
    if not (ckpt / "config.json").exists():
        make_model(ckpt, args.layers)
    base_env = hub_runs.clean_env()
    base_env.update(HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")
    rows = []

    def pair(labels: tuple[str, str], target: str, env: dict, fresh_cache: bool) -> None:
        """fastload's and transformers' runs, alternated (so that a change in the machine's load
        falls on both): the best time of each, the peak RSS of all its runs."""
        runs: dict[str, list[dict]] = {"fastload": [], "plain": []}
        for i in range(args.reps):
            for kind in runs:
                run_env = dict(env)
                home = tmp / f"home_{len(rows)}_{kind}_{i}"
                if fresh_cache:
                    run_env["HF_HOME"] = str(home)
                runs[kind].append(run(kind, target, run_env))
                shutil.rmtree(home, ignore_errors=True)  # a download's 1 GB
        for label, kind_runs in zip(labels, runs.values()):
            top = min(kind_runs, key=lambda r: r["seconds"])
            peak = max(r["peak_rss"] for r in kind_runs)
            secs = ", ".join(f"{r['seconds']:.2f}" for r in kind_runs)
            rows.append({"row": label, **top, "peak_rss": peak, "all_seconds": secs})
            print(f"{label}: {secs} s, peak RSS {peak / 2**30:.2f} GiB", flush=True)

    run("fastload", str(ckpt), base_env)  # page cache warm for the local rows
    pair(("fastload, local folder", "transformers, local folder"), str(ckpt), base_env, False)
    for rate in (float(r) for r in args.rates.split(",")):
        with hub_runs.mock_hub(ckpt, REPO, rate) as url:
            env = {**base_env, "HF_ENDPOINT": url}
            link = hub_runs.link_name(rate)
            labels = (
                f"fastload, mock Hub ({link})",
                f"transformers download + load, mock Hub ({link})",
            )
            pair(labels, REPO, env, True)
    size = rows[0]["bytes"]
    load_after = os.getloadavg()
    gib = 2**30
    print(f"\nLlama, {args.layers} layers, {size / 1e9:.2f} GB bf16, best of {args.reps}\n")
    print(
        "| row | seconds (best) | all runs | peak RSS (GiB) | RSS before the call | "
        "anonymous RSS at the end |\n|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['row']} | {r['seconds']:.2f} | {r['all_seconds']} | {r['peak_rss'] / gib:.2f} "
            f"| {r['base_rss'] / gib:.2f} | {r['anon_rss'] / gib:.2f} |"
        )
    loads = f"{load_before[0]:.1f} at the start, {load_after[0]:.1f} at the end"
    print(f"\nload average (1 min): {loads}; {os.cpu_count()} CPUs")
    shutil.rmtree(tmp, ignore_errors=True)
    (args.out / "transformers_bench.json").write_text(
        json.dumps({"load_average": [load_before, load_after], "rows": rows}, indent=2)
    )


if __name__ == "__main__":
    main()
