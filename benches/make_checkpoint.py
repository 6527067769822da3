"""Deterministic llama-like safetensors checkpoints for the benchmarks.

Written with the reference writer (``safetensors.torch.save_file``) so every loader reads files laid
out exactly as real checkpoints are. Content is seeded and generated fast: one small random chunk
of normal values, tiled and perturbed per tensor, so 2 GiB takes seconds rather than minutes.

    python benches/make_checkpoint.py --size 2GiB                  # one file
    python benches/make_checkpoint.py --size 2GiB --shards 4       # 4 shards + index.json
    python benches/make_checkpoint.py --tiny 30000                 # 30k tiny tensors

A directory is skipped when its ``fastload-bench.json`` stamp records the same parameters.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

GENERATOR_VERSION = 2
STAMP = "fastload-bench.json"
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int) -> int:
    """'2GiB' -> 2147483648; '500MB' -> 500000000; plain ints pass through."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}; use e.g. 256MiB, 2GiB, 500MB or bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


@dataclass(frozen=True)
class Spec:
    size: int = 2 * 2**30  # target bytes of tensor data (the result lands close to it)
    dtype: str = "bf16"
    shards: int = 1  # 1: model.safetensors; N>1: model-0000i-of-0000N + index
    tiny: int = 0  # >0: that many tiny tensors instead of a llama layout
    seed: int = 0
    family: str = "llama"  # "llama3": Llama-3-8B's shapes (see llama3_layout)

    @property
    def name(self) -> str:
        if self.tiny:
            return f"tiny{self.tiny}-{self.dtype}-s{self.seed}"
        size = format_size(self.size)
        return f"{self.family}-{size}-{self.dtype}-{self.shards}shard-s{self.seed}"


def make_spec(
    size: str | int,
    dtype: str = "bf16",
    shards: int = 1,
    tiny: int = 0,
    seed: int = 0,
    family: str = "llama",
) -> Spec:
    """A Spec with the fields that do not apply zeroed, so stamps compare equal."""
    if tiny:
        return Spec(size=0, dtype=dtype, shards=1, tiny=tiny, seed=seed)
    return Spec(
        size=parse_size(size), dtype=dtype, shards=max(1, shards), tiny=0, seed=seed, family=family
    )


def llama3_layout(total_bytes: int, itemsize: int) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-3-8B's names and shapes: 32 layers of hidden size 4096, grouped-query attention
    (``k_proj``/``v_proj`` a quarter of ``q_proj``), a 14336-wide MLP, a 128256-token vocabulary
    and an untied ``lm_head``: 8.03 G parameters, 16.06 GB in bf16. A smaller ``total_bytes``
    divides every dimension by the smallest power of two (at most 64) that fits it, keeping the
    ratios and the 32 layers (a test run of the same structure)."""
    scale = 1
    while scale < 64 and 8_030_261_248 * itemsize // (scale * scale) > total_bytes:
        scale *= 2
    hidden, kv, inter, vocab = 4096 // scale, 1024 // scale, 14336 // scale, 128256 // scale
    return _decoder(32, hidden, kv, inter, vocab)


def llama_layout(total_bytes: int, itemsize: int) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a llama-2 style model whose tensors add up to about total_bytes.

    Picks the widest hidden size that still gives at least 16 layers, as real model families do.
    """
    params = total_bytes // itemsize
    vocab = 32000
    for hidden in (8192, 5120, 4096, 3072, 2048, 1536, 1024, 768, 512, 256, 128):
        inter = (int(hidden * 8 / 3) + 255) // 256 * 256
        per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
        fixed = 2 * vocab * hidden + hidden
        layers = (params - fixed) // per_layer
        if layers >= 16 or hidden == 128:
            break
    return _decoder(max(1, layers), hidden, hidden, inter, vocab)


def _decoder(
    layers: int, hidden: int, kv: int, inter: int, vocab: int
) -> list[tuple[str, tuple[int, ...]]]:
    """Names and shapes of a llama decoder: embeddings, `layers` layers, norm and lm_head."""
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (hidden, hidden)),
            (p + "self_attn.k_proj.weight", (kv, hidden)),
            (p + "self_attn.v_proj.weight", (kv, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, hidden)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            (p + "mlp.gate_proj.weight", (inter, hidden)),
            (p + "mlp.up_proj.weight", (inter, hidden)),
            (p + "mlp.down_proj.weight", (hidden, inter)),
        ]
    out += [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]
    return out


def tiny_layout(count: int, seed: int) -> list[tuple[str, tuple[int, ...]]]:
    """count small tensors (1 to 4096 elements, a few scalars), grouped like many-module models."""
    import random

    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind = rng.random()
        if kind < 0.02:
            shape: tuple[int, ...] = ()
        elif kind < 0.6:
            shape = (rng.choice((1, 8, 16, 64, 128, 256, 512)),)
        else:
            shape = (rng.choice((2, 4, 8, 16, 32)), rng.choice((8, 16, 32, 64, 128)))
        out.append((f"model.blocks.{i // 64}.experts.{i % 64}.w{i % 3}", shape))
    return out


class _Filler:
    """Deterministic contents: a seeded 4 Mi-element chunk, sliced and perturbed per tensor."""

    CHUNK = 4 * 2**20

    def __init__(self, dtype, seed: int):
        import torch

        g = torch.Generator().manual_seed(seed)
        self.torch = torch
        self.dtype = dtype
        self.base = (torch.randn(self.CHUNK, generator=g) * 0.02).to(dtype)
        self.int_view = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
            self.base.element_size()
        ]
        self.base_bits = self.base.view(self.int_view)

    def make(self, index: int, shape: tuple[int, ...]):
        n = 1
        for d in shape:
            n *= d
        if n <= self.CHUNK:
            start = (index * 7919) % (self.CHUNK - n + 1)
            flat = self.base_bits[start : start + n].clone()
        else:
            bits = self.base_bits.roll(-((index * 7919) % self.CHUNK))
            flat = bits.repeat(-(-n // self.CHUNK))[:n]
        # Flip low mantissa bits by the tensor's index, so no two tensors are byte-identical.
        flat ^= index % 251
        return flat.view(self.dtype).reshape(shape)


def _files_ok(directory: Path, spec: Spec) -> bool:
    stamp = directory / STAMP
    if not stamp.exists():
        return False
    try:
        recorded = json.loads(stamp.read_text())
    except ValueError:
        return False
    if recorded.get("spec") != asdict(spec) or recorded.get("version") != GENERATOR_VERSION:
        return False
    return all(
        (directory / f).exists() and (directory / f).stat().st_size == size
        for f, size in recorded.get("files", {}).items()
    )


def generate(spec: Spec, root: str | os.PathLike, quiet: bool = False) -> dict:
    """Write the checkpoint for spec under root/<spec.name>/ (or reuse it); return its stamp."""
    directory = Path(root) / spec.name
    if _files_ok(directory, spec):
        return json.loads((directory / STAMP).read_text())

    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, DTYPES[spec.dtype])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if spec.tiny:
        layout = tiny_layout(spec.tiny, spec.seed)
    elif spec.family == "llama3":
        layout = llama3_layout(spec.size, itemsize)
    else:
        layout = llama_layout(spec.size, itemsize)
    filler = _Filler(dtype, spec.seed)

    directory.mkdir(parents=True, exist_ok=True)
    for old in directory.glob("*"):
        old.unlink()

    # Split the layout into shards of about equal bytes, keeping file order = layout order.
    total = sum(itemsize * _numel(s) for _, s in layout)
    shards = max(1, spec.shards)
    groups: list[list[tuple[str, tuple[int, ...]]]] = [[] for _ in range(shards)]
    acc = 0
    for name, shape in layout:
        idx = min(shards - 1, acc * shards // max(total, 1))
        groups[idx].append((name, shape))
        acc += itemsize * _numel(shape)

    files: dict[str, int] = {}
    weight_map: dict[str, str] = {}
    index = 0
    for i, group in enumerate(groups):
        fname = (
            "model.safetensors" if shards == 1 else f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        )
        tensors = {}
        for name, shape in group:
            tensors[name] = filler.make(index, shape)
            weight_map[name] = fname
            index += 1
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        del tensors
        files[fname] = (directory / fname).stat().st_size
        if not quiet:
            print(f"wrote {directory / fname} ({files[fname] / 1e9:.3f} GB)", flush=True)
    if shards > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (directory / "model.safetensors.index.json").write_text(json.dumps(index_doc, indent=1))

    stamp = {
        "version": GENERATOR_VERSION,
        "spec": asdict(spec),
        "files": files,
        "tensor_bytes": total,
        "tensors": len(layout),
        "dir": str(directory),
    }
    (directory / STAMP).write_text(json.dumps(stamp, indent=1))
    return stamp


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def tensorizer_copy(stamp: dict) -> str:
    """The checkpoint re-serialized in tensorizer's format (one file, all shards), made once."""
    path = os.path.join(stamp["dir"], "model.tensors")
    marker = path + ".json"
    want = {"spec": stamp["spec"], "version": GENERATOR_VERSION}
    if os.path.exists(path) and os.path.exists(marker):
        with open(marker) as f:
            got = json.load(f)
        if {k: got.get(k) for k in want} == want and os.path.getsize(path) == got.get("size"):
            return path
    from safetensors.torch import load_file
    from tensorizer import TensorSerializer

    tensors: dict = {}
    for f in checkpoint_files(stamp):
        tensors.update(load_file(f))
    ser = TensorSerializer(path)
    ser.write_state_dict(tensors)
    ser.close()
    with open(marker, "w") as f:
        json.dump({**want, "size": os.path.getsize(path)}, f)
    return path


def checkpoint_files(stamp: dict) -> list[str]:
    """Absolute paths of a generated checkpoint's .safetensors files, in shard order."""
    return [os.path.join(stamp["dir"], f) for f in sorted(stamp["files"])]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--size", default="2GiB", help="target tensor bytes (default 2GiB)")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--shards", type=int, default=1, help="number of files (default 1)")
    ap.add_argument("--tiny", type=int, default=0, metavar="N", help="N tiny tensors instead")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--family",
        default="llama",
        choices=["llama", "llama3"],
        help="llama: llama-2-like, sized to --size; llama3: Llama-3-8B's shapes",
    )
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out", "ckpt"))
    ap.add_argument(
        "--tensorizer",
        action="store_true",
        help="also write model.tensors (tensorizer's format) beside it",
    )
    ap.add_argument("--json", action="store_true", help="print only the stamp, as one JSON line")
    args = ap.parse_args(argv)
    spec = make_spec(args.size, args.dtype, args.shards, args.tiny, args.seed, args.family)
    stamp = generate(spec, args.out, quiet=args.json)
    if args.tensorizer:
        try:
            stamp = {**stamp, "tensorizer_file": tensorizer_copy(stamp)}
        except Exception as e:  # e.g. its writer's fixed 256 KiB index overflows on many tensors
            for leftover in ("model.tensors", "model.tensors.json"):
                Path(stamp["dir"], leftover).unlink(missing_ok=True)
            stamp = {**stamp, "tensorizer_error": f"conversion failed: {type(e).__name__}: {e}"}
    print(json.dumps(stamp) if args.json else json.dumps(stamp, indent=1))


if __name__ == "__main__":
    main()
