"""Turning the native module's DLPack capsules into torch tensors, and allocating the torch
memory that staged (GPU) loads copy into.

The list of dtypes, and which of them DLPack carries natively, are the native module's
(``_fastload.DTYPES``, ``_fastload.DLPACK_DTYPES``); this module only knows what torch calls each
one, and refuses to import when a dtype of the native module is missing from that mapping."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from . import _fastload
from ._errors import FormatError

# Each safetensors dtype's torch attribute (None: torch has no such dtype). Newer dtypes are
# looked up at import, so an older torch simply lacks them.
_TORCH_NAMES: dict[str, str | None] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
    "F6_E2M3": None,
    "F6_E3M2": None,
}

_unnamed = sorted(set(_fastload.DTYPES) - set(_TORCH_NAMES))
if _unnamed:
    raise ImportError(f"fastload._torch has no torch name for native dtype(s) {_unnamed}")

# Every dtype of the native module that this torch has.
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name in _fastload.DTYPES
    if (attr := _TORCH_NAMES[name]) is not None and hasattr(torch, attr)
}
# dtypes whose capsules carry the dtype itself; the others carry flat bytes, viewed here.
DLPACK: frozenset[str] = frozenset(_fastload.DLPACK_DTYPES)


def to_tensor(
    dtype: str, shape: tuple[int, ...], capsule: Any, file_hint: str = ""
) -> torch.Tensor:
    if dtype in DLPACK:
        return torch.from_dlpack(capsule)
    # Flat bytes, viewed as the dtype; one torch has no name for (F6) is refused there, as a
    # staged load refuses it, rather than handed out as bytes of the wrong shape.
    return from_bytes(dtype, shape, torch.from_dlpack(capsule), file_hint)


class UnsupportedDtype(FormatError):
    """A dtype this torch cannot represent; ``Stream`` names the file that holds the tensor."""

    def __init__(self, dtype: str, tensor: str) -> None:
        self.dtype, self.tensor = dtype, tensor
        super().__init__(self.describe(None))

    def describe(self, file: str | None) -> str:
        where = f"{file}: tensor {self.tensor!r}" if file else f"tensor {self.tensor!r}"
        return f"{where}: dtype {self.dtype} is not supported by torch {torch.__version__}"


def _unsupported(dtype: str, file_hint: str) -> Exception:
    return UnsupportedDtype(dtype, file_hint)


def from_bytes(
    dtype: str, shape: tuple[int, ...], raw: torch.Tensor, file_hint: str = ""
) -> torch.Tensor:
    """Views a flat uint8 tensor (a staged load's destination, or the bytes of a dtype DLPack
    cannot carry) as ``dtype`` and ``shape``."""
    target = DTYPES.get(dtype)
    if target is None:
        raise _unsupported(dtype, file_hint)
    if dtype == "F4":
        # Two 4-bit values per byte: torch's float4_e2m1fn_x2 counts bytes in the last dimension.
        if not shape or shape[-1] % 2:
            raise FormatError(
                f"{file_hint}: F4 tensor of shape {shape} has an odd last dimension",
                path=file_hint or None,
            )
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
