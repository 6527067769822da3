"""Read-ahead for lazy tensors (``fastload._lazy``): a checkpoint handed to a model's
``load_weights`` is consumed in file order, each tensor narrowed by its weight loader and copied
at once, so without help every tensor costs a round trip to storage one after the other. The
layers of a model repeat: the tensor ``model.layers.7.mlp.down_proj.weight`` is narrowed as
``model.layers.6.mlp.down_proj.weight`` was. Once a tensor's region is known (it was read), the
same tensor of the next layer (its name with the first number, the layer, replaced, and the same
shape and dtype) is read ahead with that region, in background threads, as soon as the consumer
reads a first tensor of that layer: the rest of the layer's reads are then in flight together,
while the consumer works on the first.

When the consumer reads a tensor with the region predicted, it gets the bytes read ahead; with
another region it reads as without read-ahead (the prediction's bytes count as unused). A layer
nothing of which is read (a pipeline stage's next layers) is never read ahead; a tensor the
consumer passes without reading it (an expert of another rank) ends the prediction for its name
until it is read again. What is read ahead is bounded by ``window`` tensors past the consumer
and ``limit`` bytes held (read ahead and not yet used).
"""

from __future__ import annotations

import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

# Tensors past the one the consumer is at that may be read ahead.
WINDOW = 32
# Bytes read ahead and not used yet, at most (a load's memory_limit, when smaller).
LIMIT = 256 << 20
# Threads reading ahead (each read is itself `concurrency` requests in flight).
THREADS = 4

_LAYER = re.compile(r"(?<![0-9])[0-9]+(?![0-9])")


def layer(name: str) -> str | None:
    """The layer a tensor belongs to: the first number in its name (``None``: none)."""
    m = _LAYER.search(name)
    return m.group(0) if m else None


def key(name: str, shape: tuple[int, ...], dtype: Any) -> tuple[str, tuple[int, ...], Any]:
    """What tensors that are read alike share: the name with its first number (the layer)
    replaced, the shape and the dtype."""
    return _LAYER.sub("#", name, count=1), shape, dtype


class ReadAhead:
    """The read-ahead of one checkpoint's lazy tensors (see the module's doc) over ``sources``:
    its ``_Source``s in the order they are handed out. Each has ``name``, ``key``, ``position``,
    ``done`` (read already), ``region_bytes(index)`` and ``fetch(index) -> (tensor, bytes
    read)``. Called from the consumer's thread only; the reads run in its own."""

    def __init__(self, sources: list[Any], window: int = WINDOW, limit: int = LIMIT) -> None:
        self.window, self.limit = window, limit
        self.sources = sources
        following: dict[Any, int] = {}
        self.following = [0] * len(sources)  # position -> the next of its name (0: none)
        for pos in range(len(sources) - 1, -1, -1):
            sources[pos].position = pos
            self.following[pos] = following.get(sources[pos].key, 0)
            following[sources[pos].key] = pos
        self.next: set[int] = set()  # positions to read ahead once in the window
        self.layers = [layer(source.name) for source in sources]
        self.started: set[str | None] = set()  # layers something of which was read
        self.regions: dict[Any, tuple[Any, bool]] = {}  # key -> (index, full) last read
        self.pending: dict[int, tuple[Any, Future[Any], int]] = {}  # position -> read ahead
        self.held = 0  # bytes of pending reads
        self.at = -1  # the position of the last tensor handed out
        self.used_bytes = self.unused_bytes = 0
        self._lock = threading.Lock()  # unused_bytes: counted as reads end
        self._pool: ThreadPoolExecutor | None = None

    def handed_out(self, pos: int) -> None:
        """The consumer was handed the tensor at ``pos`` (the next in order): the one before, if
        it passed it by unread, ends the prediction of its name."""
        if pos > 0 and not self.sources[pos - 1].done:
            self._drop(pos - 1)
            self.regions.pop(self.sources[pos - 1].key, None)
        self.at = pos
        self._launch()

    def take(self, source: Any, index: Any, full: bool) -> tuple[Any, int] | None:
        """What was read ahead for ``source`` if it is the region ``index``, else ``None`` (what
        was read ahead is dropped); from now on ``index`` is what ``source``'s name is read as,
        and the window is read ahead with it."""
        entry = self.pending.pop(source.position, None)
        self.regions[source.key] = (index, full)
        self.started.add(self.layers[source.position])
        if self.following[source.position]:
            self.next.add(self.following[source.position])
        got = None
        if entry is not None:
            self.held -= entry[2]
            if entry[0] == index:
                try:
                    got = entry[1].result()
                    self.used_bytes += got[1]
                except Exception:
                    got = None  # read again by the consumer: its error, if it lasts
            else:
                self._unused(entry[1])
        self._launch()
        return got

    def _drop(self, pos: int) -> None:
        entry = self.pending.pop(pos, None)
        if entry is not None:
            self.held -= entry[2]
            self._unused(entry[1])

    def _unused(self, future: Future[Any]) -> None:
        """Counts what ``future`` read (once it ends: not cancelled midway) as unused."""

        def count(f: Future[Any]) -> None:
            if f.cancelled() or f.exception() is not None:
                return
            with self._lock:
                self.unused_bytes += int(f.result()[1])

        if not future.cancel():
            future.add_done_callback(count)

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
            if self.layers[pos] not in self.started:
                continue  # once the consumer reads some of that layer
            source = self.sources[pos]
            region = self.regions.get(source.key)
            if region is None:
                self.next.discard(pos)
                continue
            index, _full = region
            exchange = getattr(source, "exchange", None)
            if exchange is not None and exchange.wants(source, index):
                self.next.discard(pos)  # read with the group (fastload._exchange), not ahead
                continue
            nbytes = source.region_bytes(index)
            if self.pending and self.held + nbytes > self.limit:
                return
            if self._pool is None:
                self._pool = ThreadPoolExecutor(THREADS, thread_name_prefix="fastload-ahead")
            self.pending[pos] = (index, self._pool.submit(source.fetch, index), nbytes)
            self.held += nbytes
            self.next.discard(pos)

    def close(self) -> None:
        """Drops what was read ahead and not used (waiting for reads in progress)."""
        for pos in list(self.pending):
            self._drop(pos)
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
