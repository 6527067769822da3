"""``fastload.safe_open`` and ``fastload.load_file``: ``safetensors.safe_open`` and
``safetensors.torch.load_file`` for every URI fastload reads.

A :class:`safe_open` opens its file once (the source and its validated header, through
``_fastload.Reader``) and reads each tensor, or the part of it a slice selects, when asked. A
slice is a view over a :class:`fastload._regions.Region` of the tensor: it reads only the byte
ranges the region needs (planned natively, by what a request to the file's source costs), the
native reader reads them in parallel blocks into one buffer, and the slice is a strided view of
that buffer (copied out when it does not cover the buffer).

Indexing follows ``safetensors.safe_open(..., framework="pt")``, which indexes a torch tensor of
the whole file: an int drops its dimension, slices take positive steps, ``...`` and ``None``
work as in torch, and every error is torch's (checked on a ``meta`` tensor before anything is
read). Shapes come from Python's ``range`` arithmetic, which clamps as torch does but does not
overflow where torch's does (steps and bounds near 2**63, a tensor of no element with dims of
2**62). Indices other than ints, slices, ``...`` and ``None`` (lists, tensors, booleans) read the
whole tensor and let torch index it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict

from . import _fastload, _options
from . import _safetensors_backend as _check_backend
from . import _safetensors_device as _device

# Defined in the package (`import fastload` does not import this module); here too, as before.
from . import load_file as load_file
from ._errors import ConfigError, FastloadError, FormatError, TensorNotFoundError

# The planner's names, where they were first (kept for the callers that import them from here).
from ._regions import LOCAL_READ_COST as LOCAL_READ_COST
from ._regions import MAPPED_READ_COST as MAPPED_READ_COST
from ._regions import REMOTE_READ_COST as REMOTE_READ_COST
from ._regions import Plan as Plan
from ._regions import Region
from ._regions import empty as empty
from ._regions import index_reads as index_reads
from ._regions import plan as plan

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from ._options import PathLike, Size

# The frameworks safetensors calls PyTorch.
_TORCH = frozenset({"pt", "torch", "pytorch"})
# Options a safe_open reads with (the rest, except names, are for the loads behind a GPU
# get_tensor and get_tensors): those src/options.rs marks Taker::Reader.
_READER_OPTIONS = _options.taken_by("reader")


class SafeOpenOptions(TypedDict, total=False):
    """fastload's options (:class:`fastload.Options`) a :class:`safe_open` takes: all but
    ``device`` (its own parameter) and ``names``."""

    # boilerplate: the keys of Options that safe_open takes, spelled out: a TypedDict cannot be
    # derived from another by leaving keys out
    concurrency: int | None
    block_size: Size | None
    memory_limit: Size | None
    method: str | None
    copy_streams: int | None
    storage_options: Mapping[str, object] | None
    cache: bool | str | os.PathLike[str] | None
    verify: bool | None
    keyset: str | os.PathLike[str] | None
    associated_data: bytes | str | None
    peers: Sequence[str] | str | None
    peer_token: str | None


class safe_open:
    """Opens a safetensors file (a path, ``s3://``, ``gs://``, ``az://``, ``http(s)://`` or
    ``hf://ORG/REPO[@rev]/FILE``) and reads tensors, or slices of them, as asked: a drop-in for
    ``safetensors.safe_open(filename, framework="pt", device=...)``.

    ``options`` are fastload's (:class:`fastload.Options`): ``concurrency``, ``block_size``,
    ``storage_options``, ``cache`` and ``verify`` for the reads; the others apply to a GPU
    ``get_tensor`` and to ``get_tensors``, which are loads (of the version this handle opened).
    ``verify=True`` checks the file whole against its store's digest (Hub files, S3/GCS/Azure
    objects' stored checksums) when the handle opens, before any byte of it is served.
    ``backend`` is accepted for safetensors' signature and changes nothing.
    """

    def __init__(
        self,
        filename: PathLike,
        framework: str = "pt",
        device: Any = "cpu",
        *,
        backend: str = "mmap",
        **options: Unpack[SafeOpenOptions],
    ) -> None:
        from . import _target_for, _torch_glue, _uris

        _options.check("safe_open", options, _options.taken_by("safe_open"))
        if str(framework).lower() not in _TORCH:
            raise ConfigError(
                f"invalid option framework: {framework!r}: fastload.safe_open returns torch "
                "tensors (framework='pt')",
                option="framework",
            )
        _check_backend(backend)
        self._glue = _torch_glue()
        self._device, self._target = _target_for(_device(device), options.get("method"))
        self._uri = _uris(filename)
        self._options = options
        native = {k: options[k] for k in _READER_OPTIONS if k in options}  # type: ignore[literal-required]
        # The options only its loads take are checked now too, not at the first load (their
        # variables are: the reader resolves every option).
        loads = {k: v for k, v in options.items() if k not in native}
        if loads:
            _fastload.resolve_options(self._uri, **loads)  # type: ignore[arg-type]
        reader = _fastload.Reader(self._uri, **native)
        headers = reader.headers()
        if len(headers) != 1:
            raise ConfigError(
                f"invalid option uri: safe_open reads one file, {self._uri[0]!r} names "
                f"{len(headers)}",
                option="uri",
            )
        header = headers[0]
        self._file: str = header["file"]
        self._data_start: int = header["data_start"]
        self._version: str | None = header.get("version")  # the version opened
        self._tensors: dict[str, tuple[str, tuple[int, ...], int, int]] = {
            name: (dtype, tuple(shape), begin, end)
            for name, dtype, shape, begin, end in header["tensors"]
        }
        self._offset_keys = [t[0] for t in header["tensors"]]
        metadata = header["metadata"]
        self._metadata: dict[str, str] | None = None if metadata is None else dict(metadata)
        # What one more request to the file costs (``Source::read_cost``): slices plan by it.
        self._read_cost: int = header["read_cost"]
        self._reader: Any = reader
        self._bytes_read = 0

    # -- the file ------------------------------------------------------------------------------

    def _open(self) -> Any:
        if self._reader is None:
            raise FastloadError(f"{self._file}: the file is closed")
        return self._reader

    def _info(self, name: str) -> tuple[str, tuple[int, ...], int, int]:
        self._open()
        info = self._tensors.get(name)
        if info is None:
            raise TensorNotFoundError(
                f"{self._file}: file does not contain tensor {name!r}", names=[name], uri=self._file
            )
        return info

    def keys(self) -> list[str]:
        """The names of the tensors, sorted."""
        self._open()
        return sorted(self._tensors)

    def offset_keys(self) -> list[str]:
        """The names of the tensors in the order of their data in the file."""
        self._open()
        return list(self._offset_keys)

    def metadata(self) -> dict[str, str] | None:
        """The header's ``__metadata__``: ``None`` when it has none (or ``null``), ``{}`` when it
        is empty, as safetensors tells them apart."""
        self._open()
        return None if self._metadata is None else dict(self._metadata)

    @property
    def bytes_read(self) -> int:
        """Tensor bytes read so far (headers not counted); after close, as they were then."""
        return self._bytes_read if self._reader is None else int(self._reader.bytes_read)

    # -- tensors -------------------------------------------------------------------------------

    def _read(self, begin: int, ranges: list[tuple[int, int]], reader: Any = None) -> torch.Tensor:
        """The bytes of ``ranges`` (from a tensor's start at ``begin``) as one uint8 tensor, read
        through ``reader`` (a slice's, which outlives ``close()``) or this file's."""
        at = self._data_start + begin
        reader = self._open() if reader is None else reader
        capsule = reader.read(0, [(at + o, n) for o, n in ranges])
        return self._glue.torch.from_dlpack(capsule)

    def _torch_dtype(self, name: str, dtype: str) -> Any:
        """The torch dtype of a tensor; a dtype this torch has no name for is a format error
        naming the file and tensor, as a load raises it."""
        tdtype = self._glue.DTYPES.get(dtype)
        if tdtype is None:
            e = self._glue.UnsupportedDtype(dtype, name)
            raise FormatError(e.describe(self._file), path=self._file)
        return tdtype

    @staticmethod
    def _torch_shape(dtype: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape torch gives the tensor: F4 packs two values a byte in the last dim."""
        if dtype == "F4" and shape:
            return (*shape[:-1], shape[-1] // 2)
        return shape

    def _load(self, **extra: Any) -> dict[str, torch.Tensor]:
        """A load of this file through the handle's own reader: the version it opened, never
        the URI opened again (which could be a newer version)."""
        from . import Stream

        opts: dict[str, Any] = dict(self._options)
        opts.update(extra, device=self._device)
        with Stream(self._uri, _target=self._target, _reader=self._open(), **opts) as s:
            return dict(s)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor, on this safe_open's device: read in parallel blocks for the CPU, a
        staged load of this tensor for a GPU."""
        dtype, shape, begin, end = self._info(name)
        if self._target is not None:
            return self._load(names=[name])[name]
        raw = self._read(begin, [(0, end - begin)])
        return self._glue.from_bytes(dtype, shape, raw, self._file)

    def get_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor, in file order (one load of the whole file, of the version this handle
        opened)."""
        self._open()
        tensors = self._load()
        return {k: tensors[k] for k in self._offset_keys}

    def get_slice(self, name: str) -> SafeSlice:
        """A view of the tensor to index: ``f.get_slice("w")[:, 1024:2048]`` reads only those
        columns' bytes (or the rows they span, when one read is cheaper than many)."""
        dtype, shape, _, _ = self._info(name)
        return SafeSlice(self, name, dtype, shape)

    def close(self) -> None:
        """Closes the file (``__exit__`` does); tensors already returned stay valid."""
        if self._reader is not None:
            self._bytes_read = int(self._reader.bytes_read)
        self._reader = None

    def __enter__(self) -> safe_open:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SafeSlice:
    """A tensor of a :class:`safe_open` not read yet; indexing it reads what the index selects.
    safetensors' ``PySafeSlice``: ``get_shape()``, ``get_dtype()`` and ``[...]``. It holds the
    file open: as safetensors' slices do, it keeps working after the file's ``close()``. A view
    over the tensor's :class:`fastload._regions.Region`."""

    def __init__(self, file: safe_open, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self._file, self._name, self._dtype, self._shape = file, name, dtype, shape
        self._reader = file._open()
        self._region: Region | None = None

    def get_shape(self) -> list[int]:
        """The shape of the whole tensor."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype ("F32", "BF16", "F8_E4M3", ...)."""
        return self._dtype

    def region(self) -> Region:
        """The tensor's region reader (its dtype checked here: one torch has no name for is a
        format error naming the file and tensor)."""
        if self._region is None:
            f = self._file
            begin, end = f._tensors[self._name][2:]
            self._region = Region(
                self._reader,
                0,
                f._data_start + begin,
                end - begin,
                f._torch_dtype(self._name, self._dtype),
                f._torch_shape(self._dtype, self._shape),
                f._read_cost,
                self._name,
                place=(f._file, f._version, begin, end),
            )
        return self._region

    def __getitem__(self, index: Any) -> torch.Tensor:
        out, _ = self.region().fetch(index)
        f = self._file
        if f._target is not None:
            out = out.to(f._device)
        return out

    def __repr__(self) -> str:
        return f"SafeSlice({self._name!r}, dtype={self._dtype}, shape={list(self._shape)})"
