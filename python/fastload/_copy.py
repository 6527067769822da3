"""``fastload.copy``: a file or a whole model folder from any store to any store, through the
native copy (``_fastload.copy``): read once in parallel ranged reads, no local staging, Hub
digests checked while streaming, each file published whole, a rerun skipping what is done. In a
group (``process_group=``, or under ``torchrun``) each rank copies its share of the files, and a
large file going to S3 or GCS is split into part ranges that every rank uploads (the ranks
all-gather through ``exchange``: the upload id, the parts' ids, the outcome)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from . import _fastload
from ._errors import FastloadError
from ._write import _destination


def _group(process_group: Any) -> tuple[Any, int, int]:
    """(group or None, rank, world): an explicit group, else the initialised default group,
    else torchrun's RANK / WORLD_SIZE, else a single process."""
    import torch.distributed as dist

    from .distributed import _resolve_group

    if process_group is not None:
        group = _resolve_group(process_group)
        if group is None:
            return None, 0, 1
        return group, dist.get_rank(group), dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        size = dist.get_world_size()
        return (dist.group.WORLD, dist.get_rank(), size) if size > 1 else (None, 0, 1)
    env_rank, env_world = os.environ.get("RANK", ""), os.environ.get("WORLD_SIZE", "")
    if env_rank.isdigit() and env_world.isdigit() and int(env_rank) < int(env_world):
        return None, int(env_rank), int(env_world)
    return None, 0, 1


def copy(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    storage_options: Mapping[str, object] | None = None,
    verify: bool = True,
    concurrency: int | None = None,
    block_size: int | str | None = None,
    memory_limit: int | str | None = None,
    part_size: int | str | None = None,
    process_group: Any = None,
    progress: bool = True,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
) -> dict[str, Any]:
    """Copies ``src`` to ``dst`` (the same as ``fastload copy SRC DST``).

    ``src``: a local file or folder, an object or prefix (``s3://``, ``gs://``, ``az://``), one
    ``http(s)://`` file, or a Hub repo or folder (``hf://org/repo[@revision][/path]``: every
    file of the repo under that path, at the commit the revision resolves to). ``dst``: a path
    or ``file://``, ``s3://``, ``gs://``, ``az://``. A folder's files go under ``dst`` with their
    relative paths; a single file becomes ``dst``, or goes into it when ``dst`` ends with ``/`` or
    is an existing local folder.

    Each file is read once (``concurrency`` reads of ``block_size`` bytes in flight) and written
    as :func:`save_file` writes (temporary file and rename, or a multipart upload of
    ``part_size`` parts, completed last). Up to 4 files are copied at once, the largest first,
    sharing ``memory_limit`` (the bytes of parts in flight); indexes (``*.index.json``) go first
    (in a group, rank 0 copies them before any rank starts on the others): a copy stopped at any
    point leaves an index naming shards not yet there, so a load raises, never shards alone that a
    reader taking every ``*.safetensors`` file would load as a smaller model. A Ctrl-C aborts the
    uploads of the files in flight before the ``KeyboardInterrupt`` is raised (in a group, the
    other ranks raise a :class:`fastload.FastloadError` saying so). With ``verify`` a Hub file's
    sha256 (LFS) or git blob id is checked while it streams: a mismatch aborts that file (nothing
    published) and raises naming it. A destination file that is a complete copy of the same
    source (same size and source identity, recorded with it) is skipped, so a rerun after an
    interruption finishes the job; a Hub file copied with ``verify=False`` is recorded as
    unchecked, and a ``verify=True`` run checks it again (hashes a local file, copies an object
    again) before skipping it. Any other existing file raises
    :class:`fastload.DestinationExistsError` unless ``overwrite=True``, and so does an earlier
    checkpoint of another layout of a stem the copy writes (one ``model.safetensors`` where it
    writes ``model-*-of-*.safetensors`` shards, or the reverse), which it would leave beside its
    own files. ``overwrite=True`` copies every file again and, as :func:`save` does, publishes
    none until all are complete (the indexes last where an earlier checkpoint stays loadable
    until then, else first): a failure or Ctrl-C leaves the earlier files, or none, never some of
    each (a group's ranks publish together, step by step: every rank staged, the earlier files
    removed, the indexes, the weights; ranks that cannot talk, ``RANK``/``WORLD_SIZE`` without
    torch.distributed, are refused ``overwrite=True``). Before publishing it also removes, as
    :func:`save` does, the earlier checkpoint files of another layout (shards, then their index,
    under a new ``model.safetensors``); no other file. ``storage_options``
    configure both stores. In a group each rank copies its share of the files; the call returns
    on every rank once all ranks finished (an error on any rank is raised on every rank). A file
    of at least two parts per rank going to S3 or GCS is split: every rank reads and uploads its
    own range of its parts (rank 0 creates the upload and completes it once every part is up, or
    aborts it when any rank failed). Not split: Hub files whose digest is checked (``verify``;
    the digest needs the whole file in order, so with ``verify=False`` they are split), files
    encrypted on their way, and other destinations; they go whole to one rank.

    With ``keyset`` (a Tink cleartext JSON keyset or its path) every ``.safetensors`` file is
    encrypted on its way with the keyset's primary key and ``associated_data``, as
    :func:`save_file` encrypts; other files (the index, configs) are copied as they are. A source
    file that is already Tink-encrypted is refused (copy it without ``keyset`` to keep it
    encrypted as it is). Without ``keyset`` bytes are copied as they are, encrypted or not.

    Returns this rank's ``{"copied": [...], "skipped": [...], "bytes": n}``."""

    options = {
        "overwrite": overwrite,
        "storage_options": storage_options,
        "verify": bool(verify),
        "concurrency": concurrency,
        "block_size": block_size,
        "memory_limit": memory_limit,
        "part_size": part_size,
        "progress": bool(progress),
        "keyset": keyset,
        "associated_data": associated_data,
    }
    return _done(_in_group(process_group, _destination(src), _destination(dst), options))


def _done(report: dict[str, Any]) -> dict[str, Any]:
    """A copy's report, once it is done; a stopped copy raises."""
    stopped = report.pop("stopped", None)
    if stopped is not None:
        # Another rank failed, and its error was raised on every rank; should none have been, a
        # stopped copy is still never reported as done.
        raise FastloadError(f"copy stopped: {stopped}")
    return report


def _for_the_others(error: BaseException | None) -> BaseException | None:
    """What the other ranks of a group raise for this rank's `error`: the error itself, or, for
    a ``KeyboardInterrupt`` (a Ctrl-C that reached this rank only), a :class:`FastloadError`
    saying so: only the interrupted rank raises ``KeyboardInterrupt``."""
    if error is None or isinstance(error, Exception):
        return error
    return FastloadError(f"copy interrupted ({type(error).__name__})")


def _in_group(process_group: Any, src: str, dst: str, options: dict[str, Any]) -> dict[str, Any]:
    """The native copy with ``options`` on this rank of ``process_group`` (see :func:`_group`),
    the ranks exchanging through an all-gather of one str per rank; in a group, an error on any
    rank is raised on every rank."""
    group, rank, world = _group(process_group)
    if group is None:
        return _fastload.copy(src, dst, rank=rank, world=world, **options)
    import torch.distributed as dist

    # Called back on this thread, by _fastload.copy; it holds the group itself (not a cell of
    # this frame, which deletes both below).
    def exchange(message: str, group: Any = group) -> list[str]:
        out: list[Any] = [None] * world
        dist.all_gather_object(out, message, group=group)
        return [str(m) for m in out]

    error: BaseException | None = None
    report: dict[str, Any] = {"copied": [], "skipped": [], "bytes": 0}
    try:
        report = _fastload.copy(src, dst, rank=rank, world=world, exchange=exchange, **options)
    except BaseException as e:  # a Ctrl-C too: the others wait in the gather below to hear of it
        error = e
    from .distributed import _gather, _portable, _raise_first

    # A Ctrl-C that cut the copy's exchanges short: another rank may be waiting in one this rank
    # never ran, which a gather here would meet, and misread. So none is run; the others hear of
    # this rank when its process exits (or at the group's timeout).
    errors: list[Any] | None = None
    try:
        if not getattr(error, _fastload.UNANSWERED, False):
            errors = _gather(_portable(_for_the_others(error)), group, world)
    except Exception:
        # A rank is gone (killed, its link cut): this rank's own error says what happened here,
        # and is raised; without one, the collective's.
        if error is None:
            raise
    if errors is None:  # no gather (above), or it failed: this rank's own error alone
        errors = [error if r == rank else None for r in range(world)]
    # The raised error's traceback keeps this frame: neither the group nor the error itself is
    # left in it. Otherwise the group outlives destroy_process_group() (in a cycle only the
    # garbage collector breaks, or for as long as the caller keeps the error), and gloo's
    # threads, still running at interpreter exit, abort the process when one of them needs the
    # GIL ("terminate called without an active exception").
    del group, exchange
    try:
        if error is not None and not isinstance(error, Exception):
            raise error  # this rank's Ctrl-C stays a KeyboardInterrupt here
        _raise_first(errors, rank, error)
    finally:
        del errors, error
    return report
