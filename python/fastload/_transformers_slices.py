"""transformers' tensor-parallel slices: the checkpoint tensors ``fastload.transformers`` hands
transformers in the state dict of a tensor-parallel load, where a load from files hands it
``safetensors``' ``get_slice``. Each is a view over a :class:`fastload._regions.Region` of its
tensor in a file opened once: indexing it for the rank's shard reads only that region's bytes,
or, through the group's exchange (``fastload.transformers._Exchange``), a row-parallel
weight's columns from a block of rows read once over the group.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from . import _fastload
from ._regions import ReadStats, Region, Runs, file_ranges

if TYPE_CHECKING:
    from .transformers import _Exchange


class _File:
    """One weight file opened once (``fastload.safe_open``: its source and header, pinned to the
    version it saw); :meth:`read` reads a tensor or a region of it through that handle (a
    :class:`_Tensor`, reading only the region's bytes), or, through ``exchange``, a row-parallel
    weight's columns from a block of rows read once over the group. Counts what it read as
    parts, whole and exchanged."""

    def __init__(
        self,
        uri: str,
        options: Mapping[str, Any],
        counts: ReadStats,
        shard: int = 0,
        exchange: _Exchange | None = None,
    ) -> None:
        from . import _options
        from ._safe_open import safe_open

        taken = _options.taken_by("safe_open")
        self._handle = safe_open(uri, **{k: v for k, v in options.items() if k in taken})
        self._counts = counts
        self._lock = threading.Lock()
        self._shard = shard
        self._exchange = exchange
        self._tensors: dict[str, _Tensor] = {}

    def _count(self, **got: int) -> None:
        with self._lock:
            for key, n in got.items():
                setattr(self._counts, key, getattr(self._counts, key) + n)

    def _tensor(self, name: str) -> _Tensor:
        tensor = self._tensors.get(name)
        if tensor is None:
            tensor = self._tensors[name] = _Tensor(self, name)
        return tensor

    def slices(self) -> dict[str, _Slice]:
        h = self._handle
        self._count(
            tensors=len(h._tensors), bytes=sum(e - b for _d, _s, b, e in h._tensors.values())
        )
        return {
            name: _Slice(self, name, dtype, shape)
            for name, (dtype, shape, _b, _e) in h._tensors.items()
        }

    def read(self, name: str, index: Any) -> Any:
        tensor = self._tensor(name)
        if self._exchange is not None and _exchangeable_index(index, tensor.shape):
            # transformers' slices (``slice(a, b)``) as the exchange compares them: steps
            # explicit.
            norm = tuple(slice(*i.indices(n)) for i, n in zip(index, tensor.shape))
            exchanged = self._exchange.read(tensor, norm)
            if exchanged is not None:
                return exchanged
        whole = index is Ellipsis or (
            isinstance(index, tuple) and all(i is Ellipsis for i in index)
        )
        # A box of the tensor (ints, slices, one ...) is read as a part; anything else (None,
        # lists, ...) whole, then torch indexes it.
        box = not whole and tensor.is_box(index)
        out, got = tensor.fetch(index if box else Ellipsis)
        if box:
            self._count(sliced_tensors=1, sliced_bytes=got, sliced_tensor_bytes=tensor.nbytes)
            return out
        self._count(whole_tensors=1, whole_bytes=tensor.nbytes)
        return out if whole else out[index]

    def close(self) -> None:
        self._handle.close()


def _exchangeable_index(index: Any, shape: tuple[int, ...]) -> bool:
    """Whether ``index`` is one slice per dim (what the exchange may take)."""
    return (
        isinstance(index, tuple)
        and len(index) == len(shape)
        and all(isinstance(i, slice) for i in index)
    )


class _Tensor(Region):
    """A tensor of a :class:`_File` (its :class:`fastload._regions.Region` in the file the handle
    opened), as transformers' slices and ``fastload._exchange`` read it; counts what the
    exchange read of it in its file's counts."""

    __slots__ = ("_file",)

    def __init__(self, file: _File, name: str) -> None:
        h = file._handle
        dtype, shape, begin, end = h._tensors[name]
        tshape = h._torch_shape(dtype, shape)
        super().__init__(
            h._open(),
            # The file's place among the checkpoint's (the exchange compares it); its handle's
            # reader holds this one file (see `raw`).
            file._shard,
            h._data_start + begin,
            end - begin,
            h._torch_dtype(name, dtype),
            tshape,
            h._read_cost,
            name,
            # The file (its URI, the version opened) and the data offsets in it: compared by
            # the ranks before they exchange the tensor's bytes.
            place=(h._file, h._version, begin, end),
        )
        self._file = file

    def raw(self, runs: Runs) -> Any:
        import torch

        capsule = self.reader.read(0, file_ranges(runs, self.at))
        return torch.from_dlpack(capsule)

    def is_box(self, index: Any) -> bool:
        """Whether ``index`` names a box of the tensor (ints in range, slices with steps >= 1,
        one ``...``), as ``parts=`` takes it."""
        return (
            _fastload.plan_region(self.shape, self.dtype.itemsize, index, 0, None, False).refused
            is None
        )

    def count_exchanged(self, got: int, exchanged: bool = True) -> None:
        """``got`` bytes read as this rank's block of rows (``exchanged``: false where the ranks
        then did not exchange, and the caller reads its part itself)."""
        if exchanged:
            self._file._count(exchanged_tensors=1, exchanged_bytes=got)
        else:
            self._file._count(sliced_bytes=got)


class _Slice:
    """A checkpoint tensor not read yet, handed to transformers in the state dict where a load from
    files hands it ``safetensors``' ``get_slice``: tensor parallelism indexes it for the rank's
    shard (``slice[rows, cols]``), and only that part's bytes are read; ``slice[...]`` reads it
    whole. ``dtype``, ``shape`` and ``is_floating_point`` answer what transformers asks of a state
    dict's tensors before reading them."""

    __slots__ = ("_dtype", "_file", "_name", "_shape")

    def __init__(self, file: _File, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self._file, self._name, self._dtype, self._shape = file, name, dtype, shape

    def get_shape(self) -> list[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._dtype

    @property
    def dtype(self) -> Any:
        from . import _torch_glue

        return _torch_glue().DTYPES[self._dtype]

    @property
    def shape(self) -> Any:
        import torch

        return torch.Size(self._shape)

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def is_floating_point(self) -> bool:
        return bool(self.dtype.is_floating_point)

    def __getitem__(self, index: Any) -> Any:
        return self._file.read(self._name, index)

    def __repr__(self) -> str:
        return f"fastload slice {self._name!r} ({self._dtype}, {list(self._shape)})"
