"""Sliced reads in vLLM (``load_format="fastload"`` where the model is split over workers): each
worker reads only the bytes it keeps (fastload._lazy).

vLLM's own layers first, in-process with a fake tensor-parallel group (``layers``: vLLM's
``get_tensor_model_parallel_rank``/``world_size`` patched where the layers look them up): every
weight loader of the usual layers (column/row parallel, QKV and merged column from separate and
fused tensors, KV heads replicated, vocab-parallel embedding and LM head with padding, an
unknown weight loader that transforms its tensor) fed lazy tensors gives the parameters it gives
with whole tensors, bitwise, reading exactly the regions below (the pin: a vLLM that stops
narrowing before it copies reads more, and fails here). Then real engines at tensor parallel 2
and pipeline parallel 2 (vLLM's CPU build, ``mp`` workers): the tokens of vLLM's own loader,
from a local folder and over HTTP, with the bytes the server sent counted.

Like tests/test_vllm.py, this file is also the script the vLLM venv runs
(``.venv-vllm/bin/python tests/test_vllm_slices.py layers|engines WORK RESULT.json``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_vllm as tv

# The layers' sizes: hidden 64, 4 query heads of 16 and 1 KV head (replicated at TP 2),
# intermediate 128, a vocabulary of 100 (padded to 64 per rank: 128 rows at TP 2).
H, HEAD, HEADS, KV_HEADS, INTER, VOCAB = 64, 16, 4, 1, 128, 100


# ---------------------------------------------------------------- driver (runs in .venv-vllm)


def _checkpoint_tensors():
    import torch

    g = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g).to(torch.bfloat16)

    return {
        "q": randn(HEADS * HEAD, H),
        "k": randn(KV_HEADS * HEAD, H),
        "v": randn(KV_HEADS * HEAD, H),
        "qkv": randn((HEADS + 2 * KV_HEADS) * HEAD, H),
        "gate": randn(INTER, H),
        "up": randn(INTER, H),
        "down": randn(H, INTER),
        "col.weight": randn(INTER, H),
        "col.bias": randn(INTER),
        "emb": randn(VOCAB, H),
        "head": randn(VOCAB, H),
        "unknown": randn(16, 32),
    }


# (layer, parameter, checkpoint tensor, shard id) in load order.
LOADS = [
    ("qkv", "weight", "q", "q"),
    ("qkv", "weight", "k", "k"),
    ("qkv", "weight", "v", "v"),
    ("qkv_fused", "weight", "qkv", None),
    ("gate_up", "weight", "gate", 0),
    ("gate_up", "weight", "up", 1),
    ("down", "weight", "down", None),
    ("col", "weight", "col.weight", None),
    ("col", "bias", "col.bias", None),
    ("emb", "weight", "emb", None),
    ("head", "weight", "head", None),
    ("unknown", "weight", "unknown", None),
]


def _layers(tp: int, rank: int):
    import torch
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers import linear
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    from vllm.distributed import parallel_state

    # vLLM's functions read the group's rank and size; nothing here communicates.
    parallel_state._TP = SimpleNamespace(rank_in_group=rank, world_size=tp)
    for module in (linear, vpe):
        module.get_tensor_model_parallel_rank = lambda: rank
        module.get_tensor_model_parallel_world_size = lambda: tp
    with set_current_vllm_config(VllmConfig()), torch.device("cpu"):
        torch.set_default_dtype(torch.bfloat16)
        layers = {
            "qkv": linear.QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=False),
            "qkv_fused": linear.QKVParallelLinear(H, HEAD, HEADS, KV_HEADS, bias=False),
            "gate_up": linear.MergedColumnParallelLinear(H, [INTER, INTER], bias=False),
            "down": linear.RowParallelLinear(INTER, H, bias=False),
            "col": linear.ColumnParallelLinear(H, INTER, bias=True),
            "emb": vpe.VocabParallelEmbedding(VOCAB, H),
            "head": vpe.ParallelLMHead(VOCAB, H),
        }
        torch.set_default_dtype(torch.float32)
    # A layer vLLM does not know: its loader transposes and scales (not a narrow then a copy).
    unknown = torch.nn.Module()
    unknown.weight = torch.nn.Parameter(torch.empty(32, 16), requires_grad=False)

    def transposing_loader(param, loaded):
        param.data.copy_(loaded.t().to(torch.float32) * 2)

    unknown.weight.weight_loader = transposing_loader
    layers["unknown"] = unknown
    for layer in layers.values():
        for p in layer.parameters():
            p.data.fill_(0)
    return layers


def _load(layers, tensors, per_tensor_bytes=None, reader=None):
    for layer, param_name, tensor, shard in LOADS:
        param = getattr(layers[layer], param_name)
        before = reader.bytes_read if reader is not None else 0
        args = () if shard is None else (shard,)
        param.weight_loader(param, tensors[tensor], *args)
        if per_tensor_bytes is not None:
            per_tensor_bytes[tensor] = per_tensor_bytes.get(tensor, 0) + reader.bytes_read - before


def run_layers(work: Path, result_path: Path) -> None:
    """For TP 1 and 2, each rank: the layers loaded from whole tensors and from lazy ones."""
    import torch
    from fastload._lazy import Checkpoint
    from safetensors.torch import save_file

    tensors = _checkpoint_tensors()
    path = work / "layers.safetensors"
    save_file(tensors, str(path))
    results: dict = {}
    for tp in (1, 2):
        for rank in range(tp):
            eager = _layers(tp, rank)
            _load(eager, tensors)
            lazy = _layers(tp, rank)
            checkpoint = Checkpoint(path)
            read: dict[str, int] = {}
            _load(lazy, dict(checkpoint), read, checkpoint.reader)
            differ = [
                f"{name}.{p}"
                for name in eager
                for p, want in eager[name].named_parameters()
                if not torch.equal(
                    want.data.view(torch.uint8) if want.dtype == torch.bfloat16 else want.data,
                    getattr(lazy[name], p).data.view(torch.uint8)
                    if want.dtype == torch.bfloat16
                    else getattr(lazy[name], p).data,
                )
            ]
            results[f"{tp}/{rank}"] = {
                "differ": differ,
                "read": read,
                "stats": checkpoint.stats.as_dict(),
                "loaded_nonzero": all(
                    bool(p.data.abs().sum() > 0)
                    for layer in lazy.values()
                    for p in layer.parameters()
                ),
            }
    result_path.write_text(json.dumps(results))


if __name__ == "__main__":
    commands = {"layers": run_layers}
    commands[sys.argv[1]](*map(Path, sys.argv[2:4]))


# ---------------------------------------------------------------- tests (run by pytest)


def _run(command: str, work: Path, timeout: int = 600, **env: str) -> tuple[dict, str]:
    result, log = work / f"{command}.json", work / f"{command}.log"
    env = {**tv._engine_env(), **env}
    env["PYTHONPATH"] = os.pathsep.join([str(tv.ROOT / "python"), env.get("PYTHONPATH", "")])
    with open(log, "w") as out:
        proc = subprocess.run(
            [str(tv.VENV_PYTHON), __file__, command, str(work), str(result)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=tv.ROOT,
            timeout=timeout,
        )
    output = log.read_text(errors="replace")
    assert proc.returncode == 0 and result.exists(), output[-8000:]
    return json.loads(result.read_text()), output


def _rows(n: int, start: int, count: int) -> tuple:
    return (slice(start, start + count),)


def _expected_regions(tp: int, rank: int) -> dict[str, list[tuple]]:
    """The regions vLLM's weight loaders narrow each tensor to on ``rank`` of ``tp`` (what the
    rank keeps), as indices of the checkpoint tensor; several for a fused tensor."""
    q_rows = HEADS * HEAD // tp
    kv_rank = rank // max(1, tp // KV_HEADS)  # KV heads replicated when tp > KV_HEADS
    kv_rows = max(1, KV_HEADS // tp) * HEAD
    pad_vocab = -(-VOCAB // (64 * tp)) * 64 * tp // tp  # rows per rank, padding included
    vocab_rows = max(0, min(pad_vocab, VOCAB - rank * pad_vocab))
    q = _rows(0, rank * q_rows, q_rows)
    kv = _rows(0, kv_rank * kv_rows, kv_rows)
    k_in_fused = (slice(HEADS * HEAD + kv[0].start, HEADS * HEAD + kv[0].stop),)
    v_in_fused = (
        slice((HEADS + KV_HEADS) * HEAD + kv[0].start, (HEADS + KV_HEADS) * HEAD + kv[0].stop),
    )
    inter = INTER // tp
    return {
        "q": [q],
        "k": [kv],
        "v": [kv],
        "qkv": [q, k_in_fused, v_in_fused],
        "gate": [_rows(0, rank * inter, inter)],
        "up": [_rows(0, rank * inter, inter)],
        "down": [(slice(None), slice(rank * inter, (rank + 1) * inter))],
        "col.weight": [_rows(0, rank * inter, inter)],
        "col.bias": [_rows(0, rank * inter, inter)],
        "emb": [_rows(0, rank * pad_vocab, vocab_rows)],
        "head": [_rows(0, rank * pad_vocab, vocab_rows)],
        "unknown": [(slice(None),)],  # read whole: its loader transposes first
    }


@pytest.fixture(scope="module")
def layers(tmp_path_factory):
    return _run("layers", tmp_path_factory.mktemp("vllm_layers"))


@tv.needs_vllm
def test_vllm_weight_loaders_read_only_each_ranks_part(layers):
    import torch
    from fastload._safe_open import LOCAL_READ_COST, plan

    results, _ = layers
    shapes = {k: tuple(v.shape) for k, v in _tensor_shapes().items()}
    for tp in (1, 2):
        for rank in range(tp):
            got = results[f"{tp}/{rank}"]
            assert got["differ"] == [], (tp, rank, got["differ"])
            assert got["loaded_nonzero"], (tp, rank)
            for name, regions in _expected_regions(tp, rank).items():
                want = sum(
                    sum(n for _, n in plan(shapes[name], 2, index, LOCAL_READ_COST).ranges)
                    for index in regions
                )
                assert got["read"][name] == want, (tp, rank, name, got["read"][name], want)
            total = sum(got["read"].values())
            assert got["stats"]["read_bytes"] == total
            assert got["stats"]["fallbacks"] == {"t": 1}, got["stats"]
    # At TP 2 the ranks read the column-parallel tensors once between them, plus the replicated
    # KV heads twice: about half of the checkpoint each.
    whole = sum(torch.Size(s).numel() * 2 for s in shapes.values())
    for rank in (0, 1):
        assert results[f"2/{rank}"]["stats"]["read_bytes"] < 0.7 * whole, results[f"2/{rank}"]


def _tensor_shapes():
    import torch

    return {
        "q": torch.empty(HEADS * HEAD, H),
        "k": torch.empty(KV_HEADS * HEAD, H),
        "v": torch.empty(KV_HEADS * HEAD, H),
        "qkv": torch.empty((HEADS + 2 * KV_HEADS) * HEAD, H),
        "gate": torch.empty(INTER, H),
        "up": torch.empty(INTER, H),
        "down": torch.empty(H, INTER),
        "col.weight": torch.empty(INTER, H),
        "col.bias": torch.empty(INTER),
        "emb": torch.empty(VOCAB, H),
        "head": torch.empty(VOCAB, H),
        "unknown": torch.empty(16, 32),
    }
