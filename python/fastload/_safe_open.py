"""``fastload.safe_open`` and ``fastload.load_file``: ``safetensors.safe_open`` and
``safetensors.torch.load_file`` for every URI fastload reads.

A :class:`safe_open` opens its file once (the source and its validated header, through
``_fastload.Reader``) and reads each tensor, or the part of it a slice selects, when asked. A
slice reads only the byte ranges it needs: :func:`plan` picks them, the native reader reads them
in parallel blocks into one buffer, and the slice is a strided view of that buffer (copied out
when it does not cover the buffer).

Indexing follows ``safetensors.safe_open(..., framework="pt")``, which indexes a torch tensor of
the whole file: an int drops its dimension, slices take positive steps, ``...`` and ``None``
work as in torch, and every error is torch's (checked on a ``meta`` tensor before anything is
read). Shapes come from Python's ``range`` arithmetic, which clamps as torch does but does not
overflow where torch's does (steps and bounds near 2**63, a tensor of no element with dims of
2**62). Indices other than ints, slices, ``...`` and ``None`` (lists, tensors, booleans) read the
whole tensor and let torch index it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypedDict

from . import _fastload, _options
from . import _safetensors_backend as _check_backend
from . import _safetensors_device as _device

# Defined in the package (`import fastload` does not import this module); here too, as before.
from . import load_file as load_file
from ._errors import ConfigError, FastloadError, FormatError, TensorNotFoundError

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from ._options import PathLike, Size

# What one more read costs, in bytes one could read instead: a slice spans the gap between
# two runs it needs when reading the gap is cheaper than another request. For object stores a
# request's round trip, shared by the reads in flight (about 20 ms x 1.5 GB/s / 64); for files
# a task and a pread.
REMOTE_READ_COST = 512 * 1024
LOCAL_READ_COST = 16 * 1024
# A mapped file (the engines' lazy tensors over local files): no request at all, a region is a
# view of its span's pages, so the plan is always one span.
MAPPED_READ_COST = 1 << 62

# The frameworks safetensors calls PyTorch.
_TORCH = frozenset({"pt", "torch", "pytorch"})
# Options a safe_open reads with (the rest, except names, are for the loads behind a GPU
# get_tensor and get_tensors): those src/options.rs marks Taker::Reader.
_READER_OPTIONS = _options.taken_by("reader")


class SafeOpenOptions(TypedDict, total=False):
    """fastload's options (:class:`fastload.Options`) a :class:`safe_open` takes: all but
    ``device`` (its own parameter) and ``names``."""

    concurrency: int | None
    block_size: Size | None
    memory_limit: Size | None
    method: str | None
    storage_options: Mapping[str, object] | None
    cache: bool | str | os.PathLike[str] | None
    verify: bool | None
    keyset: str | os.PathLike[str] | None
    associated_data: bytes | str | None
    peers: Sequence[str] | str | None
    peer_token: str | None


# The integer dtype each width of element is moved as (torch.uint8, ...), set on first use.
_CARRIERS: dict[int, Any] = {}


class Plan(NamedTuple):
    """How a slice is read: ``ranges`` (``(offset, len)`` in bytes from the tensor's start) land
    one after the other in a buffer that ``size`` and ``stride`` (in elements) view as the
    selected box; indexing that with ``view`` drops int dims and adds ``None`` ones."""

    ranges: list[tuple[int, int]]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    view: tuple[Any, ...]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _basic(index: Any, ndim: int) -> tuple[Any, ...] | None:
    """``index`` as a tuple with one entry per dim (ints, slices of ints with positive steps)
    plus ``None``s, Ellipsis expanded; ``None`` when it is anything else (torch indexes it)."""
    items = index if isinstance(index, tuple) else (index,)
    out: list[Any] = []
    ellipses = 0
    for it in items:
        if it is None or it is Ellipsis or _is_int(it):
            ellipses += it is Ellipsis
        elif isinstance(it, slice):
            if not all(v is None or _is_int(v) for v in (it.start, it.stop, it.step)):
                return None
            if it.step is not None and it.step <= 0:
                return None
        else:
            return None
        out.append(it)
    if ellipses > 1:
        return None
    used = sum(1 for it in out if it is not None and it is not Ellipsis)
    if used > ndim:
        return None
    fill = (slice(None),) * (ndim - used)
    if ellipses:
        at = out.index(Ellipsis)
        return (*out[:at], *fill, *out[at + 1 :])
    return (*out, *fill)


def plan(
    shape: Sequence[int], itemsize: int, index: Any, read_cost: int = LOCAL_READ_COST
) -> Plan | None:
    """The byte ranges of a C-contiguous tensor of ``shape`` that ``tensor[index]`` needs, and how
    to view them; ``None`` for an index that is not basic (see :func:`_basic`) or selects nothing.

    Dims before a "run" dim ``r`` are walked index by index (only the selected ones); from ``r``
    inwards each run is read whole, from the first selected element to the last (the elements
    between them at steps or in other rows are read too). ``r`` is the one that reads the fewest
    bytes plus ``read_cost`` per run; a dim-0 slice is one run, ``[:, a:b]`` either a run per row
    or one run across the rows it spans."""
    ndim = len(shape)
    basic = _basic(index, ndim)
    if basic is None:
        return None
    starts: list[int] = []
    steps: list[int] = []
    counts: list[int] = []
    view: list[Any] = []
    dim = 0
    for it in basic:
        if it is None:
            view.append(None)
            continue
        n = shape[dim]
        if isinstance(it, slice):
            start, stop, step = it.indices(n)
            count = len(range(start, stop, step))
            # One element: its step is no stride (a step of 2**62 would overflow the view's).
            step = step if count > 1 else 1
            view.append(slice(None))
        else:
            start, step, count = (it + n if it < 0 else it), 1, 1
            view.append(0)
        starts.append(start)
        steps.append(step)
        counts.append(count)
        dim += 1
    if any(c == 0 for c in counts):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(ndim)]
    # Element offset of the first selected element, from dim d inwards, and the span to the last.
    best: tuple[int, int, int] | None = None  # (cost, runs, r)
    for r in range(ndim - 1, -1, -1) if ndim else [0]:
        runs = math.prod(counts[:r])
        span = sum((c - 1) * s * st for c, s, st in zip(counts[r:], steps[r:], strides[r:])) + 1
        cost = runs * (span * itemsize + read_cost)
        if best is None or cost <= best[0]:
            best = (cost, runs, r)
    assert best is not None
    _, runs, r = best
    span = sum((c - 1) * s * st for c, s, st in zip(counts[r:], steps[r:], strides[r:])) + 1
    first = sum(a * st for a, st in zip(starts[r:], strides[r:]))
    # The runs' starts: every selected index tuple of the dims before r, in C order.
    offsets = [first]
    for d in range(r):
        picks = [(starts[d] + k * steps[d]) * strides[d] for k in range(counts[d])]
        offsets = [o + p for o in offsets for p in picks]
    ranges = [(o * itemsize, span * itemsize) for o in offsets]
    size = tuple(counts)
    stride = [0] * ndim
    inner = span
    for d in range(r - 1, -1, -1):
        stride[d] = inner
        inner *= counts[d]
    for d in range(r, ndim):
        stride[d] = steps[d] * strides[d]
    return Plan(ranges, size, tuple(stride), tuple(view))


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
        self._remote = _fastload.is_remote_uri(self._uri[0]) or self._file.startswith("hf://")
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


def index_key(index: Any) -> tuple[Any, ...]:
    """A basic index (see :func:`_basic`) as a key: its slices as their bounds, a bare item
    told apart from a tuple of one."""
    items = index if isinstance(index, tuple) else (index,)
    return (
        isinstance(index, tuple),
        *((it.start, it.stop, it.step) if isinstance(it, slice) else it for it in items),
    )


_MISSING = object()


def remembered(cache: dict[Any, Any], limit: int, key: Any, make: Callable[[], Any]) -> Any:
    """``cache[key]``, made by ``make()`` the first time (``None`` kept too); the cache is
    emptied once it holds ``limit`` entries."""
    got = cache.get(key, _MISSING)
    if got is _MISSING:
        got = make()
        if len(cache) >= limit:
            cache.clear()
        cache[key] = got
    return got


# Plans of regions, by shape, element size, index and read cost (see _planned): the layers of a
# model repeat their shapes and their loaders' indices, so a load plans a few dozen regions.
_PLANS: dict[Any, tuple[Any, Plan | None]] = {}
_PLANS_MAX = 4096


def empty(torch: Any, shape: Sequence[int], dtype: Any, device: Any = None) -> torch.Tensor:
    """A tensor of ``shape``, no element in it (a dim of 0), as indexing a whole tensor gives
    it. Its strides are torch's unless they overflow (``(0, 2**62, 2**62)``: the last dim's
    stride times its size is past int64, which ``torch.empty`` refuses though there is nothing
    to stride over): then all 0."""
    try:
        return torch.empty(shape, dtype=dtype, device=device)
    except RuntimeError:
        if 0 not in shape:
            raise
        return torch.empty_strided(shape, (0,) * len(shape), dtype=dtype, device=device)


def _indexed_shape(torch: Any, tshape: tuple[int, ...], index: Any) -> Any:
    """The shape of ``tensor[index]`` (a basic index) by Python's ``range`` arithmetic, which
    clamps bounds as torch does: torch's own overflows int64 at steps or bounds near 2**63
    (``[::2**63 - 1]`` of 4 rows gives it 0 rows, not 1) and at the strides and offsets of a
    tensor of no element with dims of 2**62. An int out of range raises torch's IndexError."""
    out: list[int] = []
    dim = 0
    basic = _basic(index, len(tshape))
    assert basic is not None
    for it in basic:
        if it is None:
            out.append(1)
            continue
        n = tshape[dim]
        if isinstance(it, slice):
            out.append(len(range(n)[it]))
        elif not -n <= it < n:
            # torch's message, from a tensor of no storage (strides of 0 overflow nothing).
            meta = torch.empty_strided(tshape, (0,) * len(tshape), dtype=torch.uint8, device="meta")
            try:
                meta[index]
            except RuntimeError:  # its overflow at another entry: the error is this int's
                pass
            raise IndexError(f"index {it} is out of bounds for dimension {dim} with size {n}")
        dim += 1
    return torch.Size(out)


def _planned(
    torch: Any, tshape: tuple[int, ...], itemsize: int, index: Any, read_cost: int
) -> tuple[Any, Plan | None]:
    """The shape of ``tensor[index]`` (a basic index: see :func:`_basic`), with torch's own
    error for an int out of range, raised before anything is read, and its :func:`plan`,
    worked out once per distinct region."""

    def make() -> tuple[Any, Plan | None]:
        return _indexed_shape(torch, tshape, index), plan(tshape, itemsize, index, read_cost)

    key = (tuple(tshape), itemsize, index_key(index), read_cost)
    return remembered(_PLANS, _PLANS_MAX, key, make)


def index_reads(
    torch: Any,
    tdtype: torch.dtype,
    tshape: tuple[int, ...],
    nbytes: int,
    index: Any,
    read_cost: int,
    compact: bool = True,
) -> tuple[list[tuple[int, int]], Callable[[Any], torch.Tensor]]:
    """How to read ``tensor[index]`` of a C-contiguous tensor of ``tshape`` and ``tdtype``
    (``nbytes`` long) on the host, reading only what :func:`plan` picks: the ``(offset, len)``
    ranges from the tensor's start to read (none for an empty region; an index that is not basic
    reads the whole tensor and lets torch index it), and what makes the region of their bytes,
    one after the other as a uint8 tensor (``None`` where there are no ranges). ``compact``: a
    result that is a strided view of more than it selects is copied out (``False``: returned as
    the view, for bytes read without a copy, a mapping)."""
    if _basic(index, len(tshape)) is None:
        # Lists, tensors, booleans: torch indexes the whole tensor.
        return [(0, nbytes)], lambda raw: raw.view(tdtype).reshape(tshape)[index]
    want, p = _planned(torch, tshape, tdtype.itemsize, index, read_cost)
    if p is None:
        return [], lambda _: empty(torch, want, tdtype)
    # Strided views and copies of plain integers of the same width: every dtype (fp8, fp4,
    # bool) moves as its bits.
    if not _CARRIERS:
        _CARRIERS.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    # The view drops or adds no dim (every entry ``slice(None)``): no indexing to do.
    plain = all(isinstance(v, slice) for v in p.view)

    def finish(got: Any) -> torch.Tensor:
        raw = got.view(_CARRIERS[tdtype.itemsize])
        out = raw.as_strided(p.size, p.stride)
        if not plain:
            out = out[p.view]
        if compact and not (out.is_contiguous() and out.numel() == raw.numel()):
            out = out.clone(memory_format=torch.contiguous_format)
        return out.view(tdtype)

    return p.ranges, finish


class SafeSlice:
    """A tensor of a :class:`safe_open` not read yet; indexing it reads what the index selects.
    safetensors' ``PySafeSlice``: ``get_shape()``, ``get_dtype()`` and ``[...]``. It holds the
    file open: as safetensors' slices do, it keeps working after the file's ``close()``."""

    def __init__(self, file: safe_open, name: str, dtype: str, shape: tuple[int, ...]) -> None:
        self._file, self._name, self._dtype, self._shape = file, name, dtype, shape
        self._reader = file._open()
        self._span = file._tensors[name][2:]

    def get_shape(self) -> list[int]:
        """The shape of the whole tensor."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype ("F32", "BF16", "F8_E4M3", ...)."""
        return self._dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        f = self._file
        begin, end = self._span
        ranges, finish = index_reads(
            f._glue.torch,
            f._torch_dtype(self._name, self._dtype),
            f._torch_shape(self._dtype, self._shape),
            end - begin,
            index,
            REMOTE_READ_COST if f._remote else LOCAL_READ_COST,
        )
        out = finish(f._read(begin, ranges, self._reader) if ranges else None)
        if f._target is not None:
            out = out.to(f._device)
        return out

    def __repr__(self) -> str:
        return f"SafeSlice({self._name!r}, dtype={self._dtype}, shape={list(self._shape)})"
