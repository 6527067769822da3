"""Read-ahead for lazy tensors (``fastload._lazy``): a checkpoint handed to a model's
``load_weights`` is consumed in file order, each tensor narrowed by its weight loader and copied
at once, so without help every tensor costs a round trip to storage one after the other. The
layers of a model repeat: the tensor ``model.layers.7.mlp.down_proj.weight`` is narrowed as
``model.layers.6.mlp.down_proj.weight`` was. Once a tensor's region is known (it was read), the
same tensor of the next layer (its name with the first number, the layer, replaced, and the same
shape and dtype) is read ahead with that region as soon as the consumer reads a first tensor of
that layer: the rest of the layer's reads are then in flight together, while the consumer works
on the first. The next layer's first tensor is read ahead once the consumer reads something of
the layer before (so that a layer's first read does not wait), and with ``all_layers`` (the
consumer reads every layer: no pipeline stages) every later layer's tensors are, as far ahead as
``window`` and ``limit`` let. Reads ahead start at once and are in flight on native threads
(``Reader.read_later``), which never take the GIL: reads that end while the consumer runs Python
do not queue for it, as Python threads would (a 2 KiB read took 0.1 to 0.2 s that way).
A tensor the group exchanges (``fastload._exchange``) is read ahead as this rank's block of rows,
the same every layer, which the exchange then uses. Small 1-D tensors (norms) are read ahead whole
on first sight, once the consumer read something, the region asked for cut from them.

A tensor whose name was never read (layer 0's, the embeddings, ``lm_head``) has no region to go
by. Under a tensor-parallel group (an exchange) such a 2-D tensor is read ahead as this rank's
block of rows (outside the layers ``GUESS_MARGIN`` rows more on each side: padded vocabularies),
the group's guess: what a column-parallel or vocab-parallel weight keeps and what a row-parallel
one is read as for the exchange, so the first layer's reads are in flight together too (with
``all_layers`` from the start, else once the consumer reads some of its layer). A region asked
for within those rows is cut from them; any other (a replicated or a KV-head weight) is read as
asked, and the guess counts as unused.

When the consumer reads a tensor with the region predicted, it gets the bytes read ahead; with
another region it reads as without read-ahead (the prediction's bytes count as unused). A layer
nothing of which is read (a pipeline stage's next layers) is never read ahead, but for its first
tensor and its small 1-D ones; a tensor the consumer passes without reading it (an expert of
another rank) ends the prediction for its name until it is read again. What is read ahead is
bounded by ``window`` tensors past the consumer and ``limit`` bytes held (read ahead and not yet
used).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._regions import AheadSource

# Tensors past the one the consumer is at that may be read ahead.
WINDOW = 32
# Bytes read ahead and not used yet, at most (a load's memory_limit, when smaller).
LIMIT = 256 << 20

_LAYER = re.compile(r"(?<![0-9])[0-9]+(?![0-9])")


def layer(name: str) -> str | None:
    """The layer a tensor belongs to: the first number in its name (``None``: none)."""
    m = _LAYER.search(name)
    return m.group(0) if m else None


# 1-D tensors this small are read ahead whole on first sight (see ReadAhead.small).
SMALL = 64 << 10
# Marks a read-ahead entry as a whole tensor read before its first read.
_WHOLE = "whole"
# Marks a read-ahead entry as an exchanged tensor's row block (not the region itself).
_BLOCK = "block"
# Marks a read-ahead entry as a guessed block of rows, ``(_GUESS, first row, end row)``: a tensor
# no region of which is known yet, read as this rank's row block of the group.
_GUESS = "guess"
# Rows read on each side of the rank's block in a guess of a tensor outside the layers (no layer
# number): a vocabulary padded to a multiple of 64 rows (vLLM's and SGLang's embeddings and
# lm_head) starts the rank's rows up to 63 rows off the even split.
GUESS_MARGIN = 64


def key(name: str, shape: tuple[int, ...], dtype: Any) -> tuple[str, tuple[int, ...], Any]:
    """What tensors that are read alike share: the name with its first number (the layer)
    replaced, the shape and the dtype."""
    return _LAYER.sub("#", name, count=1), shape, dtype


class ReadAhead:
    """The read-ahead of one checkpoint's lazy tensors (see the module's doc) over ``sources``:
    its ``_Source``s in the order they are handed out (``fastload._regions.AheadSource``: reads
    started at once, in flight on native threads that never take the GIL, each with ``result()
    -> (tensor, bytes read)``). Called from the consumer's thread only."""

    def __init__(
        self,
        sources: Sequence[AheadSource],
        window: int = WINDOW,
        limit: int = LIMIT,
        all_layers: bool = False,
    ) -> None:
        self.window, self.limit = window, limit
        self.sources = sources
        following: dict[Any, int] = {}
        self.following = [0] * len(sources)  # position -> the next of its name (0: none)
        for pos in range(len(sources) - 1, -1, -1):
            sources[pos].position = pos
            self.following[pos] = following.get(sources[pos].key, 0)
            following[sources[pos].key] = pos
        self.next: set[int] = set()  # positions to read ahead once in the window
        # The first tensor of each name (no region known): this rank's rows guessed, where a
        # group gives the rank (see the module's doc): position -> (rows, byte range).
        self.guesses = {
            pos: guess for pos in following.values() if (guess := _guess(sources[pos])) is not None
        }
        self.next |= self.guesses.keys()
        # Small 1-D tensors (norms, biases: read whole by most consumers) are read ahead whole
        # before their first read, the region asked for then cut from them.
        self.small = {
            pos
            for pos, source in enumerate(sources)
            if len(source.shape) == 1 and 0 < source.nbytes <= SMALL
        }
        self.next |= self.small
        self.layers = [layer(source.name) for source in sources]
        # The layer before each tensor's layer (in file order; None: none), and the positions
        # where a layer begins: those are read ahead once the layer before is started, so that
        # a layer's first read does not wait either; with ``all_layers`` (every layer is read:
        # no pipeline stages) the whole next layer is.
        self.all_layers = all_layers
        self.before: list[str | None] = [None] * len(sources)
        self.opens: set[int] = set()
        for pos in range(1, len(sources)):
            if self.layers[pos] == self.layers[pos - 1]:
                self.before[pos] = self.before[pos - 1]
            else:
                self.before[pos] = self.layers[pos - 1]
                self.opens.add(pos)
        self.started: set[str | None] = set()  # layers something of which was read
        self.regions: dict[Any, tuple[Any, bool]] = {}  # key -> (index, full) last read
        self.pending: dict[int, tuple[Any, Any, int]] = {}  # position -> read ahead
        self.held = 0  # bytes of pending reads
        self.at = -1  # the position of the last tensor handed out
        self.used_bytes = self.unused_bytes = 0
        self.unused: list[Any] = []  # reads read ahead in vain: counted once they end
        self.unused_held = 0  # their bytes, held until then

    def handed_out(self, pos: int) -> None:
        """The consumer was handed the tensor at ``pos`` (the next in order): the one before, if
        it passed it by unread, ends the prediction of its name."""
        if pos > 0 and not self.sources[pos - 1].done:
            self._drop(pos - 1)
            self.regions.pop(self.sources[pos - 1].key, None)
        self.at = pos
        self._launch()

    def take(
        self, source: AheadSource, index: Any, full: bool, block: bool = False
    ) -> tuple[Any, int] | None:
        """What was read ahead for ``source`` if it is the region ``index``, else ``None`` (what
        was read ahead is dropped); from now on ``index`` is what ``source``'s name is read as,
        and the window is read ahead with it. ``block``: ``source[index]`` is exchanged, and
        what is wanted is this rank's row block (``exchange.block(source)``) as bytes."""
        entry = self.pending.pop(source.position, None)
        if block:
            index = (_BLOCK, index)
        self.regions[source.key] = (index[1] if block else index, full)
        self.started.add(self.layers[source.position])
        follower = self.following[source.position]
        while follower:
            # The next layer's tensor of this name; with ``all_layers`` every later layer's
            # (all are read: as far ahead as the window and the limit let).
            self.next.add(follower)
            follower = self.following[follower] if self.all_layers else 0
        got = None
        if entry is not None:
            self.held -= entry[2]
            guessed = isinstance(entry[0], tuple) and entry[0][:1] == (_GUESS,)
            cut = _cut(source, entry[0], index, block) if guessed else None
            if entry[0] == index or entry[0] == _WHOLE or cut is not None:
                try:
                    got = entry[1].result()
                    if entry[0] == _WHOLE and not full:
                        got = (got[0][index], got[1])
                    elif cut is not None:
                        got = (cut(got[0]), got[1])
                    self.used_bytes += got[1]
                except Exception:
                    got = None  # read again by the consumer: its error, if it lasts
            else:
                self._unused(entry[1], entry[2])
        self._launch()
        return got

    def _drop(self, pos: int) -> None:
        entry = self.pending.pop(pos, None)
        if entry is not None:
            self.held -= entry[2]
            self._unused(entry[1], entry[2])

    def _unused(self, later: Any, nbytes: int) -> None:
        """Counts what ``later`` reads as unused once it ends: at ``close``, or once such reads
        hold a quarter of ``limit`` (waiting for them then, so that what they hold is freed)."""
        self.unused.append(later)
        self.unused_held += nbytes
        if self.unused_held > self.limit // 4:
            self._count_unused()

    def _count_unused(self) -> None:
        unused, self.unused, self.unused_held = self.unused, [], 0
        for later in unused:
            try:
                self.unused_bytes += int(later.result()[1])
            except Exception:
                pass  # failed: what it read is not known to have arrived

    def _launch(self) -> None:
        """Reads ahead, in order while they fit in the limit, the tensors within the window that
        follow a tensor of their name that was read (the next layer's), once some tensor of
        their layer was read."""
        for pos in sorted(self.next):
            if pos <= self.at or pos in self.pending or self.sources[pos].done:
                self.next.discard(pos)
                continue
            if pos > self.at + self.window:
                break
            source = self.sources[pos]
            region = self.regions.get(source.key)
            if region is None and pos in self.small:
                if not self.started:
                    continue  # once the consumer reads something
                region = (_WHOLE, True)  # not read yet: whole, started layer or not
            elif region is None and pos in self.guesses:
                if not self.all_layers and (
                    self.layers[pos] is None or self.layers[pos] not in self.started
                ):
                    continue  # a pipeline stage: once the consumer reads some of its layer
                rows, span = self.guesses[pos]
                if self.pending and self.held + span[1] > self.limit:
                    return
                self._submit(pos, (_GUESS, *rows), source.start_raw([span]), span[1])
                continue
            elif (
                not self.all_layers
                and self.layers[pos] not in self.started
                and not (
                    self.layers[pos] is not None
                    and self.before[pos] in self.started
                    and pos in self.opens
                )
            ):
                continue  # once the consumer reads some of that layer (or of the one before)
            if region is None:
                self.next.discard(pos)
                continue
            index, full = region
            exchange = getattr(source, "exchange", None)
            if full and exchange is not None and exchange.shares(source):
                if exchange.owner(source) != exchange.rank:
                    self.next.discard(pos)  # another rank reads it and sends it
                    continue
            whole = tuple(slice(0, n, 1) for n in source.shape)
            fetch_index = whole if index == _WHOLE else index
            block = None
            if index != _WHOLE and exchange is not None and exchange.wants(source, index):
                # Read with the group (fastload._exchange): this rank's rows ahead, the same
                # every layer.
                block = exchange.block(source)
                if block is None:
                    self.next.discard(pos)
                    continue
                nbytes = block[1]
                index = (_BLOCK, index)
            else:
                nbytes = source.region_bytes(fetch_index)
            if self.pending and self.held + nbytes > self.limit:
                return
            later = source.start(fetch_index) if block is None else source.start_raw([block])
            self._submit(pos, index, later, nbytes)

    def _submit(self, pos: int, index: Any, later: Any, nbytes: int) -> None:
        self.pending[pos] = (index, later, nbytes)
        self.held += nbytes
        self.next.discard(pos)

    def close(self) -> None:
        """Drops what was read ahead and not used, waiting for reads in progress (what the
        source sent is counted: ``unused_bytes``)."""
        for pos in list(self.pending):
            self._drop(pos)
        self._count_unused()


def _guess(source: AheadSource) -> tuple[tuple[int, int], tuple[int, int]] | None:
    """For a 2-D tensor of a tensor-parallel group's load: this rank's block of rows (``(first,
    end)``) and its byte range, as the group's exchange reads it (``None``: no guess)."""
    exchange = getattr(source, "exchange", None)
    if exchange is None or not exchange.enabled or len(source.shape) != 2:
        return None
    if exchange.skip is not None and exchange.skip(source.name):
        return None  # experts spread over ranks: this rank may read none of it
    block = exchange.block(source)
    if block is None:
        return None
    row_bytes = source.shape[1] * source.dtype.itemsize
    mine = block[0] // row_bytes
    # Outside the layers (embeddings, lm_head): a padded vocabulary's rows, a margin around.
    margin = GUESS_MARGIN if layer(source.name) is None else 0
    first = max(0, mine - margin)
    end = min(source.shape[0], mine + block[1] // row_bytes + margin)
    return (first, end), (first * row_bytes, (end - first) * row_bytes)


def _cut(source: AheadSource, guess: tuple[Any, ...], index: Any, block: bool) -> Any:
    """How to get what the consumer asks for from a guessed row block (raw bytes), or ``None``
    where it lies outside it. ``block``: the exchange's row block is asked for (its bytes, a
    view of the guess's)."""
    _, first, end = guess
    if block:
        row_bytes = source.shape[1] * source.dtype.itemsize
        wanted = source.exchange.block(source)
        if wanted is None or not first * row_bytes <= wanted[0] <= wanted[0] + wanted[1] <= (
            end * row_bytes
        ):
            return None
        at = wanted[0] - first * row_bytes
        return lambda raw: raw[at : at + wanted[1]]
    if len(index) != 2 or not isinstance(index[0], slice):
        return None
    rows = index[0]
    if rows.step != 1 or rows.start < first or rows.stop > end or rows.start >= rows.stop:
        return None
    shifted = (slice(rows.start - first, rows.stop - first, 1), index[1])

    def cut(raw: Any) -> Any:
        return raw.view(end - first, -1).view(source.dtype)[shifted]

    return cut
