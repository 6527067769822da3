"""``parts=``: loads that read only a part of some tensors.

``fastload.load(uri, parts={"w": (slice(None), slice(0, 2048))})`` returns ``w[:, 0:2048]``
(bitwise what indexing the whole tensor gives) and reads from storage only the bytes that part
needs. An index is what torch's basic indexing takes, restricted to what names a box of the
tensor: ints (a dim dropped), slices of ints with steps >= 1 (bounds clamped as torch clamps
them) and one ``...``; a tuple of them, one per dim at most. Anything else is refused with
:class:`ConfigError` (``option="parts"``) before anything is read.

How: each part is planned natively (``_fastload.plan_region``, the planner of every region, see
``fastload._regions``) with no cost per read, so it needs the fewest bytes: the part's rows when
it slices the first dims, else a run per row of the dims it slices (``[:, a:b]`` needs ``b - a``
columns of every row). A step in the innermost dim it runs along reads the elements it skips
too. The runs are then grouped into reads (:func:`merge_runs`) by what a request to the file's
source costs (``Source::read_cost``): a gap between runs is read when that costs less than
another request (within 10% of the part's bytes, or beyond that when it saves most of the
requests: a column slice of narrow rows is a few reads of the rows it crosses, not a request per
row; wide rows stay a read each). The reads go to the native loader as byte ranges within
tensors (``_fastload.Stream(parts=...)``, the selection a distributed load reads its share
with), which reads them as any load does: in parallel blocks, ``concurrency`` in flight, within
``memory_limit``, from every source, to the CPU or through the staged GPU path. Each read
arrives as a piece; a part of one read is a strided view of it (copied when it selects less than
the read), a part of several is assembled as its pieces land, each run copied once (a strided
copy per piece) into the part's own tensor. ``stats()`` counts the runs (``part_runs``), the
reads (``part_reads``) and their bytes (``part_bytes``, gaps included).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from . import _fastload, _regions, _safe_open
from ._errors import ConfigError, FormatError, TensorNotFoundError

# The integer dtype each width of element is moved as.
_CARRIER_NAMES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}

# Bytes read beyond a part's own, as a share of them, that merging its runs may always spend.
WASTE = 0.1
# How much cheaper (in the cost model of `merge_runs`) spans must be than the runs within
# WASTE before a part is read as spans.
SPANS_WIN = 2.0
# The longest read that merging runs across gaps makes (the native loader's largest segment).
SPAN_MAX = 64 << 20


class _Part(NamedTuple):
    """A tensor of the load: read whole (``plan`` None) or a part of it, with what putting it
    together takes, worked out once."""

    name: str
    dtype: str  # safetensors'
    shape: tuple[int, ...]  # the file's
    plan: Any  # a _fastload.Region with runs, or None
    out_shape: tuple[int, ...]  # of the result
    runs: int  # pieces it arrives in
    tdtype: Any = None  # torch's
    carrier: Any = None  # the integer dtype of its width: its elements move as their bits
    lead: int = 0  # dims that pick the run (the rest lie within one)


class Cost(NamedTuple):
    """The cost model `merge_runs` decides with: what one more read costs, in bytes one could
    read instead (``Source::read_cost``: ``_regions.REMOTE_READ_COST``, ...), and whether reads
    beyond ``WASTE`` may be chosen when they save enough of it."""

    read: int
    spans: bool


def merge_runs(runs: Sequence[tuple[int, int]], cost: Cost) -> list[tuple[int, int]]:
    """The reads of ``runs`` (``(offset, len)``, in increasing order, disjoint): each a
    ``(first run, runs)`` group of consecutive runs, read as one range from the first's start to
    the last's end (the gaps between them read too).

    A gap is worth reading when it is smaller than a read (``cost.read``). Two choices:
    - within ``WASTE``: such gaps of at most ``WASTE`` of the run before them (so the reads add
      at most ``WASTE`` of the runs' bytes; touching runs always merge). A slice along the first
      dims, small steps, most columns of rows: ~1x the part's bytes, in as few reads as that
      allows.
    - spans (``cost.spans``): every such gap, whatever they add up to, when that costs
      ``SPANS_WIN`` times less (bytes plus ``cost.read`` per read) than the first: a column slice
      of rows narrower than a read's cost (``[:, 0:2048]`` of 8 KiB bf16 rows from an object
      store: a few reads of the rows it crosses, not 4096 of 4 KiB). Rows wider than that stay
      a read each: exactly the part's bytes.
    A read that crosses gaps is at most ``SPAN_MAX`` bytes.

    Measured (benches/tp_bench.py's llama, hidden 512, rank 0 of 2: o_proj and down_proj by
    columns, 4118 runs): over the local HTTP server a read per run took 2.9 s, spans 0.16 s
    (whole tensors 0.02 s); behind a 20 ms round trip 4.3 s and 0.11 s (whole 0.11 s); from a
    local file 0.26 s and 0.03 s.
    """
    n = len(runs)
    if n <= 1:
        return [(0, n)] if n else []
    # The runs as a region of one dim of bytes whose reads the planner groups: a run each.
    native = _fastload.merge_runs(list(runs), _settings(cost))
    return [(first, count) for first, count in native]


def _settings(cost: Cost) -> tuple[int, bool, float, float, int]:
    """The native planner's merge settings (``crate::regions::Merge``), as they are now (tests
    change them)."""
    return (cost.read, cost.spans, WASTE, SPANS_WIN, SPAN_MAX)


def _describe(index: Any) -> str:
    items = index if isinstance(index, tuple) else (index,)
    shown = []
    for it in items:
        if it is Ellipsis:
            shown.append("...")
        elif isinstance(it, slice):
            a = "" if it.start is None else str(it.start)
            b = "" if it.stop is None else str(it.stop)
            shown.append(f"{a}:{b}" + ("" if it.step is None else f":{it.step}"))
        else:
            shown.append(repr(it))
    return "[" + ", ".join(shown) + "]"


def normalize(
    name: str,
    index: Any,
    shape: tuple[int, ...],
    itemsize: int = 1,
    merge: tuple[Any, ...] | None = None,
) -> Any:
    """``index`` of a tensor of ``shape`` (elements of ``itemsize`` bytes) as a region (a
    ``_fastload.Region``: its shape, and its runs planned with no cost per read, grouped into
    reads by ``merge``, see :func:`_settings`), or :class:`ConfigError` naming the tensor and
    the problem."""
    region = _fastload.plan_region(shape, itemsize, index, 0, merge, new_axes=False)
    if region.refused is None:
        return region
    where = f"invalid option parts: tensor {name!r} of shape {list(shape)}"
    kind, at, dim = region.refused
    items = index if isinstance(index, tuple) else (index,)
    if kind == "step":
        step = items[at].step
        problem = f"step {step} in {_describe(index)}: steps must be >= 1"
    elif kind == "item":
        problem = (
            f"{items[at]!r} in {index!r} is not supported: a part is indexed with ints, "
            "slices of ints (steps >= 1) and one ..."
        )
    elif kind == "ellipses":
        problem = f"{_describe(index)} has more than one ..."
    elif kind == "too_many":
        problem = f"{_describe(index)} indexes {at} dims, the tensor has {len(shape)}"
    else:
        assert dim is not None  # "out_of_range" names the dim
        problem = (
            f"index {items[at]} in {_describe(index)} is out of range for dim {dim} "
            f"of size {shape[dim]}"
        )
    raise ConfigError(f"{where}: {problem}", option="parts")


def wanted_names(
    table: Mapping[str, Any],
    parts: Any,
    names: Iterable[str] | str | None,
    where: str,
    uri_hint: str,
) -> list[str]:
    """The tensors a load with ``parts`` gives (``names``, else every tensor of ``table``, keyed
    by name, in its order), once ``parts`` is checked: a mapping whose keys are names in the
    checkpoint (``where``) and in ``names``."""
    if not isinstance(parts, Mapping):
        raise ConfigError(
            "invalid option parts: expected a mapping of tensor names to indices, got "
            f"{type(parts).__name__}",
            option="parts",
        )
    bad = [k for k in parts if not isinstance(k, str)]
    if bad:
        raise ConfigError(
            f"invalid option parts: keys must be tensor names (str), got {bad[0]!r}",
            option="parts",
        )
    if names is None:
        wanted = list(table)
    else:
        wanted = list(dict.fromkeys([names] if isinstance(names, str) else names))
        outside = sorted(set(parts) - set(wanted))
        if outside:
            raise ConfigError(
                "invalid option parts: tensors not in names: "
                + ", ".join(repr(n) for n in outside),
                option="parts",
            )
    missing = sorted({n for n in [*wanted, *parts] if n not in table})
    if missing:
        raise TensorNotFoundError(
            f"tensors not found in {where}: " + ", ".join(repr(n) for n in missing),
            names=missing,
            uri=uri_hint,
        )
    return wanted


class Parts:
    """The plan of a load with ``parts``: the native byte ranges, and how each tensor is put
    together from the pieces they arrive in."""

    def __init__(
        self,
        headers: Sequence[Mapping[str, Any]],
        parts: Any,
        names: Iterable[str] | str | None,
        uri_hint: str,
    ) -> None:
        from . import _torch_glue

        glue = _torch_glue()
        torch = glue.torch
        table: dict[str, tuple[str, tuple[int, ...], str, int]] = {}
        costs: dict[str, int] = {}
        for h in headers:
            costs[h["file"]] = h["read_cost"]
            for tname, dtype, shape, begin, end in h["tensors"]:
                table.setdefault(tname, (dtype, tuple(shape), h["file"], end - begin))
        where = uri_hint if len(headers) <= 1 else f"{uri_hint} and {len(headers) - 1} more files"
        wanted = wanted_names(table, parts, names, where, uri_hint)
        self._torch = torch
        self._from_bytes = glue.from_bytes
        # `(name, begin, end)`, or `(name, region)`: the region's reads (expanded natively).
        self.ranges: list[Any] = []
        self.empty: list[tuple[str, Any]] = []  # results of no bytes, handed out first
        self._parts: dict[str, _Part] = {}
        self._lock = threading.Lock()
        self._buffers: dict[str, Any] = {}  # part of several runs -> the tensor they land in
        self._left: dict[str, int] = {}  # part of several runs -> its runs not landed yet
        self.counts = _regions.ReadStats()
        for tname in wanted:
            dtype, shape, file, size = table[tname]
            self.counts.tensors += 1
            self.counts.bytes += size
            if tname in parts:
                cost = _cost(costs[file])
                self._plan_part(tname, dtype, shape, file, parts[tname], glue, cost)
            else:
                self._whole(tname, dtype, shape, size)

    def _whole(self, name: str, dtype: str, shape: tuple[int, ...], size: int) -> None:
        self.counts.whole_tensors += 1
        self.counts.whole_bytes += size
        self._parts[name] = _Part(name, dtype, shape, None, shape, 1)
        if size == 0:
            empty = self._torch.empty(0, dtype=self._torch.uint8)
            self.empty.append((name, self._from_bytes(dtype, shape, empty, name)))
        else:
            self.ranges.append((name, 0, size))

    def _plan_part(
        self,
        name: str,
        dtype: str,
        shape: tuple[int, ...],
        file: str,
        index: Any,
        glue: Any,
        cost: Cost,
    ) -> None:
        torch = self._torch
        tdtype = glue.DTYPES.get(dtype)
        if tdtype is None:
            raise FormatError(glue.UnsupportedDtype(dtype, name).describe(file), path=file)
        tshape = _safe_open.safe_open._torch_shape(dtype, shape)
        itemsize = tdtype.itemsize
        region = normalize(name, index, tshape, itemsize, _settings(cost))
        out_shape = tuple(region.shape)
        self.counts.sliced_tensors += 1
        self.counts.sliced_tensor_bytes += math.prod(tshape) * itemsize
        if region.empty:
            self._parts[name] = _Part(name, dtype, shape, None, out_shape, 0)
            self.empty.append((name, _safe_open.empty(torch, out_shape, tdtype)))
            return
        carrier = _regions.carrier(torch, itemsize)
        self.ranges.append((name, region))
        self.counts.sliced_bytes += region.read_bytes
        self.counts.sliced_runs += region.run_count
        self.counts.sliced_reads += region.read_count
        self._parts[name] = _Part(
            name, dtype, shape, region, out_shape, region.read_count, tdtype, carrier, region.lead
        )

    def take(self, name: str, begin: int | None, raw: Any) -> Any:
        """The tensor ``name`` once this piece (``raw``, flat uint8 bytes ``begin..`` of it)
        completes it, else ``None``."""
        p = self._parts[name]
        plan = p.plan
        if plan is None:
            return self._from_bytes(p.dtype, p.shape, raw, name)
        size, stride, carrier = plan.size, plan.stride, p.carrier
        inner, inner_stride = size[p.lead :], stride[p.lead :]
        # Where the piece's runs go, as strips of runs evenly apart, `(first run, runs,
        # elements from one run to the next, first run's element in the piece)`.
        strips = plan.strips_at(begin or 0)
        elements = raw.view(carrier)

        def strip(count: int, step: int, at: int) -> Any:
            # `count` runs `step` elements apart, the first at element `at` of the piece.
            return elements[at:].as_strided((count, *inner), (step, *inner_stride))

        if p.runs == 1 and len(strips) == 1:
            _, count, step, at = strips[0]
            out = strip(count, step, at)
            if not (out.is_contiguous() and out.numel() == elements.numel()):
                out = out.clone(memory_format=self._torch.contiguous_format)
            return out.view(p.tdtype).reshape(p.out_shape)
        # Several reads, or runs of several strides: the first `lead` dims pick the run, the rest
        # lie within it. Threads that share the stream may bring pieces of one part at once:
        # each copies its own runs, the buffer and the count are taken and updated under the
        # lock.
        with self._lock:
            buffer = self._buffers.get(name)
            if buffer is None:
                buffer = self._torch.empty(size, dtype=carrier, device=raw.device)
                self._buffers[name] = buffer
        rows = buffer.view(-1, *inner)
        for j, count, step, at in strips:
            rows[j : j + count].copy_(strip(count, step, at))
        with self._lock:
            left = self._left.get(name, p.runs) - 1
            if left:
                self._left[name] = left
                return None
            del self._buffers[name]
            self._left.pop(name, None)
        return buffer.view(p.tdtype).reshape(p.out_shape)

    def stats(self) -> dict[str, int]:
        """What the plan reads as parts and as whole tensors (:attr:`counts`, spelled as
        ``Stream.stats()`` spells them)."""
        return self.counts.part_counts()


def _cost(file_cost: int) -> Cost:
    """The cost model of the reads of a file's parts (see :func:`merge_runs`), by what one more
    request to its source costs (``Source::read_cost``)."""
    return Cost(file_cost, spans=True)
