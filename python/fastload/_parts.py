"""``parts=``: loads that read only a part of some tensors.

``fastload.load(uri, parts={"w": (slice(None), slice(0, 2048))})`` returns ``w[:, 0:2048]``
(bitwise what indexing the whole tensor gives) and reads from storage only the bytes that part
needs. An index is what torch's basic indexing takes, restricted to what names a box of the
tensor: ints (a dim dropped), slices of ints with steps >= 1 (bounds clamped as torch clamps
them) and one ``...``; a tuple of them, one per dim at most. Anything else is refused with
:class:`ConfigError` (``option="parts"``) before anything is read.

How: each part is planned by :func:`fastload._safe_open.plan` with no cost per read, so it reads
the fewest bytes (the same planner ``safe_open(...).get_slice(name)[index]`` uses, there with a
cost per request): the part's rows when it slices the first dims, else a run per row of the dims
it slices (``[:, a:b]`` reads ``b - a`` columns of every row, one read each where the rows are
apart). A step in the innermost dim it runs along reads the elements it skips too. The runs go to
the native loader as byte ranges within tensors (``_fastload.Stream(parts=...)``, the selection a
distributed load reads its share with), which reads them as any load does: in parallel blocks,
within ``memory_limit``, from every source, to the CPU or through the staged GPU path. Each run
arrives as a piece; a part of one run is a view of it (copied when it selects less than the run),
a part of several is assembled as its pieces land, each copied once into the part's own tensor.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from . import _safe_open
from ._errors import ConfigError, FormatError, TensorNotFoundError

# The integer dtype each width of element is moved as.
_CARRIER_NAMES = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


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
        table: dict[str, tuple[str, tuple[int, ...], str, int]] = {}
        for h in headers:
            for tname, dtype, shape, begin, end in h["tensors"]:
                table.setdefault(tname, (dtype, tuple(shape), h["file"], end - begin))
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
            where = (
                uri_hint if len(headers) <= 1 else f"{uri_hint} and {len(headers) - 1} more files"
            )
            raise TensorNotFoundError(
                f"tensors not found in {where}: " + ", ".join(repr(n) for n in missing),
                names=missing,
                uri=uri_hint,
            )
        self._torch = torch
        self._from_bytes = glue.from_bytes
        self.ranges: list[tuple[str, int, int]] = []
        self.empty: list[tuple[str, Any]] = []  # results of no bytes, handed out first
        self._parts: dict[str, _Part] = {}
        self._offsets: dict[str, dict[int, int]] = {}
        self._lock = threading.Lock()
        self._buffers: dict[str, Any] = {}  # part of several runs -> the tensor they land in
        self._left: dict[str, int] = {}  # part of several runs -> its runs not landed yet
        self.part_tensors = self.part_bytes = self.part_full_bytes = 0
        self.whole_tensors = self.whole_bytes = 0
        for tname in wanted:
            dtype, shape, file, size = table[tname]
            if tname in parts:
                self._plan_part(tname, dtype, shape, file, parts[tname], glue)
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
        self, name: str, dtype: str, shape: tuple[int, ...], file: str, index: Any, glue: Any
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
        plan = _safe_open.plan(tshape, tdtype.itemsize, basic, read_cost=0)
        self.part_tensors += 1
        self.part_full_bytes += math.prod(tshape) * tdtype.itemsize
        if plan is None:
            self._parts[name] = _Part(name, dtype, shape, None, out_shape, 0)
            self.empty.append((name, torch.empty(out_shape, dtype=tdtype)))
            return
        carrier = getattr(torch, _CARRIER_NAMES[tdtype.itemsize])
        lead = _lead_dims(plan.size, len(plan.ranges))
        self._parts[name] = _Part(
            name, dtype, shape, plan, out_shape, len(plan.ranges), tdtype, carrier, lead
        )
        self._offsets[name] = {begin: i for i, (begin, _len) in enumerate(plan.ranges)}
        for begin, length in plan.ranges:
            self.ranges.append((name, begin, begin + length))
            self.part_bytes += length

    def take(self, name: str, begin: int | None, raw: Any) -> Any:
        """The tensor ``name`` once this piece (``raw``, flat uint8 bytes ``begin..`` of it)
        completes it, else ``None``."""
        p = self._parts[name]
        plan = p.plan
        if plan is None:
            return self._from_bytes(p.dtype, p.shape, raw, name)
        size, stride, carrier = plan.size, plan.stride, p.carrier
        if p.runs == 1:
            out = raw.view(carrier).as_strided(size, stride)
            if not (out.is_contiguous() and out.numel() * carrier.itemsize == raw.numel()):
                out = out.clone(memory_format=self._torch.contiguous_format)
            return out.view(p.tdtype).reshape(p.out_shape)
        # Several runs: the first `lead` dims pick the run, the rest lie within it. Threads that
        # share the stream may bring pieces of one part at once: each copies its own run, the
        # buffer and the count are taken and updated under the lock.
        lead = p.lead
        with self._lock:
            buffer = self._buffers.get(name)
            if buffer is None:
                buffer = self._torch.empty(size, dtype=carrier, device=raw.device)
                self._buffers[name] = buffer
        j = self._offsets[name][begin or 0]
        inner = raw.view(carrier).as_strided(size[lead:], stride[lead:])
        buffer.view(-1, *size[lead:])[j].copy_(inner)
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
            "whole_tensors": self.whole_tensors,
            "whole_bytes": self.whole_bytes,
        }


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
