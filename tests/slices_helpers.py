"""What the sliced-read tests of vLLM's and SGLang's layers share (tests/test_vllm_slices.py,
tests/test_sglang_slices.py): the layers' sizes, the checkpoint, its loads in order, the
regions each rank keeps, and the layer neither framework knows.

Imported by the test processes and by the drivers those tests start (vLLM's venv, SGLang's
subprocess): nothing here imports vLLM or SGLang.
"""

from __future__ import annotations

# The layers' sizes: hidden 64, 4 query heads of 16 and 1 KV head (replicated at TP 2),
# intermediate 128, a vocabulary of 100 (padded to 64 per rank: 128 rows at TP 2).
H, HEAD, HEADS, KV_HEADS, INTER, VOCAB = 64, 16, 4, 1, 128, 100


def checkpoint_tensors():
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


def add_unknown_and_zero(layers: dict) -> None:
    """Adds ``unknown``, a layer the framework does not know (its loader transposes and scales:
    not a narrow then a copy), to ``layers``, and zeroes every parameter."""
    import torch

    unknown = torch.nn.Module()
    unknown.weight = torch.nn.Parameter(torch.empty(32, 16), requires_grad=False)

    def transposing_loader(param, loaded):
        param.data.copy_(loaded.t().to(torch.float32) * 2)

    unknown.weight.weight_loader = transposing_loader
    layers["unknown"] = unknown
    for layer in layers.values():
        for p in layer.parameters():
            p.data.fill_(0)


def load(layers, tensors, per_tensor_bytes=None, reader=None, loads=LOADS) -> None:
    """Feeds ``tensors`` to the layers' weight loaders in ``loads``' order; with a reader,
    counts what each tensor's loads read in ``per_tensor_bytes``."""
    for layer, param_name, tensor, shard in loads:
        param = getattr(layers[layer], param_name)
        before = reader.bytes_read if reader is not None else 0
        args = () if shard is None else (shard,)
        param.weight_loader(param, tensors[tensor], *args)
        if per_tensor_bytes is not None:
            per_tensor_bytes[tensor] = per_tensor_bytes.get(tensor, 0) + reader.bytes_read - before


def differ(eager: dict, lazy: dict, same) -> list[str]:
    """The parameters (``layer.parameter``) of ``lazy`` that ``same`` finds unlike ``eager``'s."""
    return [
        f"{name}.{p}"
        for name in eager
        for p, want in eager[name].named_parameters()
        if not same(want.data, getattr(lazy[name], p).data)
    ]


def _rows(n: int, start: int, count: int) -> tuple:
    return (slice(start, start + count),)


def expected_regions(tp: int, rank: int) -> dict[str, list[tuple]]:
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


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    """The checkpoint's tensors' shapes."""
    return {name: tuple(t.shape) for name, t in checkpoint_tensors().items()}


def regions_read(shape: tuple, itemsize: int, regions: list[tuple]) -> int:
    """The bytes a lazy tensor of ``shape`` reads from a local file for ``regions``: the file is
    mapped, each region the span of its rows."""
    from fastload._safe_open import MAPPED_READ_COST, plan

    cost = MAPPED_READ_COST
    return sum(sum(n for _, n in plan(shape, itemsize, index, cost).ranges) for index in regions)
