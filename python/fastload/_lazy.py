"""Lazy tensors: checkpoint tensors handed out before any byte of them is read, for code that
narrows a tensor before it copies it (the serving engines' ``weight_loader``s), so that each
worker reads only the rows and columns it keeps.

A :class:`LazyTensor` has the shape, dtype and device (``cpu``) of its tensor and no storage.
View ops (``narrow``, basic indexing and slicing, ``select``, ``split``/``chunk``, ``unbind``,
``unsqueeze``/``squeeze``, ``detach``, a ``view`` to its own shape) compose into a new lazy
tensor of the same file region, still unread; any other op (``copy_`` into a parameter, ``to``,
``t()``, arithmetic, ...) reads the region the lazy tensor covers (only its byte ranges, planned
natively: ``fastload._regions``) and runs on what was read. So a tensor nobody asks for is never
read, a ``narrow(...).copy_`` reads the narrowed rows (or columns), and code that does anything else
still gets the right values, from a whole read. In-place ops act on the region once read (the
lazy tensor keeps it): later uses of the same lazy tensor see them.

:class:`Checkpoint` opens the files of a checkpoint once (one native ``Reader``: every URI
fastload reads, pinned to the versions it opened) and hands out a lazy tensor per tensor;
:class:`Stats` counts what was read, as slices and whole, and what was never read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

from . import _fastload, _options, _readahead, _torch_glue, _uris
from ._regions import MAPPED_READ_COST, ReadStats, Region
from ._regions import empty as _empty
from ._safe_open import safe_open

__all__ = ["Checkpoint", "LazyTensor", "Stats"]

# The options a Reader takes (src/options.rs marks them Taker::Reader).
READER_OPTIONS = _options.taken_by("reader")

_aten = torch.ops.aten


# The one shape of read statistics (kept under this name for the engines).
Stats = ReadStats


class _Source(Region):
    """One tensor of a file (a :class:`fastload._regions.Region`), and what has been read of it:
    through the group's exchange, the read-ahead, or alone."""

    __slots__ = ("ahead", "counted", "exchange", "key", "position", "stats", "whole")

    def __init__(self, region: Region, stats: Stats, exchange: Any = None) -> None:
        super().__init__(
            region.reader,
            region.shard,
            region.at,
            region.nbytes,
            region.dtype,
            region.shape,
            region.cost,
            region.name,
            region.mapped,
            region.place,
        )
        self.stats = stats
        self.exchange = exchange  # a _exchange.ColumnExchange, or None
        self.whole: torch.Tensor | None = None  # once read whole: later regions view it
        self.counted: str | None = None  # "sliced", "whole" or "exchanged", once read
        self.ahead: _readahead.ReadAhead | None = None
        self.key = _readahead.key(self.name, self.shape, self.dtype)
        self.position = 0

    @property
    def done(self) -> bool:
        return self.counted is not None

    def read(self, index: tuple[Any, ...], full: bool) -> torch.Tensor:
        """``tensor[index]`` (a basic index); ``full``: the index selects the whole tensor."""
        if self.whole is not None:
            return self.whole[index]
        s, reads_ahead = self.stats, self.ahead
        if full and self.exchange is not None and self.exchange.shares(self):
            shared = self._read_shared(index)
            if shared is not None:
                return shared
            reads_ahead = None  # the group did not share: read alone, as without it
        if self.exchange is not None and self.exchange.wants(self, index):
            block = reads_ahead.take(self, index, full, True) if reads_ahead else None
            if block is not None:
                s.ahead_bytes += block[1]
            elif self.exchange.block(self) is not None:
                s.waited_reads += 1
            exchanged = self.exchange.read(self, index, block[0] if block else None)
            if exchanged is not None:
                return exchanged
            reads_ahead = None  # the group did not exchange: read alone, as without it
        ahead = reads_ahead.take(self, index, full) if reads_ahead is not None else None
        if ahead is not None:
            out, got = ahead
            s.ahead_bytes += got
        else:
            out, got = self.fetch(index)
            s.waited_reads += 1
        self._count(got)
        if full:
            self.whole = out
        return out

    def _read_shared(self, index: tuple[Any, ...]) -> torch.Tensor | None:
        """The whole tensor through the group (``exchange.read_whole``): read here if this rank
        owns it (what was read ahead, else a read), else received; None where the group did not
        share it (then read it alone)."""
        s, exchange = self.stats, self.exchange
        mine = exchange.owner(self) == exchange.rank
        ahead = self.ahead.take(self, index, True) if self.ahead is not None else None
        data = None
        if ahead is not None and not mine:
            # Read ahead before it was known to be shared (a guess): received all the same.
            s.ahead_unused_bytes += ahead[1]
            ahead = None
        elif ahead is not None:
            s.ahead_bytes += ahead[1]
            data = ahead[0].contiguous().reshape(-1).view(torch.uint8)
        elif mine:
            s.waited_reads += 1
        raw = exchange.read_whole(self, data)
        if raw is None:
            if ahead is not None:  # read here already: used as a read alone
                self._count(ahead[1])
                self.whole = ahead[0]
                return self.whole
            return None
        if mine:
            self._count(self.nbytes)
        else:
            s.shared_bytes += self.nbytes
            s.shared_tensors += 1
            self.counted = "shared"
        _, finish = self.reads(index)
        self.whole = finish(raw)
        return self.whole

    def count_exchanged(self, got: int, exchanged: bool = True) -> None:
        """``got`` bytes read as this rank's row block of an exchange (``exchanged``: false
        where the group then did not exchange, and the read counts as a slice)."""
        if not exchanged:
            self._count(got)
            return
        s = self.stats
        s.exchanged_bytes += got
        if self.counted is None:
            s.exchanged_tensors += 1
            self.counted = "exchanged"

    def _count(self, got: int) -> None:
        if not got:
            return
        s = self.stats
        whole = got >= self.nbytes
        if whole:
            s.whole_bytes += got
            if self.counted != "whole":
                s.whole_tensors += 1
                if self.counted == "sliced":
                    s.sliced_tensors -= 1
                    s.sliced_tensor_bytes -= self.nbytes
                elif self.counted == "exchanged":
                    s.exchanged_tensors -= 1
                self.counted = "whole"
        else:
            s.sliced_bytes += got
            if self.counted is None:
                s.sliced_tensors += 1
                s.sliced_tensor_bytes += self.nbytes
                self.counted = "sliced"


def _range_item(it: Any) -> bool:
    return isinstance(it, range)


class _Empty:
    """A dim added by ``unsqueeze`` and sliced to nothing (the tensor is empty: never read)."""

    def __repr__(self) -> str:
        return "_EMPTY"


_EMPTY = _Empty()


def _size(it: Any) -> int:
    return len(it) if _range_item(it) else 0 if it is _EMPTY else 1


class LazyTensor(torch.Tensor):
    """A region of a checkpoint tensor, read when an op other than a view needs it (see the
    module's doc). ``_items``: one entry per dim of the file's tensor (an int that dropped it, or
    the ``range`` of indices kept) plus ``None`` for each dim added, in order."""

    _source: _Source
    _items: tuple[Any, ...]
    _value: torch.Tensor | None

    @staticmethod
    def __new__(cls, source: _Source, items: tuple[Any, ...]) -> LazyTensor:
        shape = [_size(it) for it in items if not isinstance(it, int)]
        cpu = torch.device("cpu")
        try:
            t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=source.dtype, device=cpu)
        except RuntimeError:
            if 0 not in shape:
                raise
            # No element, but contiguous strides past int64 ((0, 2**62, 2**62)): strides of 0.
            t = torch.Tensor._make_wrapper_subclass(
                cls, shape, strides=[0] * len(shape), dtype=source.dtype, device=cpu
            )
        t._source, t._items, t._value = source, items, None
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @property
    def tensor_name(self) -> str:
        """The checkpoint's name for the tensor this is a region of."""
        return self._source.name

    def _index(self) -> tuple[Any, ...]:
        return tuple(
            slice(it.start, it.stop, it.step) if _range_item(it) else it for it in self._items
        )

    def _full(self) -> bool:
        dims = [it for it in self._items if it is not None and it is not _EMPTY]
        return all(
            _range_item(it) and it.start == 0 and it.step == 1 and len(it) == n
            for it, n in zip(dims, self._source.shape)
        )

    def materialize(self) -> torch.Tensor:
        """The region as a plain CPU tensor (read on first call, then kept)."""
        if self._value is None and self.numel() == 0:
            self._value = _empty(torch, self.shape, self.dtype)
        if self._value is None:
            self._value = self._source.read(self._index(), self._full())
        return self._value

    # torch refuses these on tensor subclasses: on the region read, as any other use.
    def tolist(self) -> Any:
        return self.materialize().tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.materialize().numpy(force=force)

    def __repr__(self) -> str:  # type: ignore[override]  # no read for a repr
        region = "whole" if self._full() else str(self._index())
        shape = tuple(self.shape)
        return f"LazyTensor({self._source.name!r}, {region}, shape={shape}, dtype={self.dtype})"

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args else None
        if isinstance(first, LazyTensor) and first._value is None:
            view = _VIEWS.get(func)
            if view is not None:
                try:
                    return view(first, *args[1:], **kwargs)
                except _Unplanned:
                    pass  # torch's own rules (and errors) on the region read
            if func is not _aten.copy_.default:
                name = func.overloadpacket.__name__
                stats = first._source.stats
                stats.fallbacks[name] = stats.fallbacks.get(name, 0) + 1

        # A region copied into device memory (a weight loader's copy_ into a GPU parameter).
        if func is _aten.copy_.default and len(args) > 1 and isinstance(args[1], LazyTensor):
            dst = first
            if isinstance(dst, torch.Tensor) and not isinstance(dst, LazyTensor):
                if dst.device.type in STAGED_DEVICES and _staged_copy(dst, args[1].materialize()):
                    return dst

        def real(x: Any) -> Any:
            return x.materialize() if isinstance(x, LazyTensor) else x

        if not kwargs and not any(isinstance(a, (list, tuple, dict)) for a in args):
            # Flat arguments (a weight loader's copy_, most ops): no tree to walk.
            return func(*[real(a) for a in args])
        return func(*tree_map(real, args), **tree_map(real, kwargs))


# A region copied into device memory goes there through page-locked chunks of at most this
# size. torch copies pageable host memory to a GPU at a few GB/s (the driver stages it through
# its own buffers, one copy at a time): 6.8 GB/s on an H100 host, against 15 for fastload's
# page-locked loads. A chunk copied into page-locked memory (torch's copy, on its threads) is on
# its way to the device while the next one is copied in; torch's page-locked allocator reuses
# the chunks once their copies are done.
STAGE_CHUNK = 16 << 20
STAGED_DEVICES = ("cuda",)
# Whether a staged copy took page-locked memory from torch since release_staging().
_staged_pinned = False


def release_staging() -> None:
    """Gives back the page-locked chunks torch keeps cached after staged copies (an engine
    worker loads once; ``fastload._integration.released`` calls this with the rest)."""
    global _staged_pinned
    empty = getattr(torch._C, "_host_emptyCache", None)
    if _staged_pinned and empty is not None:
        empty()  # frees cached chunks only: one still in a copy is kept until it is done
    _staged_pinned = False


def _staged_copy(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """``dst.copy_(src)`` of a host region into device memory through page-locked chunks, in
    the order of ``dst``'s device's current stream (as torch's own copy); False where it does
    not apply (shapes that broadcast, rows over a chunk: the caller copies as torch does)."""
    if dst.shape != src.shape or src.dim() == 0 or src.numel() == 0 or src.device.type != "cpu":
        return False
    rows = src.shape[0]
    row_bytes = src.numel() // rows * src.element_size()
    if row_bytes > STAGE_CHUNK:
        return False
    global _staged_pinned
    pin = dst.device.type != "cpu"  # tests run this on the host, where nothing pins
    step = max(1, STAGE_CHUNK // max(1, row_bytes))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        part, into = src.narrow(0, start, n), dst.narrow(0, start, n)
        try:
            host = torch.empty(part.shape, dtype=part.dtype, pin_memory=pin)
        except RuntimeError:  # no page-locked memory to be had: as torch copies
            into.copy_(part)
            continue
        _staged_pinned |= pin
        host.copy_(part)
        into.copy_(host, non_blocking=pin)
    return True


class _Unplanned(Exception):
    """A view this module does not compose (out of range, odd arguments): read and let torch."""


def _pos(t: LazyTensor, dim: int) -> int:
    """The position in ``t._items`` of ``t``'s dim ``dim``."""
    ndim = t.dim()
    if not isinstance(dim, int) or not -ndim <= dim < ndim:
        raise _Unplanned
    dim %= ndim
    seen = -1
    for i, it in enumerate(t._items):
        if not isinstance(it, int):
            seen += 1
            if seen == dim:
                return i
    raise _Unplanned


def _with(t: LazyTensor, at: int, item: Any, drop: bool = False) -> LazyTensor:
    items = list(t._items)
    if drop:
        del items[at]
    else:
        items[at] = item
    return LazyTensor(t._source, tuple(items))


def _as_range(it: Any) -> range:
    return range(1) if it is None else range(0) if it is _EMPTY else it


def _added(it: Any) -> bool:
    return it is None or it is _EMPTY


def _slice(t: LazyTensor, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> Any:
    at = _pos(t, dim)
    if not all(v is None or isinstance(v, int) for v in (start, end)) or not (
        isinstance(step, int) and step > 0
    ):
        raise _Unplanned
    kept = _as_range(t._items[at])[start:end:step]
    if _added(t._items[at]):
        return _with(t, at, None if len(kept) else _EMPTY)
    return _with(t, at, kept)


def _select(t: LazyTensor, dim: int, index: int) -> LazyTensor:
    at = _pos(t, dim)
    if not isinstance(index, int):
        raise _Unplanned
    try:
        picked = _as_range(t._items[at])[index]
    except IndexError:
        raise _Unplanned from None
    if _added(t._items[at]):
        return _with(t, at, None, drop=True)
    return _with(t, at, picked)


def _split_sizes(t: LazyTensor, sizes: list[int], dim: int) -> list[LazyTensor]:
    out, start = [], 0
    for n in sizes:
        out.append(_slice(t, dim, start, start + n))
        start += n
    return out


def _split(t: LazyTensor, split_size: int, dim: int = 0) -> list[LazyTensor]:
    _pos(t, dim)
    n = t.size(dim)
    if not isinstance(split_size, int) or split_size <= 0 or n == 0:
        raise _Unplanned
    return _split_sizes(t, [min(split_size, n - s) for s in range(0, n, split_size)], dim)


def _split_with_sizes(t: LazyTensor, split_sizes: list[int], dim: int = 0) -> list[LazyTensor]:
    _pos(t, dim)
    if sum(split_sizes) != t.size(dim) or any(s < 0 for s in split_sizes):
        raise _Unplanned
    return _split_sizes(t, list(split_sizes), dim)


def _unbind(t: LazyTensor, dim: int = 0) -> list[LazyTensor]:
    return [_select(t, dim, i) for i in range(t.size(dim))]


def _unsqueeze(t: LazyTensor, dim: int) -> LazyTensor:
    ndim = t.dim()
    if not isinstance(dim, int) or not -ndim - 1 <= dim <= ndim:
        raise _Unplanned
    dim %= ndim + 1
    items = list(t._items)
    at = _pos(t, dim) if dim < ndim else len(items)
    items.insert(at, None)
    return LazyTensor(t._source, tuple(items))


def _squeeze_dims(t: LazyTensor, dims: Any = None) -> LazyTensor:
    ndim = t.dim()
    dims = range(ndim) if dims is None else [dims] if isinstance(dims, int) else dims
    ats = {_pos(t, d) for d in dims if ndim} if ndim else set()
    items: list[Any] = []
    for i, it in enumerate(t._items):
        if i in ats and it is None:
            continue
        if i in ats and _range_item(it) and len(it) == 1:
            items.append(it[0])
        else:
            items.append(it)
    return LazyTensor(t._source, tuple(items))


def _same(t: LazyTensor, *_: Any) -> LazyTensor:
    return LazyTensor(t._source, t._items)


def _view(t: LazyTensor, size: Any) -> LazyTensor:
    if list(size) != list(t.shape):
        raise _Unplanned
    return _same(t)


_VIEWS: dict[Any, Any] = {
    _aten.slice.Tensor: _slice,
    _aten.select.int: _select,
    _aten.split.Tensor: _split,
    _aten.split_with_sizes.default: _split_with_sizes,
    _aten.unbind.int: _unbind,
    _aten.unsqueeze.default: _unsqueeze,
    _aten.squeeze.default: _squeeze_dims,
    _aten.squeeze.dim: _squeeze_dims,
    _aten.squeeze.dims: _squeeze_dims,
    _aten.alias.default: _same,
    _aten.detach.default: _same,
    _aten.view.default: _view,
}


class Checkpoint:
    """The tensors of a checkpoint (a file, a folder, an index, a list of files: any ``uri``
    ``fastload.load`` takes) as lazy tensors, in file order. ``options``: those a native
    ``Reader`` takes (``concurrency``, ``block_size``, ``storage_options``, ``cache``,
    ``verify``, ``keyset``, ``associated_data``), and ``method``: local files are mapped (a
    region is a view of the file's pages, copied once by its consumer) unless it is ``"read"``
    (each region read into a buffer); others are ignored. ``stats`` may be shared by
    several checkpoints of one load. ``exchange``: a ``fastload._exchange.ColumnExchange`` over
    the tensor-parallel group, through which the group reads the tensors each rank keeps a column
    block of once between them (every rank of the group must load the same tensors in the same
    order). ``all_layers``: the consumer reads every layer (no pipeline stage): the read-ahead
    reads the next layer with the one the consumer is at (``fastload._readahead``)."""

    def __init__(
        self,
        uri: Any,
        stats: Stats | None = None,
        exchange: Any = None,
        *,
        read_ahead: bool | None = None,
        all_layers: bool = False,
        **options: Any,
    ) -> None:
        self._glue = _torch_glue()
        # Local files are mapped unless the load says to read them (``method="read"``).
        method = str(options.get("method") or "auto").lower()
        self.map_local = method not in ("read", "pread")
        native = {k: v for k, v in options.items() if k in READER_OPTIONS and v is not None}
        self.reader = _fastload.Reader(_uris(uri), **native)
        self.stats = stats if stats is not None else Stats()
        self.exchange = exchange
        # fastload._readahead: by default where some file is read, not mapped (remote, or
        # local with method="read" or encrypted): each region a read to wait for.
        self.read_ahead = read_ahead
        # Every layer is read (no pipeline stage leaves some unread): the next layer is read
        # ahead with the one the consumer is at, not once it reaches it.
        self.all_layers = all_layers

    @property
    def bytes_read(self) -> int:
        """Tensor bytes this checkpoint's reader read (every lazy tensor's regions)."""
        return int(self.reader.bytes_read)

    def _sources(self) -> tuple[list[_Source], bool]:
        """Every tensor's source, in file order; whether some file is read (not mapped)."""
        sources, read_any = [], False
        for shard, header in enumerate(self.reader.headers()):
            file = header["file"]
            remote = _fastload.is_remote_uri(file)
            # Whether the file maps (local, not encrypted): asked once, with an empty mapping.
            mapped = not remote and self.map_local and self.reader.map(shard, 0, 0) is not None
            read_any |= not mapped
            # What one more request costs (``Source::read_cost``); nothing for a mapping.
            cost = MAPPED_READ_COST if mapped else header["read_cost"]
            for name, dtype, shape, begin, end in header["tensors"]:
                tdtype = self._glue.DTYPES.get(dtype)
                if tdtype is None:
                    from ._errors import FormatError

                    raise FormatError(
                        self._glue.UnsupportedDtype(dtype, name).describe(file), path=file
                    )
                tshape = safe_open._torch_shape(dtype, tuple(shape))
                region = Region(
                    self.reader,
                    shard,
                    header["data_start"] + begin,
                    end - begin,
                    tdtype,
                    tshape,
                    cost,
                    name,
                    mapped,
                    (file, header.get("version"), begin, end),
                )
                sources.append(_Source(region, self.stats, self.exchange))
        return sources, read_any

    def __iter__(self) -> Iterator[tuple[str, LazyTensor]]:
        sources, read = self._sources()
        ahead = None
        if self.read_ahead or (self.read_ahead is None and read):
            ahead = _readahead.ReadAhead(sources, all_layers=self.all_layers)
        try:
            for pos, source in enumerate(sources):
                source.ahead = ahead
                if ahead is not None:
                    ahead.handed_out(pos)
                self.stats.tensors += 1
                self.stats.bytes += source.nbytes
                items = tuple(range(n) for n in source.shape)
                yield source.name, LazyTensor(source, items)
        finally:
            if ahead is not None:
                for source in sources:
                    source.ahead = None
                ahead.close()
                self.stats.ahead_unused_bytes += ahead.unused_bytes
