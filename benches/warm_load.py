"""Warm whole loads: fastload.load against safetensors.torch.load_file, each in a fresh process.

    python benches/warm_load.py                         # 2 GiB llama-like checkpoint, 9 pairs
    python benches/warm_load.py --pairs 15 --file model.safetensors --json

The checkpoint is read once (untimed) so its pages are in the page cache, then fresh Python
processes run one loader each, fastload and safetensors alternating (which of the two goes first
alternates too, so drift hits both). Inside each process, after ``import torch`` (not timed: both
need it):
- ``import``: importing the loader (``fastload`` / ``safetensors.torch``);
- ``load``: the load call alone (``fastload.load(path)`` / ``load_file(path)``);
- ``touch``: then one byte of every 4 KiB page of every tensor (``fastload._peers.touch``): a
  lazy mapping does its page-table work here, so ``load+touch`` compares loaders that map lazily
  with ones that map eagerly on equal terms;
- ``second``: fastload only, a second load of the same file in the same process, so
  ``import+load`` against ``second`` is the first-load penalty.
The table gives medians over the pairs and safetensors/fastload ratios (>= 1.0: fastload is
faster).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def child(loader: str, path: str) -> dict:
    import torch  # noqa: F401  (both loaders need it; not timed)

    t0 = time.perf_counter()
    if loader == "fastload":
        import fastload

        load = fastload.load
    elif loader == "load_file":
        import fastload

        load = fastload.load_file
    else:
        from safetensors.torch import load_file

        load = load_file
    t1 = time.perf_counter()
    tensors = load(path)
    t2 = time.perf_counter()
    # Imported only now: it imports the fastload package, whose import is timed above.
    from fastload._peers import touch

    t3 = time.perf_counter()
    touch(tensors.values())
    t4 = time.perf_counter()
    out = {"import": t1 - t0, "load": t2 - t1, "touch": t4 - t3, "tensors": len(tensors)}
    del tensors
    if loader != "safetensors":
        t5 = time.perf_counter()
        load(path)
        out["second"] = time.perf_counter() - t5
    return out


def run_child(loader: str, path: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", loader, path]
    # Bytecode is cached as an installed wheel's is (with PYTHONDONTWRITEBYTECODE=1 and an
    # editable install, every import of fastload would compile its sources: ~5 ms).
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    done = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env)
    return json.loads(done.stdout)


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(64 << 20):
            pass


def default_file() -> str:
    sys.path.insert(0, HERE)
    from make_checkpoint import Spec, generate

    out = os.path.join(HERE, "out", "ckpt")
    stamp = generate(Spec(size=2 << 30, dtype="bf16", shards=1, tiny=0, seed=0), out, quiet=True)
    return os.path.join(stamp["dir"], "model.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--file", help="a .safetensors file (default: the generated 2 GiB one)")
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--json", action="store_true", help="print every run and the medians as JSON")
    ap.add_argument(
        "--load-file",
        action="store_true",
        help="also time fastload.load_file (the drop-in for load_file) as a third loader",
    )
    ap.add_argument("--child", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    path = args.file or default_file()
    warm(path)
    loaders = ["fastload", "safetensors"] + (["load_file"] if args.load_file else [])
    for loader in loaders:  # untimed: bytecode written, libraries cached
        run_child(loader, path)
    runs: dict[str, list[dict]] = {loader: [] for loader in loaders}
    for i in range(args.pairs):
        # Every loader goes first as often as the others (a rotation), so drift hits all.
        k = i % len(loaders)
        for loader in loaders[k:] + loaders[:k]:
            runs[loader].append(run_child(loader, path))

    def med(loader: str, *keys: str) -> float:
        return statistics.median(sum(r[k] for k in keys) for r in runs[loader])

    rows = [
        ("load", ("load",)),
        ("load+touch", ("load", "touch")),
        ("import+load", ("import", "load")),
    ]
    summary = {}
    for label, keys in rows:
        f, s = med("fastload", *keys), med("safetensors", *keys)
        summary[label] = {"fastload_ms": f * 1e3, "safetensors_ms": s * 1e3, "ratio": s / f}
        if args.load_file:
            lf = med("load_file", *keys)
            summary[label].update(load_file_ms=lf * 1e3, load_file_ratio=s / lf)
    summary["fastload_second_load_ms"] = med("fastload", "second") * 1e3
    if args.json:
        print(json.dumps({"file": path, "pairs": args.pairs, "runs": runs, "median": summary}))
        return
    size = os.path.getsize(path)
    print(
        f"{path}: {size / 2**30:.2f} GiB, {runs['fastload'][0]['tensors']} tensors, warm page "
        f"cache, {args.pairs} interleaved pairs of fresh processes, medians"
    )
    print(f"{'':<14}{'fastload ms':>12}{'safetensors ms':>16}{'ratio':>8}")
    for label, _ in rows:
        r = summary[label]
        print(
            f"{label:<14}{r['fastload_ms']:>12.1f}{r['safetensors_ms']:>16.1f}{r['ratio']:>7.2f}x"
            + (
                f"   load_file {r['load_file_ms']:.1f} ms ({r['load_file_ratio']:.2f}x)"
                if args.load_file
                else ""
            )
        )
    print(f"fastload second load in the same process: {summary['fastload_second_load_ms']:.1f} ms")


if __name__ == "__main__":
    main()
