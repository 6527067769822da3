"""Planning time of sliced reads for Llama-3-8B's shapes at tensor parallelism: what a rank's
lazy tensors (the engines' weight loaders narrowing each weight) and a ``parts=`` load of its
shards spend working out byte ranges, with no byte read.

    python benches/region_plan_bench.py                # TP 2 and 8, rank 0, best of 5
    python benches/region_plan_bench.py --tp 2 --repeat 9 --json

For each TP size: "lazy" plans every sliced weight of the 32 layers (column-parallel ones by
rows, row-parallel ``o_proj``/``down_proj`` by columns, embeddings and ``lm_head`` by rows) as
``_safe_open.index_reads`` does for a lazy tensor's region, at the three costs of a request
(a mapped file, a local file, an object store); "parts" builds the plan of a ``parts=`` load
(``_parts.Parts``) of the same regions from local and remote headers. "first" is the first
pass in the process (nothing planned yet), "again" the best later pass (a load after the
first, or a model's later layers: what any plan cache keeps).

It runs against whichever fastload is first on ``PYTHONPATH``: the same command times two
trees (before and after a change to the planner).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 4096, 14336, 32, 32, 8, 128, 128256


def llama3_8b() -> list[tuple[str, tuple[int, ...], str]]:
    """Every weight as ``(name, shape, how it is split)``: "rows", "cols" or "whole"."""
    out: list[tuple[str, tuple[int, ...], str]] = [
        ("model.embed_tokens.weight", (VOCAB, HIDDEN), "rows")
    ]
    kv = KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (HEADS * HEAD_DIM, HIDDEN), "rows"),
            (p + "self_attn.k_proj.weight", (kv, HIDDEN), "rows"),
            (p + "self_attn.v_proj.weight", (kv, HIDDEN), "rows"),
            (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM), "cols"),
            (p + "mlp.gate_proj.weight", (INTER, HIDDEN), "rows"),
            (p + "mlp.up_proj.weight", (INTER, HIDDEN), "rows"),
            (p + "mlp.down_proj.weight", (HIDDEN, INTER), "cols"),
            (p + "input_layernorm.weight", (HIDDEN,), "whole"),
            (p + "post_attention_layernorm.weight", (HIDDEN,), "whole"),
        ]
    out += [("model.norm.weight", (HIDDEN,), "whole"), ("lm_head.weight", (VOCAB, HIDDEN), "rows")]
    return out


def regions(tp: int, rank: int) -> list[tuple[str, tuple[int, ...], Any]]:
    """Each sliced weight with the index rank ``rank`` of ``tp`` narrows it to (as a lazy
    tensor's region gives it: slices with explicit steps)."""
    out = []
    for name, shape, how in llama3_8b():
        if how == "whole":
            continue
        dim = 0 if how == "rows" else 1
        n = shape[dim] // tp
        cut = slice(rank * n, (rank + 1) * n, 1)
        full = slice(0, shape[0], 1)
        out.append((name, shape, cut if dim == 0 else (full, cut)))
    return out


def time_lazy(regs: list[Any], costs: list[int]) -> float:
    import torch
    from fastload import _safe_open

    start = time.perf_counter()
    for cost in costs:
        for _name, shape, index in regs:
            _safe_open.index_reads(torch, torch.bfloat16, shape, 2 * _numel(shape), index, cost)
    return time.perf_counter() - start


def headers(regs: list[Any], remote: bool) -> list[dict[str, Any]]:
    from fastload import _fastload

    kind = "REMOTE" if remote else "LOCAL"
    tensors, at = [], 0
    for name, shape, _ in regs:
        size = 2 * _numel(shape)
        tensors.append((name, "BF16", list(shape), at, at + size))
        at += size
    file = "s3://bucket/llama/model.safetensors" if remote else "/llama/model.safetensors"
    cost = _fastload_cost(_fastload, kind)
    # `read_cost`: what the Reader's headers say of the file's source (older trees ignore it).
    return [{"file": file, "tensors": tensors, "data_start": 8, "read_cost": cost}]


def time_parts(regs: list[Any], heads: list[list[dict[str, Any]]]) -> float:
    from fastload import _parts

    parts = {name: index for name, _, index in regs}
    start = time.perf_counter()
    for h in heads:
        _parts.Parts(h, parts, None, h[0]["file"])
    return time.perf_counter() - start


def _numel(shape: tuple[int, ...]) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--tp", type=int, action="append", help="TP sizes (default 2 and 8)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import fastload
    from fastload import _fastload

    costs = [_fastload_cost(_fastload, k) for k in ("MAPPED", "LOCAL", "REMOTE")]
    results = []
    for tp in args.tp or [2, 8]:
        regs = regions(tp, 0)
        heads = [headers(regs, False), headers(regs, True)]
        row: dict[str, Any] = {"tp": tp, "regions": len(regs)}
        timed = {
            "lazy": lambda regs=regs: time_lazy(regs, costs),
            "parts": lambda regs=regs, heads=heads: time_parts(regs, heads),
        }
        for what, run in timed.items():
            first = run()
            again = min(run() for _ in range(args.repeat))
            row[f"{what}_first_ms"] = round(first * 1e3, 2)
            row[f"{what}_again_ms"] = round(again * 1e3, 2)
        results.append(row)
    if args.json:
        print(json.dumps({"fastload": fastload.__file__, "results": results}))
        return
    print(f"fastload: {fastload.__file__}")
    for r in results:
        print(
            f"TP {r['tp']} ({r['regions']} sliced weights, rank 0): "
            f"lazy first {r['lazy_first_ms']} ms, again {r['lazy_again_ms']} ms; "
            f"parts first {r['parts_first_ms']} ms, again {r['parts_again_ms']} ms"
        )


def _fastload_cost(native: Any, kind: str) -> int:
    """A cost of a request, from the native module (newer trees) or ``_safe_open`` (older)."""
    from fastload import _safe_open

    return int(
        getattr(native, f"{kind}_READ_COST", None) or getattr(_safe_open, f"{kind}_READ_COST")
    )


if __name__ == "__main__":
    main()
