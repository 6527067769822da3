"""Turning the native module's DLPack capsules into torch tensors, and allocating the torch
memory that staged (GPU) loads copy into."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

# Every safetensors dtype torch has natively, which DLPack also carries (the rest are in _VIEWED).
NATIVE: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
}

# dtypes that travel as raw bytes (DLPack/torch has no native code for them) and are viewed here.
_VIEWED: dict[str, Any] = {
    "U16": getattr(torch, "uint16", None),
    "U32": getattr(torch, "uint32", None),
    "U64": getattr(torch, "uint64", None),
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
    "F8_E4M3FNUZ": getattr(torch, "float8_e4m3fnuz", None),
    "F8_E5M2FNUZ": getattr(torch, "float8_e5m2fnuz", None),
    "F8_E8M0": getattr(torch, "float8_e8m0fnu", None),
    "F4": getattr(torch, "float4_e2m1fn_x2", None),
}


def to_tensor(
    dtype: str, shape: tuple[int, ...], capsule: Any, file_hint: str = ""
) -> torch.Tensor:
    tensor = torch.from_dlpack(capsule)
    if dtype not in _VIEWED:
        return tensor
    return from_bytes(dtype, shape, tensor, file_hint)


def _unsupported(dtype: str, file_hint: str) -> Exception:
    from ._errors import FormatError

    return FormatError(f"{file_hint}: dtype {dtype} is not supported by torch {torch.__version__}")


def from_bytes(
    dtype: str, shape: tuple[int, ...], raw: torch.Tensor, file_hint: str = ""
) -> torch.Tensor:
    """Views a flat uint8 tensor (a staged load's destination, or the bytes of a dtype DLPack
    cannot carry) as ``dtype`` and ``shape``."""
    target = NATIVE.get(dtype) or _VIEWED.get(dtype)
    if target is None:
        raise _unsupported(dtype, file_hint)
    if dtype == "F4":
        # Two 4-bit values per byte: torch's float4_e2m1fn_x2 counts bytes in the last dimension.
        if not shape or shape[-1] % 2:
            from ._errors import FormatError

            raise FormatError(f"{file_hint}: F4 tensor of shape {shape} has an odd last dimension")
        shape = (*shape[:-1], shape[-1] // 2)
    if target is not torch.uint8:
        raw = raw.view(target)
    return raw.reshape(shape)


Allocate = Callable[[list[int]], tuple[Any, list[tuple[torch.Tensor, int]]]]


def allocator(device: torch.device) -> Allocate:
    """The destination allocator of a staged load: one uint8 tensor per tensor, from torch's
    allocator on ``device``. For CUDA the memory is taken on the stream that is current now (the
    caller's), and that stream's handle is returned so the copies are ordered after its queued
    work (memory torch just freed on it may still be in use there)."""
    if device.type == "cuda":
        stream = torch.cuda.current_stream(device)
        handle: int | None = stream.cuda_stream

        def on_stream() -> Any:
            return torch.cuda.stream(stream)
    else:
        handle = None

        def on_stream() -> Any:
            return contextlib.nullcontext()

    empty, uint8 = torch.empty, torch.uint8

    def allocate(sizes: list[int]) -> tuple[Any, list[tuple[torch.Tensor, int]]]:
        with on_stream():
            tensors = [empty(n, dtype=uint8, device=device) for n in sizes]
        return handle, [(t, t.data_ptr()) for t in tensors]

    return allocate
