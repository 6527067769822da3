"""``parts=``: loads that read only a part of some tensors.

``fastload.load(uri, parts={"w": (slice(None), slice(0, 2048))})`` returns ``w[:, 0:2048]``
(bitwise what indexing the whole tensor gives) and reads from storage only the bytes that part
needs. An index is what torch's basic indexing takes, restricted to what names a box of the
tensor: ints (a dim dropped), slices of ints with steps >= 1 (bounds clamped as torch clamps
them) and one ``...``; a tuple of them, one per dim at most. Anything else is refused with
:class:`ConfigError` (``option="parts"``) before anything is read.

How: each part is planned by :func:`fastload._safe_open.plan` with no cost per read, so it needs
the fewest bytes (the same planner ``safe_open(...).get_slice(name)[index]`` uses): the part's
rows when it slices the first dims, else a run per row of the dims it slices (``[:, a:b]``
needs ``b - a`` columns of every row). A step in the innermost dim it runs along reads the
elements it skips too. :func:`merge_runs` then groups the runs into reads by the source's cost
model (:func:`_cost`): a gap between runs is read when that costs less than another request
(within 10% of the part's bytes, or beyond that when it saves most of the requests: a column slice
of narrow rows is a few reads of the rows it crosses, not a request per row; wide rows stay a
read each). The reads go to the native loader as byte ranges within tensors
(``_fastload.Stream(parts=...)``, the selection a distributed load reads its share with), which
reads them as any load does: in parallel blocks, ``concurrency`` in flight, within
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

from . import _fastload, _safe_open
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
    plan: _safe_open.Plan | None
    out_shape: tuple[int, ...]  # of the result
    runs: int  # pieces it arrives in
    tdtype: Any = None  # torch's
    carrier: Any = None  # the integer dtype of its width: its elements move as their bits
    lead: int = 0  # dims that pick the run (the rest lie within one)
    # Each piece (by its first byte in the tensor): where its runs go, as strips of runs evenly
    # apart, `(first run, runs, elements from one run to the next, first run's element in the
    # piece)`.
    strips: Mapping[int, list[tuple[int, int, int, int]]] | None = None


class Cost(NamedTuple):
    """The cost model `merge_runs` decides with: what one more read costs, in bytes one could
    read instead (``_safe_open.REMOTE_READ_COST``, ``LOCAL_READ_COST``), and whether reads
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
    gaps = [runs[i + 1][0] - runs[i][0] - runs[i][1] for i in range(n - 1)]
    small = [i for i, g in enumerate(gaps) if g == 0 or g < cost.read]
    merged = {i for i in small if gaps[i] <= WASTE * runs[i][1]}
    if cost.spans and len(small) > len(merged):
        need = sum(length for _, length in runs)
        within = need + sum(gaps[i] for i in merged) + (n - len(merged)) * cost.read
        spans = need + sum(gaps[i] for i in small) + (n - len(small)) * cost.read
        if spans * SPANS_WIN <= within:
            merged = set(small)
    groups: list[tuple[int, int]] = []
    first = 0
    for i in range(n - 1):
        end = runs[i + 1][0] + runs[i + 1][1]
        if i not in merged or (gaps[i] and end - runs[first][0] > SPAN_MAX):
            groups.append((first, i + 1 - first))
            first = i + 1
    groups.append((first, n - first))
    return groups


def _strips(
    runs: Sequence[tuple[int, int]], first: int, count: int, itemsize: int
) -> list[tuple[int, int, int, int]]:
    """Runs ``first .. first + count`` of one read as strips of runs evenly apart (see
    ``_Part.strips``): one strip for the rows of a 2-d slice, one per outer index else."""
    base = runs[first][0]
    out: list[tuple[int, int, int, int]] = []
    j, end = first, first + count
    while j < end:
        k, step = j + 1, 0  # k: the strip's end
        if k < end:
            step = runs[k][0] - runs[j][0]
            while k + 1 < end and runs[k + 1][0] - runs[k][0] == step:
                k += 1
            k += 1
        out.append((j, k - j, step // itemsize, (runs[j][0] - base) // itemsize))
        j = k
    return out


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


def normalize(name: str, index: Any, shape: tuple[int, ...]) -> tuple[Any, ...]:
    """``index`` with one entry per dim (ints made non-negative, ``...`` expanded, missing
    trailing dims ``slice(None)``), or :class:`ConfigError` naming the tensor and the problem."""
    where = f"invalid option parts: tensor {name!r} of shape {list(shape)}"
    items = index if isinstance(index, tuple) else (index,)
    for it in items:
        ok = it is Ellipsis or (isinstance(it, int) and not isinstance(it, bool))
        if isinstance(it, slice):
            bounds = (it.start, it.stop, it.step)
            ok = all(v is None or (isinstance(v, int) and not isinstance(v, bool)) for v in bounds)
            if ok and it.step is not None and it.step < 1:
                raise ConfigError(
                    f"{where}: step {it.step} in {_describe(index)}: steps must be >= 1",
                    option="parts",
                )
        if not ok:
            raise ConfigError(
                f"{where}: {it!r} in {index!r} is not supported: a part is indexed with ints, "
                "slices of ints (steps >= 1) and one ...",
                option="parts",
            )
    ellipses = sum(1 for it in items if it is Ellipsis)
    if ellipses > 1:
        raise ConfigError(f"{where}: {_describe(index)} has more than one ...", option="parts")
    used = len(items) - ellipses
    if used > len(shape):
        raise ConfigError(
            f"{where}: {_describe(index)} indexes {used} dims, the tensor has {len(shape)}",
            option="parts",
        )
    fill = (slice(None),) * (len(shape) - used)
    if ellipses:
        at = items.index(Ellipsis)
        items = (*items[:at], *fill, *items[at + 1 :])
    else:
        items = (*items, *fill)
    out: list[Any] = []
    for dim, (it, n) in enumerate(zip(items, shape)):
        if isinstance(it, int):
            if not -n <= it < n:
                raise ConfigError(
                    f"{where}: index {it} in {_describe(index)} is out of range for dim {dim} "
                    f"of size {n}",
                    option="parts",
                )
            it = it + n if it < 0 else it
        out.append(it)
    return tuple(out)


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
        for h in headers:
            for tname, dtype, shape, begin, end in h["tensors"]:
                table.setdefault(tname, (dtype, tuple(shape), h["file"], end - begin))
        where = uri_hint if len(headers) <= 1 else f"{uri_hint} and {len(headers) - 1} more files"
        wanted = wanted_names(table, parts, names, where, uri_hint)
        self._torch = torch
        self._from_bytes = glue.from_bytes
        self.ranges: list[tuple[str, int, int]] = []
        self.empty: list[tuple[str, Any]] = []  # results of no bytes, handed out first
        self._parts: dict[str, _Part] = {}
        self._lock = threading.Lock()
        self._buffers: dict[str, Any] = {}  # part of several runs -> the tensor they land in
        self._left: dict[str, int] = {}  # part of several runs -> its runs not landed yet
        self.part_tensors = self.part_bytes = self.part_full_bytes = 0
        self.part_runs = self.part_reads = 0
        self.whole_tensors = self.whole_bytes = 0
        for tname in wanted:
            dtype, shape, file, size = table[tname]
            if tname in parts:
                cost = _cost(file)
                self._plan_part(tname, dtype, shape, file, parts[tname], glue, cost)
            else:
                self._whole(tname, dtype, shape, size)

    def _whole(self, name: str, dtype: str, shape: tuple[int, ...], size: int) -> None:
        self.whole_tensors += 1
        self.whole_bytes += size
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
        basic = normalize(name, index, tshape)
        out_shape = tuple(
            len(range(*it.indices(n))) for it, n in zip(basic, tshape) if isinstance(it, slice)
        )
        self.part_tensors += 1
        self.part_full_bytes += math.prod(tshape) * tdtype.itemsize
        planned = _planned(tshape, tdtype.itemsize, basic, cost)
        if planned is None:
            self._parts[name] = _Part(name, dtype, shape, None, out_shape, 0)
            self.empty.append((name, _safe_open.empty(torch, out_shape, tdtype)))
            return
        plan, reads, strips, lead = planned
        carrier = getattr(torch, _CARRIER_NAMES[tdtype.itemsize])
        self.ranges.extend((name, begin, end) for begin, end in reads)
        self.part_bytes += sum(end - begin for begin, end in reads)
        self.part_runs += len(plan.ranges)
        self.part_reads += len(strips)
        self._parts[name] = _Part(
            name, dtype, shape, plan, out_shape, len(strips), tdtype, carrier, lead, strips
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
        assert p.strips is not None
        strips = p.strips[begin or 0]
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
        """What the plan reads as parts and as whole tensors."""
        return {
            "part_tensors": self.part_tensors,
            "part_bytes": self.part_bytes,
            "part_tensor_bytes": self.part_full_bytes,
            "part_runs": self.part_runs,
            "part_reads": self.part_reads,
            "whole_tensors": self.whole_tensors,
            "whole_bytes": self.whole_bytes,
        }


# Parts planned (see _planned), by shape, element size, index and cost model: the layers of a
# model repeat their shapes and a rank's indices, so a load plans a few dozen distinct parts
# (Llama-3-8B at TP 2: 262,306 runs in 0.4-0.5 s planned one by one, each layer again).
_PLANNED: dict[Any, Any] = {}
_PLANNED_MAX = 1024


def _planned(tshape: tuple[int, ...], itemsize: int, basic: tuple[Any, ...], cost: Cost) -> Any:
    """A part's plan (``_safe_open.plan`` with no cost per read), its reads (``(begin, end)``
    within the tensor, by :func:`merge_runs`), the strips of each read (by its begin) and its
    lead dims; ``None`` for a part of no bytes. Worked out once per distinct part, and shared
    (read only) by the tensors that have it."""

    def make() -> Any:
        plan = _safe_open.plan(tshape, itemsize, basic, read_cost=0)
        if plan is None:
            return None
        runs = plan.ranges
        reads: list[tuple[int, int]] = []
        strips: dict[int, list[tuple[int, int, int, int]]] = {}
        for first, count in merge_runs(runs, cost):
            begin = runs[first][0]
            end = runs[first + count - 1][0] + runs[first + count - 1][1]
            strips[begin] = _strips(runs, first, count, itemsize)
            reads.append((begin, end))
        return plan, reads, strips, _lead_dims(plan.size, len(runs))

    # merge_runs' settings as they are now are part of the key (tests change them).
    key = (tuple(tshape), itemsize, _safe_open.index_key(basic), cost, (WASTE, SPANS_WIN, SPAN_MAX))
    return _safe_open.remembered(_PLANNED, _PLANNED_MAX, key, make)


def _cost(file: str) -> Cost:
    """The cost model of the reads of ``file``'s parts (see :func:`merge_runs`)."""
    if _fastload.is_remote_uri(file) or file.startswith("hf://"):
        return Cost(_safe_open.REMOTE_READ_COST, spans=True)
    return Cost(_safe_open.LOCAL_READ_COST, spans=True)


def _lead_dims(size: tuple[int, ...], runs: int) -> int:
    """How many leading dims of ``size`` the runs walk: the planner's run dim (the product of the
    sizes before it is the number of runs; the smallest such prefix, as size-1 dims change
    nothing)."""
    product = 1
    for d, n in enumerate(size):
        if product == runs:
            return d
        product *= n
    return len(size)
