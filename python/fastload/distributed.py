"""One checkpoint onto every rank of a torch.distributed group, each byte read from storage once.

>>> tensors = fastload.load("s3://bucket/model/", process_group=pg)   # or fastload.distributed.load

Every rank runs the same steps and computes the same plan from the same headers:

1. Headers. Each rank reads the headers (``_fastload.checkpoint_tensors``: small, no tensor data,
   checked as a local load checks them; from the load's peers where they hold the files); the
   group agrees on them with one ``all_gather_object`` of (error, header digest, wanted names,
   memory limit). An error on any rank (missing file, bad header, unknown tensor name) is raised
   on every rank as the same exception, before any data moves.
2. Split (``_fastload.plan_ranks``, planned in Rust: ``src/ranks.rs``). The tensors that any rank
   wants are laid end to end in file order; their total is cut into ``world_size`` contiguous
   ranges of equal bytes (a tensor is split where two ranges meet), and each range into chunks of
   at most a quarter of the smallest ``memory_limit`` of the group. Rank r reads only its range,
   through the native loader's byte-range selection (``parts``): the group reads every wanted byte
   once.
3. Exchange, in rounds. In round k every rank waits for its own chunk k, the group agrees that
   nobody failed (one 4-byte ``all_reduce``; an error raised during the read is then shared as in
   step 1), and each chunk goes point to point (``batch_isend_irecv``) to the ranks that want a
   tensor in it, and only those bytes. Pieces of ``DIRECT_BYTES`` or more travel as their own
   message straight into the receiver's tensor; smaller ones travel packed, one message per pair
   and round, and are viewed (whole tensors) or copied (pieces) out of it. The native loader keeps
   reading ahead (within ``memory_limit``) while a round is on the wire.

``parts`` (per rank, like ``names``): a rank's parts are left out of what it wants from the group
and read by the rank alone once the group's rounds are over (a local load with ``parts``);
checked in step 1 (names and indices), so a bad part raises on every rank.

Why point to point and not broadcast: with ``names`` different per rank a broadcast needs a
subgroup per set of receivers (``new_group`` is itself collective and costly to create), while
isend/irecv route each byte only where it is wanted. When every rank wants everything, each rank
sends and receives (W-1)/W of the checkpoint: the same volume as a ring all-gather.

Backends: gloo moves host tensors; NCCL moves tensors on the rank's current CUDA device (pieces
are copied there first). A group with both (``"cpu:gloo,cuda:nccl"``) uses NCCL for CUDA
destinations and gloo otherwise.

All ranks must consume a distributed stream to its end (``load`` does): each ``next()`` can take
part in a collective, so a rank that stops early leaves the others waiting until the group's
timeout.

No reference to the group outlives a stream that failed, was closed or was dropped, even while
the caller keeps the error raised or the closed stream, and none waits for the garbage collector:
``destroy_process_group()`` then ends the group's threads (a gloo group left alive into
interpreter exit can abort the process, "terminate called without an active exception").
"""

from __future__ import annotations

import hashlib
import json
import pickle
import threading
import time
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from . import Stream, _fastload, _options, _torch
from ._errors import ConfigError, FastloadError, StreamClosedError
from ._options import Options

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["DistributedStream", "last_stats", "load", "stream"]

# Pieces at least this big travel as their own message, received in place; smaller ones are packed.
DIRECT_BYTES = 256 << 10
# Packed pieces start on this boundary, so that views of them are aligned for any dtype.
ALIGN = 64

_last_stats: dict[str, Any] | None = None


def last_stats() -> dict[str, Any] | None:
    """Counters of this process's last distributed load (or its fallback), once it ended.

    ``bytes_read`` is the tensor data this rank read from storage; summed over the group it equals
    ``total_bytes``, the bytes of the tensors any rank asked for. Also ``rank``, ``world_size``,
    ``bytes_sent``, ``bytes_received``, ``rounds``, ``tensors`` and ``seconds``.
    """
    return None if _last_stats is None else dict(_last_stats)


# ---------------------------------------------------------------------------------------------
# Messages


def _pack(pieces: list[tuple[int, int, int]]) -> tuple[list[tuple[Any, int]], int, list[Any]]:
    """One pair's messages for a round: packed small pieces (with their offsets), packed length,
    and the pieces sent on their own. Sender and receiver compute the same."""
    packed, direct, off = [], [], 0
    for p in pieces:
        n = p[2] - p[1]
        if n >= DIRECT_BYTES:
            direct.append(p)
        else:
            packed.append((p, off))
            off = -(-(off + n) // ALIGN) * ALIGN
    return packed, off, direct


# ---------------------------------------------------------------------------------------------
# Agreement and errors


def _portable(exc: BaseException | None) -> BaseException | None:
    """The exception itself when it survives pickling (fastload's errors do), else a stand-in."""
    if exc is None:
        return None
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:
        return FastloadError(f"{type(exc).__name__}: {exc}")


def _raise_first(errors: list[Any], rank: int, own: BaseException | None) -> None:
    """Raises the lowest rank's error on every rank (the original object on that rank). This
    frame, kept by the error's traceback, is left holding no error: no reference cycle."""
    for r, err in enumerate(errors):
        if err is not None:
            if r == rank and own is not None:
                err = own
            if hasattr(err, "add_note"):
                err.add_note(
                    f"(raised on rank {r} of {len(errors)}; fastload raised it on every rank)"
                )
            try:
                raise err
            finally:
                del err, errors, own


def _gather(obj: Any, group: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out


def _comm_device(group: Any, device: torch.device) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and (device.type == "cuda" or "gloo" not in backend):
        if device.type == "cuda" and device.index is not None:
            return device
        return torch.device("cuda", torch.cuda.current_device())
    if "gloo" in backend or device.type == "cpu":
        return torch.device("cpu")
    return device


def _finish(u8: torch.Tensor, dtype: str, shape: tuple[int, ...], hint: str) -> torch.Tensor:
    """The bytes as the file's dtype and shape, exactly as a local load returns them."""
    target = _torch.DTYPES.get(dtype)
    if target is not None and u8.storage_offset() % target.itemsize:
        # A view of a larger dtype needs an aligned storage offset; from_dlpack rebases to 0.
        # (Not hit by this module's own buffers, whose pieces start 64-byte aligned.)
        u8 = torch.from_dlpack(u8)
    return _torch.from_bytes(dtype, shape, u8, hint)


# ---------------------------------------------------------------------------------------------
# The stream


def _shared_names(
    table: list[tuple[str, str, tuple[int, ...], int]], names: Any, parts: Any, hint: str
) -> list[str]:
    """What a rank with ``parts`` gets through the group: the tensors it wants (``names``, else
    every tensor) but those it takes a part of, which it reads itself. ``parts`` is checked as a
    load with parts checks it (names in the checkpoint and in ``names``, indices that fit), here
    in step 1, so that a bad one is raised on every rank before anything is read."""
    from . import _parts
    from ._safe_open import safe_open

    by_name = {t[0]: t for t in table}
    wanted = _parts.wanted_names(by_name, parts, names, hint, hint)
    for name, index in parts.items():
        _, dtype, shape, _ = by_name[name]
        _parts.normalize(name, index, safe_open._torch_shape(dtype, tuple(shape)))
    return [n for n in wanted if n not in parts]


class _OwnParts:
    """A rank's own parts in a load shared by a group: read by this rank alone (a local load
    with ``parts``), once the group's tensors are delivered, so that the group's collectives
    are over and ``memory_limit`` bounds one load at a time."""

    def __init__(self, uri: Any, options: Mapping[str, Any]) -> None:
        self._uri, self._options = uri, options
        self.stream: Stream | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        options = {**self._options, "names": list(self._options["parts"])}
        self.stream = Stream(self._uri, **options)
        yield from self.stream

    def stats(self) -> dict[str, Any]:
        return {} if self.stream is None else self.stream.stats()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


class DistributedStream:
    """Iterator of ``(name, tensor)`` on one rank of a group; see :func:`stream`."""

    @_options.spelled_out
    def __init__(self, uri: Any, *, group: Any, **options: Unpack[Options]) -> None:
        _options.check("DistributedStream", options)
        self._started = time.monotonic()
        self._native: Any = None
        self._iter: Iterator[tuple[str, torch.Tensor]] = iter(())
        self._arrived: dict[tuple[str, int], torch.Tensor] = {}
        self._next_lock = threading.Lock()
        self._closed = self._ended = False
        # Held by the stream only (dropped by close()): an error raised here keeps this frame.
        self._group = group
        del group
        try:
            self._start(uri, options)
        except BaseException:
            self.close()
            raise

    def _start(self, uri: Any, options: Mapping[str, Any]) -> None:
        self._rank = dist.get_rank(self._group)
        self._world = dist.get_world_size(self._group)
        if self._rank < 0:
            raise ConfigError(
                "invalid option process_group: this process is not in the group",
                option="process_group",
            )
        self._hint = str(uri)
        self._sent = self._received = self._delivered = 0
        self._own: _OwnParts | None = None
        native = _options.native(options)

        # Step 1: headers, agreed by the group.
        error: BaseException | None = None
        table: list = []
        names = digest = limit = None
        try:
            self._device = torch.device(options.get("device", "cpu"))
            self._comm = _comm_device(self._group, self._device)
            self._comm_is_host = self._comm.type == "cpu"
            self._move = self._device != self._comm
            uris = _uris(uri)
            resolved = _fastload.resolve_options(uris, **native)
            names, limit = resolved.names, resolved.memory_limit
            table = _fastload.checkpoint_tensors(
                uris,
                names=names,
                storage_options=native.get("storage_options"),
                keyset=native.get("keyset"),
                associated_data=native.get("associated_data"),
                peers=native.get("peers"),
                peer_token=native.get("peer_token"),
            )
            digest = hashlib.sha256(json.dumps(table).encode()).hexdigest()
            if options.get("parts"):
                # This rank's parts: read by itself after the group's tensors (see _OwnParts).
                names = _shared_names(table, names, options["parts"], self._hint)
                self._own = _OwnParts(uri, {k: v for k, v in options.items() if k != "names"})
        except Exception as e:
            error = e
        views = _gather((_portable(error), digest, names, limit), self._group, self._world)
        errors = [v[0] for v in views]
        if any(e is not None for e in errors):
            # The raised error keeps this frame: it holds neither that error nor the group.
            del views
            try:
                _raise_first(errors, self._rank, error)
            finally:
                del errors, error
        if len({v[1] for v in views}) != 1:
            raise ConfigError(
                "invalid option uri: the ranks of the group see different checkpoints "
                "(tensor names, dtypes, shapes or sizes differ)",
                option="uri",
            )
        self._plan = _fastload.plan_ranks(table, [v[2] for v in views], [v[3] for v in views])
        self._read_own_bytes(uris, native)

    def _read_own_bytes(self, uris: Any, native: dict[str, Any]) -> None:
        """Step 2 (the group agreed on the plan): this rank's bytes, read by the native loader.
        An error starting it waits for the first round, where the group agrees on errors."""
        plan = self._plan
        self._error: BaseException | None = None
        parts = plan.parts(self._rank)
        # Over NCCL the pieces are wanted on the device: read them through the GPU path (a
        # page-locked ring and async copies) instead of into host memory and then across.
        self._staged = self._comm.type == "cuda"
        if parts:
            native.pop("names", None)
            try:
                self._native = _fastload.Stream(
                    uris,
                    **native,
                    parts=parts,
                    target=f"cuda:{self._comm.index}" if self._staged else None,
                    allocate=_torch.allocator(self._comm) if self._staged else None,
                )
            except Exception as e:
                self._error = e
        self._whole: dict[int, torch.Tensor] = {}  # tensor index -> all its bytes, as one view
        self._dest: dict[int, torch.Tensor] = {}  # tensor index -> buffer its pieces land in
        self._left = list(plan.counts)
        # The generator sees the stream through a weak proxy: the stream holds it, not the
        # reverse, so a stream dropped half-way is freed at once, and the group with it.
        self._iter = DistributedStream._run(weakref.proxy(self))

    # -- iteration

    def __iter__(self) -> DistributedStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        # Threads of one rank may share the stream as they share a Stream: each tensor goes to
        # exactly one of them. The lock also keeps the group's collectives in one order.
        try:
            with self._next_lock:
                if self._closed and not self._ended:
                    raise StreamClosedError(f"{self._hint}: the stream was closed before its end")
                return next(self._iter)
        finally:
            if self._closed:  # by this step (a failure) or meanwhile by another thread
                self._let_go()

    def _run(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream's steps; ``self`` is a weak proxy of it (see ``_read_own_bytes``)."""
        plan = self._plan
        for i, t in enumerate(plan.tensors):
            if t[3] == 0 and plan.wants(self._rank, i):
                yield self._emit(i, torch.empty(0, dtype=torch.uint8, device=self._comm))
        for k in range(max(plan.rounds, 1)):
            mine: dict[Any, torch.Tensor] = {}
            error, self._error = self._error, None
            if error is None and k < plan.rounds:
                try:
                    mine = self._take(plan.pieces[self._rank][k])
                except Exception as e:
                    error = e
            try:
                self._agree(error)
            finally:
                del error  # raised, it would keep itself alive through this frame
            if k < plan.rounds:
                yield from DistributedStream._round(self, k, mine)  # not a method bound to self
        if self._own is not None:
            yield from self._own
        self._ended = True
        self._finish_stats()

    def _take(self, pieces: Sequence[tuple[int, int, int]]) -> dict[Any, torch.Tensor]:
        """This rank's pieces of one chunk, waiting for the native loader as needed."""
        out = {}
        for p in pieces:
            key = (self._plan.tensors[p[0]][0], p[1])
            while key not in self._arrived:
                try:
                    batch = next(self._native)
                except StopIteration:
                    raise FastloadError(
                        f"{self._hint}: the loader ended before piece {key} arrived"
                    ) from None
                for item in batch:
                    # Staged: the data is already a uint8 tensor on the device; else a capsule.
                    data = item.data if self._staged else torch.from_dlpack(item.data)
                    self._arrived[(item.name, item.begin)] = data
            piece = self._arrived.pop(key)
            out[p] = piece if self._comm_is_host or self._staged else piece.to(self._comm)
        return out

    def _agree(self, error: BaseException | None) -> None:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self._comm)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group)
        if int(flag.item()):
            self.close()
            errors = _gather(_portable(error), self._group, self._world)
            self._finish_stats()
            # The raised error keeps this frame: it is left holding no error.
            try:
                _raise_first(errors, self._rank, error)
            finally:
                del errors, error

    def _peer(self, r: int) -> int:
        return r if self._group is None else dist.get_global_rank(self._group, r)

    def _round(self, k: int, mine: dict[Any, torch.Tensor]) -> Iterator[tuple[str, torch.Tensor]]:
        plan, me = self._plan, self._rank
        ops: list[Any] = []
        packs: dict[tuple, torch.Tensor] = {}
        inbox: list[tuple[list, torch.Tensor]] = []
        in_place: list[tuple[int, int, int]] = []
        for d in range(self._world):
            if d == me:
                continue
            wanted = [p for p in plan.pieces[me][k] if plan.wants(d, p[0])]
            packed, size, direct = _pack(wanted)
            if packed:
                key = tuple(p for p, _ in packed)
                buf = packs.get(key)
                if buf is None:
                    buf = torch.empty(size, dtype=torch.uint8, device=self._comm)
                    for p, off in packed:
                        buf[off : off + p[2] - p[1]].copy_(mine[p])
                    packs[key] = buf
                ops.append(dist.P2POp(dist.isend, buf, self._peer(d), self._group, 0))
                self._sent += sum(p[2] - p[1] for p, _ in packed)
            for tag, p in enumerate(direct, 1):
                ops.append(dist.P2POp(dist.isend, mine[p], self._peer(d), self._group, tag))
                self._sent += p[2] - p[1]
        for s in range(self._world):
            if s == me:
                continue
            wanted = [p for p in plan.pieces[s][k] if plan.wants(me, p[0])]
            packed, size, direct = _pack(wanted)
            if packed:
                buf = torch.empty(size, dtype=torch.uint8, device=self._comm)
                ops.append(dist.P2POp(dist.irecv, buf, self._peer(s), self._group, 0))
                inbox.append((packed, buf))
                self._received += sum(p[2] - p[1] for p, _ in packed)
            for tag, p in enumerate(direct, 1):
                dst = self._buffer(p[0])[p[1] : p[2]]
                ops.append(dist.P2POp(dist.irecv, dst, self._peer(s), self._group, tag))
                in_place.append(p)
                self._received += p[2] - p[1]
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        done: list[int] = []
        for p, piece in mine.items():
            if plan.wants(me, p[0]):
                self._land(p, piece, done)
        for packed, buf in inbox:
            for p, off in packed:
                self._land(p, buf[off : off + p[2] - p[1]], done)
        for p in in_place:
            self._land(p, None, done)
        for i in sorted(done):
            u8 = self._whole.pop(i, None)
            yield self._emit(i, u8 if u8 is not None else self._dest.pop(i))

    def _buffer(self, i: int) -> torch.Tensor:
        buf = self._dest.get(i)
        if buf is None:
            buf = torch.empty(self._plan.tensors[i][3], dtype=torch.uint8, device=self._comm)
            self._dest[i] = buf
        return buf

    def _land(self, p: tuple[int, int, int], data: torch.Tensor | None, done: list[int]) -> None:
        """Piece `p` is here: `data` (a view to keep or copy), or None when received in place."""
        i, lo, hi = p
        if data is not None:
            if hi - lo == self._plan.tensors[i][3]:
                self._whole[i] = data
            else:
                self._buffer(i)[lo:hi].copy_(data)
        self._left[i] -= 1
        if self._left[i] == 0:
            done.append(i)

    def _emit(self, i: int, u8: torch.Tensor) -> tuple[str, torch.Tensor]:
        name, dtype, shape, _ = self._plan.tensors[i]
        tensor = _finish(u8, dtype, shape, self._hint)
        if self._move:
            tensor = tensor.to(self._device)
        self._delivered += 1
        return name, tensor

    # -- stats and closing

    def stats(self) -> dict[str, Any]:
        """This rank's counters; ``bytes_read`` summed over the group is ``total_bytes``."""
        native = None if self._native is None else self._native.stats()
        own = {} if self._own is None else self._own.stats()
        out = {
            "rank": self._rank,
            "world_size": self._world,
            "total_bytes": self._plan.total,
            "bytes_planned": self._plan.ranges[self._rank][1] - self._plan.ranges[self._rank][0],
            "bytes_read": (0 if native is None else native.bytes_read) + own.get("bytes_read", 0),
            "bytes_sent": self._sent,
            "bytes_received": self._received,
            "rounds": self._plan.rounds,
            "tensors": self._delivered + own.get("tensors_delivered", 0),
            "seconds": time.monotonic() - self._started,
        }
        # A rank's own parts (read by itself): what its load with parts counts of them.
        out.update((k, v) for k, v in own.items() if k.startswith("part_"))
        return out

    def _finish_stats(self) -> None:
        global _last_stats
        if getattr(self, "_plan", None) is not None:
            _last_stats = self.stats()

    def close(self) -> None:
        """Stops this rank's reads. Call it on every rank: the others wait for this one's bytes.
        The stream then holds no reference to the group; a later ``next()`` raises
        :class:`StreamClosedError` unless the stream had ended."""
        self._closed = True
        if self._native is not None:
            self._finish_stats()
            self._native.close()
        if self._own is not None:
            self._own.close()
        self._arrived.clear()
        self._let_go()

    def _let_go(self) -> None:
        """Drops the group and the steps (which hold it), unless a ``next()`` is under way: that
        one does as it returns. A closed stream, kept by the caller or by an error's traceback,
        keeps no group alive past ``destroy_process_group()``."""
        if not self._next_lock.acquire(blocking=False):
            return
        try:
            self._group = None
            steps, self._iter = self._iter, iter(())
            if hasattr(steps, "close"):
                steps.close()  # a generator's frame cleared (GeneratorExit at its yield)
        finally:
            self._next_lock.release()

    def __enter__(self) -> DistributedStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---------------------------------------------------------------------------------------------
# Entry points


def _uris(uri: Any) -> list[str]:
    from . import _uris as uris

    return uris(uri)


def _resolve_group(process_group: Any) -> Any:
    """The group to use, or None for an independent load (with a warning when none exists)."""
    if isinstance(process_group, str) and process_group != "default":
        raise ConfigError(
            f"invalid option process_group: {process_group!r} (use a torch.distributed group, "
            "'default' or None)",
            option="process_group",
        )
    group_type = getattr(dist, "ProcessGroup", ())  # absent from builds without distributed
    if not (process_group is None or isinstance(process_group, (str, group_type))):
        raise ConfigError(
            f"invalid option process_group: {process_group!r} is a "
            f"{type(process_group).__name__} (use a torch.distributed group, 'default' or None)",
            option="process_group",
        )
    if process_group is None or isinstance(process_group, str):
        if not (dist.is_available() and dist.is_initialized()):
            warnings.warn(
                "fastload: torch.distributed is not initialised; every process reads the whole "
                "checkpoint from storage on its own",
                RuntimeWarning,
                stacklevel=4,
            )
            return None
        process_group = dist.group.WORLD
    if dist.get_world_size(process_group) == 1:
        return None
    return process_group


class _Independent(Stream):
    """The fallback: a local stream whose counters read like a distributed one's."""

    def __init__(self, uri: Any, **options: Unpack[Options]) -> None:
        self._t0 = time.monotonic()
        super().__init__(uri, **options)

    def __next__(self) -> tuple[str, torch.Tensor]:
        try:
            return super().__next__()
        except StopIteration:
            self._record()
            raise

    def stats(self) -> dict[str, Any]:
        s = super().stats()
        total = s.get("total_bytes", 0)
        s.update(
            rank=0,
            world_size=1,
            bytes_planned=total,
            bytes_sent=0,
            bytes_received=0,
            rounds=0,
            tensors=s.get("tensors_delivered", 0),
            seconds=time.monotonic() - self._t0,
        )
        return s

    def _record(self) -> None:
        global _last_stats
        stats = self.stats()
        if "total_bytes" in stats:  # not yet closed
            _last_stats = stats

    def close(self) -> None:
        self._record()
        super().close()


@_options.spelled_out
def stream(
    uri: Any, *, process_group: Any = None, **options: Unpack[Options]
) -> DistributedStream | Stream:
    """Like :func:`fastload.stream`, with the reads shared by the ranks of ``process_group``.

    ``process_group``: a ``torch.distributed`` group, or None (or ``"default"``) for the default
    group; with no group initialised, or a group of one, every process loads on its own (with a
    ``RuntimeWarning`` when no group is initialised). Every rank of the group must call this with
    the same checkpoint (same tensors; paths may differ per node) and consume the stream to its
    end. ``names`` may differ per rank: each rank gets only its tensors, and bytes travel only to
    the ranks that want them. So may ``parts``: each rank reads its own parts itself, once the
    group's tensors are delivered, and never sends them. Options are per rank (``memory_limit``
    bounds this rank's reads).
    """
    _options.check("stream", options)
    group = _resolve_group(process_group)
    if group is None:
        return _Independent(uri, **options)
    try:
        return DistributedStream(uri, group=group, **options)
    finally:
        del group  # an error raised keeps this frame


@_options.spelled_out
def load(
    uri: Any, *, process_group: Any = None, **options: Unpack[Options]
) -> dict[str, torch.Tensor]:
    """Like :func:`fastload.load`, with the reads shared by the ranks of ``process_group``;
    see :func:`stream`. :func:`last_stats` then holds this rank's counters."""
    _options.check("load", options)
    with stream(uri, process_group=process_group, **options) as s:
        return dict(s)
