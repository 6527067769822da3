"""One tensor-parallel rank's weights into GPU parameters: sliced reads against whole tensors
(needs a CUDA device; ``--device cpu`` runs the harness without one).

    python benches/tp_gpu_bench.py                          # 2 GiB llama, TP 1, 2 and 8, warm
    python benches/tp_gpu_bench.py --tp 8 --cache cold,warm --reps 3

What a vLLM worker of rank ``r`` of ``T`` does when it loads weights, without vLLM: every
parameter is allocated on the device first (its shard's shape), then each checkpoint tensor is
narrowed the way vLLM's linear layers narrow it (column-parallel ``q/k/v/gate/up``, embeddings and
``lm_head``: a block of rows; row-parallel ``o_proj``/``down_proj``: a block of columns; norms
whole) and copied in with ``param.copy_``. Rows, each one load in a fresh process with the CUDA
context made before the clock, timed until ``torch.cuda.synchronize``:

- ``whole``: ``fastload.stream(device=...)``, then narrowed on the device (``--load-format
  fastload`` without ``slices``);
- ``sliced``: fastload's lazy tensors (``slices: true``): only the rank's part is read, local
  files mapped, the parameter's ``copy_`` the only copy;
- ``sliced-read``: the same with ``method="read"`` (each part read into a host buffer);
- ``sliced-pageable``: ``sliced`` with torch's own copy from the mapped pages into the device
  (what lazy tensors did before their copies went through page-locked chunks);
- ``safetensors``: ``safe_open(framework="pt")`` and ``get_slice`` narrowed on the host, copied
  in (vLLM's own ``safetensors`` loader).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import limits  # noqa: E402
from gpu_bench import bench_args, measure, run_one  # noqa: E402
from make_checkpoint import checkpoint_files, generate, make_spec, parse_size  # noqa: E402

ROW_PARALLEL = ("o_proj", "down_proj")


def _part(name: str, shape: tuple[int, ...], rank: int, tp: int) -> tuple[int, int, int] | None:
    """(dim, start, length) of rank's part of a tensor, or None for a whole one."""
    if len(shape) != 2 or tp == 1:
        return None
    dim = 1 if any(k in name for k in ROW_PARALLEL) else 0
    size = shape[dim] // tp
    return dim, rank * size, size


def _layout(files: list[str]) -> list[tuple[str, tuple[int, ...], str]]:
    from safetensors import safe_open

    out = []
    for f in files:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                out.append((name, tuple(sl.get_shape()), sl.get_dtype()))
    return out


def _params(job: dict) -> dict:
    import torch

    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    params = {}
    for name, shape, dtype in _layout(job["files"]):
        part = _part(name, shape, job["rank"], job["tp"])
        if part is not None:
            shape = tuple(part[2] if d == part[0] else n for d, n in enumerate(shape))
        params[name] = torch.empty(shape, dtype=dtypes[dtype], device=job["device"])
    return params


def _into(params: dict, name: str, tensor, job: dict) -> None:
    part = _part(name, tuple(tensor.shape), job["rank"], job["tp"])
    if part is not None:
        tensor = tensor.narrow(*part)
    params[name].copy_(tensor)


def run_whole(job: dict, params: dict) -> None:
    import fastload

    for name, tensor in fastload.stream(job["files"], device=job["device"]):
        _into(params, name, tensor, job)


def _lazy(job: dict, params: dict, **options) -> None:
    from fastload import _lazy

    for f in job["files"]:
        for name, tensor in _lazy.Checkpoint(f, all_layers=True, **options):
            _into(params, name, tensor, job)


def run_sliced(job: dict, params: dict) -> None:
    _lazy(job, params)


def run_sliced_read(job: dict, params: dict) -> None:
    _lazy(job, params, method="read")


def run_sliced_pageable(job: dict, params: dict) -> None:
    from fastload import _lazy as lazy

    lazy.STAGED_DEVICES = ()  # torch's copy from the mapped pages, as before page-locked chunks
    _lazy(job, params)


def run_safetensors(job: dict, params: dict) -> None:
    from safetensors import safe_open

    for f in job["files"]:
        with safe_open(f, framework="pt") as h:
            for name in h.keys():
                sl = h.get_slice(name)
                part = _part(name, tuple(sl.get_shape()), job["rank"], job["tp"])
                if part is None:
                    tensor = h.get_tensor(name)
                else:
                    dim, start, size = part
                    index = [slice(None)] * len(sl.get_shape())
                    index[dim] = slice(start, start + size)
                    tensor = sl[tuple(index)]
                params[name].copy_(tensor)


ROWS = {
    "whole": run_whole,
    "sliced": run_sliced,
    "sliced-read": run_sliced_read,
    "sliced-pageable": run_sliced_pageable,
    "safetensors": run_safetensors,
}


def one(job: dict) -> dict:
    """Runs in a fresh process: one row, one measurement."""
    import torch

    device = job["device"]
    # torch imports torch.distributed.tensor at the first dispatch of a tensor subclass (the lazy
    # tensors), 0.5 s on a small VM; vLLM, SGLang and transformers have imported it before.
    import torch.distributed.tensor

    params = _params(job)  # vLLM allocates the model before it loads weights
    if device != "cpu":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    ROWS[job["row"]](job, params)
    if device != "cpu":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    # A check that the row loaded what it should: the sum of every parameter.
    check = float(sum(p.double().sum().item() for p in params.values()))
    kept = sum(p.nbytes for p in params.values())
    return {"seconds": seconds, "kept": kept, "check": check}


def main(argv: list[str] | None = None) -> None:
    ap = bench_args(__doc__, ROWS, reps=2, cache="warm", timeout=300)
    ap.add_argument("--tp", default="1,2,8", help="tensor-parallel sizes (rank 0 of each)")
    args = ap.parse_args(argv)
    run_one(args, one)

    spec = make_spec(size=parse_size(args.size), shards=1, dtype="bf16")
    files = checkpoint_files(generate(spec, args.ckpt_dir, quiet=True))
    total = sum(os.path.getsize(f) for f in files)
    rows = [r for r in args.rows.split(",") if r]
    results: dict[tuple[str, int, str], list[float]] = {}
    checks: dict[tuple[int, str], set[float]] = {}
    errors: dict[str, str] = {}
    for cache in args.cache.split(","):
        for tp in (int(t) for t in args.tp.split(",")):
            for rep in range(args.reps):
                for i in range(len(rows)):
                    row = rows[(i + rep) % len(rows)]  # rotated: drift hits every row alike
                    if cache == "cold":
                        limits.evict(*files)
                    else:
                        limits.warm(*files)
                    job = {"row": row, "files": files, "device": args.device, "tp": tp, "rank": 0}
                    res = measure(sys.executable, job, args.timeout, __file__)
                    if "seconds" not in res:
                        errors[f"{row} tp{tp}"] = res.get("error", "?").strip()[-400:]
                        print(f"{cache:5} tp{tp} {row:12} error", file=sys.stderr)
                        continue
                    results.setdefault((row, tp, cache), []).append(res["seconds"])
                    checks.setdefault((tp, cache), set()).add(res["check"])
                    print(
                        f"{cache:5} tp{tp} {row:15} {res['seconds']:8.3f} s "
                        f"(kept {res['kept'] / 2**20:.0f} MiB)",
                        file=sys.stderr,
                    )
    import torch

    name = "cpu" if args.device == "cpu" else torch.cuda.get_device_name(torch.device(args.device))
    print(f"\n{total / 1e9:.2f} GB checkpoint → rank 0's parameters on {name}, best of {args.reps}")
    table = []
    disagree = []
    for (tp, cache), seen in sorted(checks.items()):
        best = {r: min(v) for (r, t, c), v in results.items() if t == tp and c == cache}
        agree = "rows agree" if len(seen) == 1 else f"ROWS DISAGREE: {sorted(seen)}"
        if len(seen) != 1:
            disagree.append(f"TP {tp} {cache}")
        print(f"\nTP {tp}, {cache} ({agree}):  row           seconds   vs whole")
        for row in rows:
            if row not in best:
                print(f"    {row:15} -")
                continue
            ratio = f"{best['whole'] / best[row]:8.2f}x" if "whole" in best else ""
            print(f"    {row:15} {best[row]:8.3f}   {ratio}")
            table.append({"tp": tp, "cache": cache, "row": row, "seconds": best[row]})
    for key, err in errors.items():
        print(f"\n{key}: {err}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "device": name,
                    "bytes": total,
                    "rows": table,
                    "errors": errors,
                    "disagree": disagree,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
