"""Turning the native module's DLPack capsules into torch tensors."""

from __future__ import annotations

from typing import Any

import torch

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
    target = _VIEWED[dtype]
    if target is None:
        from ._errors import FormatError

        raise FormatError(
            f"{file_hint}: dtype {dtype} is not supported by torch {torch.__version__}"
        )
    if dtype == "F4":
        # Two 4-bit values per byte: torch's float4_e2m1fn_x2 counts bytes in the last dimension.
        if not shape or shape[-1] % 2:
            from ._errors import FormatError

            raise FormatError(f"{file_hint}: F4 tensor of shape {shape} has an odd last dimension")
        shape = (*shape[:-1], shape[-1] // 2)
    return tensor.view(target).reshape(shape)
