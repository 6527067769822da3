"""Row-parallel weights read once over a tensor-parallel group.

A row-parallel weight (``o_proj``, ``down_proj``: split on its input dim, dim 1) is a row-major
``(R, C)`` matrix of which tensor-parallel rank ``r`` of ``T`` keeps the column block
``[:, r*C/T : (r+1)*C/T]``: one short run per row, which a planner that pays per request reads
as the span of the rows, nearly the whole tensor, on every rank. Through a
:class:`ColumnExchange` the group reads such a tensor once between them: rank ``r`` reads the
contiguous block of rows ``[r*R//T, (r+1)*R//T)`` (full width, one range), and one
``all_to_all`` hands each rank its own columns of every row block, so no rank receives columns it
does not keep.

Every rank of the group must take part in each exchange, in the same order. Two rules make that
safe with engine code this module does not control:

- Whether a region is exchanged is a pure function of the tensor and the narrow call (a 2-D
  tensor, all its rows, the column block of this rank's index, ``C`` divisible by ``T``, a
  planner that would read more than the block, a name that ``skip`` lets through, a file that
  is not mapped), so ranks that run the same weight loaders on the same checkpoint decide alike.
  A mapped local file is not exchanged: its pages are in the host's page cache, shared by the
  ranks, and each rank copies its columns out of them faster than the group could exchange.
- Before the data moves, the ranks compare what each is about to exchange and whether its own
  read succeeded, with one small ``all_gather``: the tensor's name; what its file holds under
  that name (dtype, shape, the file's place among the checkpoint's and the tensor's data offsets
  in it); and, among ranks that read the same URI, the version each opened (``Source::version``:
  the ETag, version id and Last-Modified every read of an object is pinned to, a Hub file's
  digest, a local file's size and modification time). A rank at another tensor, or done, or
  failed, turns the exchange off on every rank at once, for the rest of the load: each rank
  reads its columns itself, as without the exchange, and the error of a failed read is raised
  where it happened. Ranks at the same tensor whose files differ in any of the rest (two
  checkpoints, or two versions of one, that name a tensor alike) do not exchange that tensor:
  each reads its own, so that a rank's values are always its own file's, and the exchange goes
  on with the next. :meth:`ColumnExchange.close` (once the load is over, or failed) takes part
  as "done", so a rank still waiting for a partner is answered.

With ``share`` (the engines' ``distributed: true`` with sliced reads) the group also reads each
replicated tensor once: a tensor a rank reads whole (norms, KV heads every rank keeps, a weight
loader that converts the whole tensor) is read by one rank of the group (chosen by its name, so
the reads spread over the ranks) and broadcast to the others, after the same check. Only tensors
read whole are shared, so no rank receives bytes it does not keep; slices are each rank's own.
A mapped local file is not shared either: its pages are in the host's page cache already.
"""

from __future__ import annotations

import hashlib
import logging
import zlib
from collections.abc import Callable
from typing import Any

import torch

from ._regions import RegionSource, plan

__all__ = ["ColumnExchange"]

logger = logging.getLogger(__name__)

# The first entry of what a rank announces: a tensor it is about to exchange, one it is about to
# share (read whole by one rank), or the load's end.
_TENSOR, _DONE, _SHARE = 1, 0, 2
# What a rank announces, by position: the kind and the tensor's name (the ranks are in step when
# these are equal), what its file holds, the file's URI and version, and whether its read went well.
_KIND, _NAME, _HELD, _URI, _VERSION, _OK = range(6)


def _digest(*parts: object) -> int:
    """A 64-bit hash of ``parts`` (str, int, tuples of them), the same in every process."""
    h = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "little", signed=True)


class ColumnExchange:
    """Exchanges of column blocks over ``group`` (a torch.distributed group of ``world`` ranks
    whose tensors live on the host: gloo), this process being ``rank`` of it. ``skip(name)``:
    tensors never exchanged (experts, where ranks load different ones). ``share``: tensors read
    whole are read by one rank and broadcast (see the module's doc). ``received_bytes``: what
    other ranks sent this one in exchanges (a shared tensor counts in the load's stats)."""

    def __init__(
        self,
        group: Any,
        rank: int,
        world: int,
        skip: Callable[[str], bool] | None = None,
        share: bool = False,
    ) -> None:
        self.group, self.rank, self.world = group, rank, world
        self.skip = skip
        self.share = share
        self.enabled = world > 1
        self.exchanges = 0
        self.received_bytes = 0
        # Tensors the ranks named alike but whose files differ (each rank read its own).
        self.differed = 0

    def wants(self, source: RegionSource, index: tuple[Any, ...]) -> bool:
        """Whether ``source[index]`` is this rank's column block of a tensor the group reads
        once; the same answer on every rank of the group (see the module's doc)."""
        shape = source.shape
        if not self.enabled or len(shape) != 2 or len(index) != 2:
            return False
        if source.mapped:
            # A mapped local file: each rank copies its columns straight out of the pages
            # (which the ranks of a host share in its page cache), no request to save.
            return False
        rows, cols = shape
        width = cols // self.world
        if width == 0 or cols % self.world or rows == 0:
            return False
        if index[0] != slice(0, rows, 1):
            return False
        if index[1] != slice(self.rank * width, (self.rank + 1) * width, 1):
            return False
        if self.skip is not None and self.skip(source.name):
            return False
        # Rank 0's block stands for every rank's: the choice must not depend on the rank.
        first = plan(shape, source.dtype.itemsize, (slice(None), slice(0, width)), source.cost)
        assert first is not None
        return sum(n for _, n in first.ranges) > rows * width * source.dtype.itemsize

    def shares(self, source: RegionSource) -> bool:
        """Whether ``source`` read whole is read by one rank of the group and broadcast; the
        same answer on every rank (a pure function of the tensor)."""
        if not (self.enabled and self.share) or source.nbytes == 0:
            return False
        if source.mapped:
            return False  # a mapped local file's pages are the host's, shared already
        return self.skip is None or not self.skip(source.name)

    def owner(self, source: RegionSource) -> int:
        """The rank of the group that reads ``source`` when it is shared."""
        return zlib.crc32(source.name.encode()) % self.world

    def read_whole(
        self, source: RegionSource, data: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``source`` whole (its bytes, as a flat uint8 tensor) through the group: read by its
        owner (``data``: its bytes, read already, ahead), broadcast to every other rank; None
        where the ranks disagree (the caller reads it itself). The owner's failed read is raised
        there once the others know."""
        if not self.shares(source):
            return None
        owner = self.owner(source)
        error: BaseException | None = None
        if self.rank == owner and data is None:
            try:
                data = source.raw([(0, source.nbytes)])
            except Exception as e:  # raised below, once the others know
                error = e
        agreed = self._agree(self._announce(_SHARE, source, ok=error is None))
        if not agreed:
            if error is not None:
                raise error
            return None
        import torch.distributed as dist

        if self.rank == owner:
            assert data is not None
            out = data.contiguous()
        else:
            out = torch.empty(source.nbytes, dtype=torch.uint8)
        src = owner if self.group is None else dist.get_global_rank(self.group, owner)
        dist.broadcast(out, src=src, group=self.group)
        return out

    def _bounds(self, source: RegionSource) -> list[int]:
        """The first row of each rank's block, and the number of rows."""
        rows = source.shape[0]
        return [rows * i // self.world for i in range(self.world + 1)]

    def block(self, source: RegionSource) -> tuple[int, int] | None:
        """The byte range ``(offset, len)`` from the tensor's start of the rows this rank reads
        for the group (``None``: no rows), so that it can be read ahead."""
        bounds = self._bounds(source)
        mine = bounds[self.rank + 1] - bounds[self.rank]
        if not mine:
            return None
        row_bytes = source.shape[1] * source.dtype.itemsize
        return bounds[self.rank] * row_bytes, mine * row_bytes

    def read(
        self, source: RegionSource, index: tuple[Any, ...], block: torch.Tensor | None = None
    ) -> torch.Tensor | None:
        """``source[index]`` through an exchange, or None where this region is not exchanged
        (or the ranks disagree): the caller reads it itself. ``block``: this rank's rows
        (``block(source)``), read already (ahead)."""
        if not self.wants(source, index):
            return None
        rows, cols = source.shape
        size = source.dtype.itemsize
        bounds = self._bounds(source)
        mine = bounds[self.rank + 1] - bounds[self.rank]
        row_bytes = cols * size
        error: BaseException | None = None
        if mine and block is None:
            try:
                block = source.raw([(bounds[self.rank] * row_bytes, mine * row_bytes)])
            except Exception as e:  # raised below, once the others know
                error = e
        elif not mine:
            block = None
        agreed = self._agree(self._announce(_TENSOR, source, ok=error is None))
        if block is not None:
            source.count_exchanged(mine * row_bytes, agreed)
        if not agreed:
            if error is not None:
                raise error
            return None
        if not mine:
            source.count_exchanged(0)  # no rows of its own: still a tensor read this way
        out = self._all_to_all(block, bounds, mine, cols // self.world * size)
        self.exchanges += 1
        return out.view(rows, -1).view(source.dtype)

    def _all_to_all(
        self, block: torch.Tensor | None, bounds: list[int], mine: int, piece: int
    ) -> torch.Tensor:
        """Rank i's rows, this rank's ``piece`` bytes of each, from every rank i, in row order
        (``block``: this rank's rows, whole, as bytes)."""
        import torch.distributed as dist

        if block is None:
            send = torch.empty(0, dtype=torch.uint8)
        else:
            # (rows, T, piece) -> (T, rows, piece): what goes to each rank, one after the other.
            send = block.view(mine, self.world, piece).transpose(0, 1).contiguous().view(-1)
        counts = [bounds[i + 1] - bounds[i] for i in range(self.world)]
        out = torch.empty(bounds[-1] * piece, dtype=torch.uint8)
        dist.all_to_all_single(
            out,
            send,
            output_split_sizes=[n * piece for n in counts],
            input_split_sizes=[mine * piece] * self.world,
            group=self.group,
        )
        self.received_bytes += (bounds[-1] - mine) * piece
        return out

    def _announce(
        self, kind: int, source: RegionSource | None = None, ok: bool = True
    ) -> list[int]:
        if source is None:
            return [kind, 0, 0, 0, 0, int(ok)]
        # ``place``: the tensor's file (its URI and the version opened) and data offsets in it.
        uri, version, begin, end = source.place
        held = _digest(str(source.dtype), tuple(source.shape), source.shard, begin, end)
        return [kind, _digest(source.name), held, _digest(uri), _digest(version), int(ok)]

    def _agree(self, mine: list[int]) -> bool:
        """Whether every rank announced the same tensor, held alike in files of one version
        where they read one URI, all reads fine. Ranks out of step (at another tensor, done, or
        failed) turn the exchange off from now on, on every rank (all see the same
        announcements); ranks whose files differ in the tensor skip it only."""
        import torch.distributed as dist

        here = torch.tensor(mine, dtype=torch.int64)
        gathered = [torch.empty_like(here) for _ in range(self.world)]
        dist.all_gather(gathered, here, group=self.group)
        every = [e.tolist() for e in gathered]
        in_step = all(e[: _NAME + 1] == every[0][: _NAME + 1] for e in every)
        if not in_step or not all(e[_OK] for e in every):
            self.enabled = False
            if mine[_KIND] != _DONE and all(e[_OK] for e in every):
                logger.warning(
                    "fastload: the tensor-parallel ranks did not load the same tensor at the "
                    "same time (%s); each reads its columns itself from here on",
                    [e[: _NAME + 1] for e in every],
                )
            return False
        versions: dict[int, int] = {}
        alike = all(
            e[_HELD] == every[0][_HELD] and versions.setdefault(e[_URI], e[_VERSION]) == e[_VERSION]
            for e in every
        )
        if not alike:
            self.differed += 1
            log = logger.warning if self.differed == 1 else logger.debug
            log(
                "fastload: the tensor-parallel ranks' files differ in a tensor of one name "
                "(its dtype, shape or offsets, or the version of the file): each rank reads "
                "its own (%d such tensors so far)",
                self.differed,
            )
        return alike

    def close(self) -> None:
        """The load is over (or failed) on this rank: answers any rank still waiting for an
        exchange, then turns the exchange off. Call it on every rank, in a ``finally``."""
        if self.enabled:
            self.enabled = False
            self._agree(self._announce(_DONE))
