"""Publishing the files of one checkpoint (:func:`fastload.save`'s shards and index) so that a
reader finds the earlier checkpoint whole, the new one whole, or an error: never part of one, and
never one's index over the other's shards.

Every file is first written complete and durable without being visible (a synced temporary file;
an upload whose parts are all stored but not completed). Only then are they published, and the
earlier checkpoint's files that the new one does not replace removed (shards first, its index
last: an index naming a missing shard fails a load, where shards left without their index would
load as a smaller model). A failure or Ctrl-C before the last file is published aborts the files
not yet published and removes those that were.

A new checkpoint with the earlier one's file names (the same number of shards) cannot replace it
file by file without a moment where the earlier index names some new shards; nor can new shards
appear beside an earlier checkpoint that has no index (one ``model.safetensors``), which a reader
taking every ``*.safetensors`` file would load together with them: in both cases the earlier files
are removed before the first new one is published, so a failure from there on leaves no
checkpoint rather than a mixed one.

Which goes first, the index or the shards: where an earlier checkpoint stays loadable until the
new one is whole (other file names, under an index of its own that decides what loads until the
new index replaces it), the shards go first and the index last, so readers go from
the old checkpoint to the new one in one step, and a process killed in between leaves the old one
loading. Where none is left (an empty folder, or the earlier files removed as above), the index
goes first: killed between two renames, the folder then holds an index naming shards not yet
there (a load raises), never shards alone that a reader taking every ``*.safetensors`` file
would load as a smaller model."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from types import TracebackType
from typing import Any

from . import _fastload

INDEX_FILE = _fastload.INDEX_FILE  # the index loads read, written last
SINGLE_FILE = "model.safetensors"
# The files of a checkpoint `save` writes: an earlier save's are stale once a new one is written.
_CHECKPOINT_FILE = re.compile(
    r"model\.safetensors(\.index\.json)?|model-\d{5}-of-\d{5}\.safetensors"
)


def join(folder: str, name: str) -> str:
    return folder.rstrip("/") + "/" + name if folder.rstrip("/") else name


def checkpoint_files(folder: str, storage_options: Mapping[str, object] | None) -> list[str]:
    """Names of the checkpoint files (shards, index, single file) directly under `folder`."""
    if _fastload.is_remote_uri(folder):
        prefix = folder.rstrip("/") + "/"
        names = [u.rsplit("/", 1)[-1] for u, _ in _fastload.list_objects(
            prefix, storage_options=storage_options)]  # fmt: skip
    else:
        local = folder[len("file://") :] if folder.startswith("file://") else folder
        try:
            names = os.listdir(local)
        except (FileNotFoundError, NotADirectoryError):
            names = []
    return sorted(n for n in names if _CHECKPOINT_FILE.fullmatch(n))


def remove_stale(
    folder: str,
    earlier: list[str],
    written: list[str],
    storage_options: Mapping[str, object] | None,
) -> None:
    """Removes an earlier save's files that the new one did not replace: its shards first, its
    index last (until then the index fails a load that would find shards missing)."""
    stale = sorted(set(earlier) - set(written), key=lambda n: (n == INDEX_FILE, n))
    for name in stale:
        _fastload.remove(join(folder, name), storage_options=storage_options)


def _clashes(earlier: list[str], names: list[str]) -> bool:
    """Whether the earlier checkpoint cannot stay loadable, alone, while `names` are published one
    by one: some of its files would be replaced while others of it stay (one file replacing one
    file is a single atomic replace), or, having no index, it would sit beside new weights of
    other names (one `model.safetensors` under new shards), and a reader taking every
    ``*.safetensors`` file would load both, the same tensors twice (vLLM keeps whichever it reads
    last: a mix that loads without an error)."""
    if set(earlier) & set(names):
        return set(earlier) != {SINGLE_FILE}
    return bool(earlier) and INDEX_FILE not in earlier and bool(names)


class Staged:
    """The files of one checkpoint under `folder`, each added as a writer finished with
    ``publish=False``; :meth:`publish` publishes them. Used as a context manager: leaving it by an
    exception before :meth:`publish` returned aborts the unpublished files and removes the
    published ones."""

    def __init__(
        self,
        folder: str,
        earlier: list[str],
        *,
        overwrite: bool,
        storage_options: Mapping[str, object] | None,
    ) -> None:
        self.folder = folder
        self.earlier = earlier
        self.overwrite = overwrite
        self.storage_options = storage_options
        self.files: list[tuple[str, Any]] = []
        self.index_started = False
        self.done = False

    def add(self, name: str, writer: Any) -> None:
        self.files.append((name, writer))

    def publish(self, index: bytes | None = None) -> list[str]:
        """Publishes every file and `index` (the index file's bytes) if given, the index first
        where no earlier checkpoint is left, else last (see the module's documentation); removes
        the earlier checkpoint's files the new one does not replace. Returns the names, index
        last."""
        names = [name for name, _ in self.files]
        written = [*names, INDEX_FILE] if index is not None else names
        if _clashes(self.earlier, names):
            remove_stale(self.folder, self.earlier, [], self.storage_options)
            self.earlier = []
        index_first = not self.earlier
        if index is not None and index_first:
            self._write_index(index)
        for _, writer in self.files:
            writer.finish()
        if index is not None and not index_first:
            self._write_index(index)
        self.done = True
        remove_stale(self.folder, self.earlier, written, self.storage_options)
        return written

    def _write_index(self, index: bytes) -> None:
        self.index_started = True
        _fastload.write_bytes(
            join(self.folder, INDEX_FILE),
            index,
            overwrite=self.overwrite,
            storage_options=self.storage_options,
        )

    def __enter__(self) -> Staged:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is not None and not self.done:
            self._roll_back(error)

    def _roll_back(self, error: BaseException) -> None:
        # abort() first: it waits for a finish() that a Ctrl-C cut short, whose file may have
        # been published meanwhile (`published` says).
        for _, writer in self.files:
            writer.abort()
        gone = [name for name, writer in self.files if writer.published]
        if self.index_started and INDEX_FILE not in self.earlier:
            # Written or not: an index of ours must not outlive the shards removed here.
            gone.append(INDEX_FILE)
        for name in gone:  # shards first: an index naming a missing shard fails a load
            try:
                _fastload.remove(join(self.folder, name), storage_options=self.storage_options)
            except Exception as e:  # the first error is the one to raise
                if hasattr(error, "add_note"):  # Python 3.11+
                    error.add_note(f"fastload.save: {join(self.folder, name)} not removed: {e}")
