"""Regions of a tensor: what reading ``tensor[index]`` of a checkpoint tensor takes, for every
reader that reads less than a whole tensor (``safe_open(...).get_slice(name)[index]``, the
engines' lazy tensors, transformers' tensor-parallel slices, ``parts=`` loads).

The planning is native (``_fastload.plan_region``, ``src/regions.rs``): the index normalised as
torch's basic indexing takes it (ints, slices with positive steps, ``...``, ``None``), by
Python's ``range`` arithmetic, which clamps bounds as torch does without its overflows near
2**63; the runs of bytes to read, chosen by what one more request costs the file's source
(``Source::read_cost``: a file, an object store, a mapping); and, for ``parts=``, the runs
grouped into reads. Plans are kept per distinct region (a model's layers repeat theirs).

:class:`Region` is one tensor of an opened file whose regions are read: the one type
``SafeSlice``, the lazy tensors and transformers' slices are views over. :class:`RegionSource`
is what the exchange (``_exchange``) and the read-ahead (``_readahead``) ask of one.
:class:`ReadStats` is what any of them read: the one shape of their statistics.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, Union

from . import _fastload

if TYPE_CHECKING:
    import torch

# What one more request costs, in bytes one could read instead (``Source::read_cost``): a
# file's pread, an object store's round trip, a mapping (no request: one span).
LOCAL_READ_COST: int = _fastload.LOCAL_READ_COST
REMOTE_READ_COST: int = _fastload.REMOTE_READ_COST
MAPPED_READ_COST: int = _fastload.MAPPED_READ_COST

# The integer dtype each width of element is moved as (torch.uint8, ...), set on first use:
# strided views and copies of plain integers of the same width move every dtype (fp8, fp4,
# bool) as its bits.
_CARRIERS: dict[int, Any] = {}


def carrier(torch: Any, itemsize: int) -> Any:
    """The integer dtype whose elements are ``itemsize`` bytes."""
    if not _CARRIERS:
        _CARRIERS.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    return _CARRIERS[itemsize]


# Byte ranges of a tensor to read, ``(offset, len)`` from its start: a list, or a planned
# region's runs (``_fastload.Region``: turned into a list only by the read that needs them).
Runs = Union[list[tuple[int, int]], _fastload.Region]


def file_ranges(runs: Runs, at: int) -> list[tuple[int, int]]:
    """``runs`` as ranges of the file, the tensor's bytes starting at ``at``."""
    if isinstance(runs, _fastload.Region):
        return runs.ranges_at(at)
    return [(at + o, n) for o, n in runs]


def runs_bytes(runs: Runs) -> int:
    """The bytes ``runs`` hold."""
    if isinstance(runs, _fastload.Region):
        return runs.bytes
    return sum(n for _, n in runs)


class Plan(NamedTuple):
    """How a region is read: ``ranges`` (``(offset, len)`` in bytes from the tensor's start)
    land one after the other in a buffer that ``size`` and ``stride`` (in elements) view as the
    selected box; indexing that with ``view`` drops int dims and adds ``None`` ones."""

    ranges: list[tuple[int, int]]
    size: tuple[int, ...]
    stride: tuple[int, ...]
    view: tuple[Any, ...]


def plan(
    shape: Sequence[int], itemsize: int, index: Any, read_cost: int = LOCAL_READ_COST
) -> Plan | None:
    """The byte ranges of a C-contiguous tensor of ``shape`` that ``tensor[index]`` needs, and
    how to view them, with ``read_cost`` per request; ``None`` for an index that is not a region
    (torch indexes the whole tensor) or selects nothing."""
    r = _fastload.plan_region(tuple(shape), itemsize, index, read_cost)
    if r.refused is not None or r.empty:
        return None
    view = r.view
    box = tuple(slice(None) for _ in r.size) if view is None else view
    return Plan(r.runs, r.size, r.stride, box)


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


def _out_of_range(torch: Any, tshape: tuple[int, ...], index: Any, at: int, dim: int) -> None:
    """Raises torch's IndexError for the int at ``at`` of ``index``, out of range for ``dim``."""
    # torch's message, from a tensor of no storage (strides of 0 overflow nothing).
    meta = torch.empty_strided(tshape, (0,) * len(tshape), dtype=torch.uint8, device="meta")
    try:
        meta[index]
    except RuntimeError:  # its overflow at another entry: the error is this int's
        pass
    it = (index if isinstance(index, tuple) else (index,))[at]
    raise IndexError(f"index {it} is out of bounds for dimension {dim} with size {tshape[dim]}")


def index_reads(
    torch: Any,
    tdtype: torch.dtype,
    tshape: tuple[int, ...],
    nbytes: int,
    index: Any,
    read_cost: int,
    compact: bool = True,
) -> tuple[Runs, Callable[[Any], torch.Tensor]]:
    """How to read ``tensor[index]`` of a C-contiguous tensor of ``tshape`` and ``tdtype``
    (``nbytes`` long) on the host: the ``(offset, len)`` ranges from the tensor's start to read
    (:data:`Runs`; none for an empty region; an index that is not a region reads the whole
    tensor and lets torch index it), and what makes the region of their bytes, one after the
    other as a uint8 tensor (``None`` where there are no ranges). An int out of range raises
    torch's IndexError here, before anything is read. ``compact``: a result that is a strided
    view of more than it selects is copied out (``False``: returned as the view, for bytes read
    without a copy, a mapping)."""
    r = _fastload.plan_region(tshape, tdtype.itemsize, index, read_cost)
    refused = r.refused
    if refused is not None:
        kind, at, dim = refused
        if kind == "out_of_range" and dim is not None:
            _out_of_range(torch, tshape, index, at, dim)
        # Lists, tensors, booleans, negative steps: torch indexes the whole tensor.
        return [(0, nbytes)], lambda raw: raw.view(tdtype).reshape(tshape)[index]
    if r.empty:
        want = torch.Size(r.shape)
        return [], lambda _: empty(torch, want, tdtype)
    size, stride, view = r.size, r.stride, r.view
    ints = carrier(torch, tdtype.itemsize)

    def finish(got: Any) -> torch.Tensor:
        raw = got.view(ints)
        out = raw.as_strided(size, stride)
        if view is not None:
            out = out[view]
        if compact and not (out.is_contiguous() and out.numel() == raw.numel()):
            out = out.clone(memory_format=torch.contiguous_format)
        return out.view(tdtype)

    return r, finish


class RegionSource(Protocol):
    """A tensor whose regions are read, as the exchange (``_exchange.ColumnExchange``) asks of
    it: :class:`Region` and what extends it (the lazy tensors' sources, transformers' slices'
    tensors), each with ``count_exchanged``."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    shard: int  # its file's place among the checkpoint's
    cost: int  # what one more request to its file costs (``Source::read_cost``)
    mapped: bool  # its file is mapped (never exchanged nor shared)
    # The file (its URI, the version opened) and the data offsets in it: what the ranks of an
    # exchange compare before they exchange the tensor's bytes.
    place: tuple[str, str | None, int, int]

    def raw(self, runs: Runs) -> torch.Tensor:
        """The bytes of ``runs`` (from the tensor's start), one after the other, as uint8."""
        ...

    def count_exchanged(self, got: int, exchanged: bool = True) -> None:
        """``got`` bytes read as this rank's row block of an exchange (``exchanged``: false
        where the group then did not exchange, and the read counts as a slice)."""
        ...


class AheadSource(RegionSource, Protocol):
    """A tensor the read-ahead (``_readahead.ReadAhead``) reads regions of before its consumer
    asks: the lazy tensors' sources (``_lazy._Source``)."""

    key: Any  # ``_readahead.key`` of it: regions read of one tensor guess the next's
    position: int  # its place among the tensors handed out
    exchange: Any  # the group's ``_exchange.ColumnExchange``, or None

    @property
    def done(self) -> bool:
        """Whether it was read already."""
        ...

    def start(self, index: Any) -> Later:
        """``tensor[index]`` read, started now."""
        ...

    def start_raw(self, runs: Runs, finish: Any = None) -> Later:
        """The bytes of ``runs``, read, started now."""
        ...

    def region_bytes(self, index: Any) -> int:
        """The bytes reading ``tensor[index]`` reads."""
        ...


class Region:
    """One tensor of a file opened by a native ``Reader`` (file ``shard``, its bytes at file
    offset ``at``, ``nbytes`` long) whose regions are read: planned by the file's
    ``read_cost``, read through the reader (or mapped, where ``mapped``)."""

    __slots__ = (
        "at",
        "cost",
        "dtype",
        "mapped",
        "name",
        "nbytes",
        "place",
        "reader",
        "shape",
        "shard",
    )

    def __init__(
        self,
        reader: Any,
        shard: int,
        at: int,
        nbytes: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        cost: int,
        name: str,
        mapped: bool = False,
        place: tuple[str, str | None, int, int] = ("", None, 0, 0),
    ) -> None:
        self.reader, self.shard, self.at, self.nbytes = reader, shard, at, nbytes
        self.dtype, self.shape, self.cost, self.name = dtype, shape, cost, name
        # The file is mapped, not read (``Reader.map``: local, not encrypted): a region is a
        # view of the file's pages, no request to a store (``cost``: MAPPED_READ_COST).
        self.mapped = mapped
        self.place = place

    def reads(self, index: Any, compact: bool = True) -> tuple[Runs, Any]:
        """:func:`index_reads` of this tensor."""
        import torch

        return index_reads(torch, self.dtype, self.shape, self.nbytes, index, self.cost, compact)

    def fetch(self, index: Any) -> tuple[torch.Tensor, int]:
        """``tensor[index]`` read (from any thread), and the bytes that took. Mapped: one span,
        the region a strided view of it, copied once by the consumer (pages outside the region
        but inside the span are faulted in: counted as read)."""
        runs, finish = self.reads(index, not self.mapped)
        out = finish(self.raw(runs) if runs else None)
        return out, runs_bytes(runs)

    def start(self, index: Any) -> Later:
        """``fetch(index)`` started now, in flight while the caller goes on (read-ahead):
        ``result()`` gives ``(tensor, bytes)``. A mapped file's region is mapped at once."""
        if self.mapped:
            return Later(None, out=self.fetch(index))
        runs, finish = self.reads(index)
        return self.start_raw(runs, finish)

    def start_raw(self, runs: Runs, finish: Any = None) -> Later:
        """``raw(runs)`` started now (``finish``: made of the bytes once in; ``result()``
        gives ``(it, bytes)``)."""
        nbytes = runs_bytes(runs)
        pending = None
        if runs:
            pending = self.reader.read_later(self.shard, file_ranges(runs, self.at))
        return Later(pending, finish, nbytes)

    def region_bytes(self, index: Any) -> int:
        """The bytes ``fetch(index)`` reads."""
        r = _fastload.plan_region(self.shape, self.dtype.itemsize, index, self.cost)
        return self.nbytes if r.refused is not None else 0 if r.empty else int(r.bytes)

    def raw(self, runs: Runs) -> torch.Tensor:
        """The bytes of ``runs`` (``(offset, len)`` from the tensor's start), one after the
        other, as a uint8 tensor; not counted."""
        import torch

        ranges = file_ranges(runs, self.at)
        if len(ranges) == 1 and self.mapped:
            ((o, n),) = ranges
            capsule = self.reader.map(self.shard, o, n)
            if capsule is not None:
                return torch.from_dlpack(capsule)
        capsule = self.reader.read(self.shard, ranges)
        return torch.from_dlpack(capsule)


class Later:
    """A read in flight (``Reader.read_later``): ``result()`` waits for it once and gives
    ``(finish(its bytes as a uint8 tensor), bytes read)`` (no ``finish``: the bytes), then and
    after; its error, if it failed, every time. ``pending`` None: nothing to wait for (``out``
    is the result, or ``finish`` gets None)."""

    __slots__ = ("_error", "_finish", "_nbytes", "_out", "_pending")

    def __init__(self, pending: Any, finish: Any = None, nbytes: int = 0, out: Any = None) -> None:
        self._pending, self._finish, self._nbytes = pending, finish, nbytes
        self._out: tuple[Any, int] | None = out
        self._error: Exception | None = None

    def result(self) -> tuple[Any, int]:
        if self._out is None and self._error is None:
            try:
                import torch

                # A Ctrl-C while waiting leaves it pending: a later result() is an error then
                # (the read can be waited for once), never another's bytes.
                pending = self._pending
                raw = None if pending is None else torch.from_dlpack(pending.wait())
                self._out = (raw if self._finish is None else self._finish(raw), self._nbytes)
                self._pending = None
            except Exception as e:
                self._error = e
        if self._error is not None:
            raise self._error
        assert self._out is not None
        return self._out


@dataclass
class ReadStats:
    """What a load that reads regions of tensors read: the engines' lazy tensors
    (``_lazy.Stats``), a ``parts=`` load (``Parts.stats()``) and transformers' tensor-parallel
    slices (``model._fastload_stats``) all count into one. A tensor counts as ``whole`` when a
    read of it covered all its bytes, ``exchanged`` when this rank read a block of its rows for
    the group and got its columns from the others (``fastload._exchange``), else ``sliced``
    (a part: ``sliced_tensor_bytes`` are the whole sizes of those tensors, ``sliced_runs`` and
    ``sliced_reads`` the runs of bytes and the reads a ``parts=`` plan made of them);
    ``skipped`` were never read; ``shared`` were read whole by another rank of the group, which
    sent them (``distributed`` sliced reads: not read here). ``fallbacks``: ops other than views
    and ``copy_`` that read a region, by name (a weight loader that does more than narrow and
    copy)."""

    tensors: int = 0
    bytes: int = 0
    sliced_tensors: int = 0
    sliced_bytes: int = 0
    sliced_tensor_bytes: int = 0
    sliced_runs: int = 0
    sliced_reads: int = 0
    whole_tensors: int = 0
    whole_bytes: int = 0
    exchanged_tensors: int = 0
    exchanged_bytes: int = 0
    # Read whole by another rank of the group and broadcast to this one (not read here).
    shared_tensors: int = 0
    shared_bytes: int = 0
    fallbacks: dict[str, int] = field(default_factory=dict)
    # Read ahead (fastload._readahead): bytes used (counted as sliced or whole too), and bytes
    # read for a region the consumer then did not read (counted in read_bytes only).
    ahead_bytes: int = 0
    ahead_unused_bytes: int = 0
    # Reads the consumer waited for (not read ahead): each at least one round trip to storage.
    waited_reads: int = 0

    @property
    def read_bytes(self) -> int:
        return self.sliced_bytes + self.whole_bytes + self.exchanged_bytes + self.ahead_unused_bytes

    @property
    def skipped_tensors(self) -> int:
        read = self.sliced_tensors + self.whole_tensors + self.exchanged_tensors
        return self.tensors - read - self.shared_tensors

    def as_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "bytes": self.bytes,
            "read_bytes": self.read_bytes,
            "sliced_tensors": self.sliced_tensors,
            "sliced_bytes": self.sliced_bytes,
            "sliced_tensor_bytes": self.sliced_tensor_bytes,
            "sliced_runs": self.sliced_runs,
            "sliced_reads": self.sliced_reads,
            "whole_tensors": self.whole_tensors,
            "whole_bytes": self.whole_bytes,
            "exchanged_tensors": self.exchanged_tensors,
            "exchanged_bytes": self.exchanged_bytes,
            "shared_tensors": self.shared_tensors,
            "shared_bytes": self.shared_bytes,
            "skipped_tensors": self.skipped_tensors,
            "fallbacks": dict(self.fallbacks),
            "ahead_bytes": self.ahead_bytes,
            "ahead_unused_bytes": self.ahead_unused_bytes,
            "waited_reads": self.waited_reads,
        }

    def part_counts(self) -> dict[str, int]:
        """The counts in the spelling of ``Stream.stats()`` and transformers'
        ``model._fastload_stats`` (parts as ``part_*``); ``exchanged_*`` only where a tensor
        was exchanged (a ``parts=`` load never exchanges)."""
        out = {
            "part_tensors": self.sliced_tensors,
            "part_bytes": self.sliced_bytes,
            "part_tensor_bytes": self.sliced_tensor_bytes,
            "part_runs": self.sliced_runs,
            "part_reads": self.sliced_reads,
            "whole_tensors": self.whole_tensors,
            "whole_bytes": self.whole_bytes,
        }
        if self.exchanged_tensors:
            out["exchanged_tensors"] = self.exchanged_tensors
            out["exchanged_bytes"] = self.exchanged_bytes
        return out

    def line(self) -> str:
        """One line for a log: what was read, of how much, and how."""
        share = self.read_bytes / self.bytes if self.bytes else 0.0
        out = (
            f"read {self.read_bytes} of {self.bytes} checkpoint bytes ({share:.0%}): "
            f"{self.sliced_bytes} bytes as slices of {self.sliced_tensors} tensors, "
            f"{self.whole_bytes} bytes as {self.whole_tensors} whole tensors, "
        )
        if self.exchanged_tensors:
            out += (
                f"{self.exchanged_bytes} bytes as row blocks of {self.exchanged_tensors} "
                "tensors exchanged over the group, "
            )
        if self.shared_tensors:
            out += (
                f"{self.shared_bytes} bytes of {self.shared_tensors} whole tensors read by "
                "another rank and received, "
            )
        out += f"{self.skipped_tensors} tensors not read"
        if self.fallbacks:
            ops = ", ".join(f"{k} x{v}" for k, v in sorted(self.fallbacks.items()))
            out += f"; read for other ops: {ops}"
        return out
