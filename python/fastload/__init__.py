"""fastload: the fastest way to get safetensors weights from storage into torch tensors.

>>> import fastload
>>> tensors = fastload.load("model/")                 # dict[str, torch.Tensor]
>>> for name, tensor in fastload.stream("model/"):    # each tensor as soon as it landed
...     ...
"""

from __future__ import annotations

import atexit
import json
import os
import urllib.parse
from collections import deque
from collections.abc import Callable, Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any

from . import _fastload, _options
from ._errors import (
    ConfigError,
    DestinationExistsError,
    FastloadError,
    FormatError,
    NotFoundError,
    StorageError,
    StreamClosedError,
    TensorNotFoundError,
)
from ._options import Options, Uri

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack

    from . import _parts
    from ._copy import copy
    from ._safe_open import SafeSlice, safe_open
    from ._write import save, save_file
    from .distributed import DistributedStream

__version__: str = _fastload.__version__

__all__ = [
    "DEVICE_TYPES",
    "ConfigError",
    "DestinationExistsError",
    "FastloadError",
    "FormatError",
    "NotFoundError",
    "Options",
    "SafeSlice",
    "StorageError",
    "Stream",
    "StreamClosedError",
    "TensorNotFoundError",
    "__version__",
    "cache_stats",
    "cached_memory",
    "copy",
    "inspect",
    "load",
    "load_file",
    "release_memory",
    "safe_open",
    "save",
    "save_file",
    "stream",
]


def _uri(u: object) -> str:
    """One path or URI as the native loader takes it: a ``str`` that is valid UTF-8."""
    u = _options.path_str(u, "(str, bytes or os.PathLike) or a list of them")
    if not u.strip():
        raise ConfigError(
            f"invalid option uri: {u!r} is empty: name a file, a directory or a URI", option="uri"
        )
    try:
        u.encode("utf-8")
    except UnicodeEncodeError:
        # A Linux path is bytes: one that is not UTF-8 (a bytes path, or os.fsdecode's
        # surrogates) travels as a file:// URI, percent-encoded byte for byte.
        if "://" in u:
            raise ConfigError(
                f"invalid option uri: {u!r} is not valid UTF-8 (only local paths may be)",
                option="uri",
            ) from None
        return "file://" + urllib.parse.quote_from_bytes(os.fsencode(os.path.abspath(u)))
    return u


def _uris(uri: Uri) -> list[str]:
    if isinstance(uri, (str, bytes, os.PathLike)):
        return [_uri(uri)]
    try:
        items: list[object] = list(uri)
    except TypeError:
        items = [uri]  # not iterable: refused by _uri, naming its type
    out = [_uri(u) for u in items]
    if not out:
        raise ConfigError("invalid option uri: the list of files is empty", option="uri")
    return out


# The options a Reader takes (the headers of a load with parts are read through one).
_READER = _options.taken_by("reader")

# Device types tensors can be delivered to. "cuda" goes through page-locked staging buffers and
# asynchronous copies into memory torch allocates on the device (see _fastload.Stream).
DEVICE_TYPES: frozenset[str] = frozenset({"cpu", "cuda"})


_tensors: ModuleType | None = None


def _torch_glue() -> ModuleType:
    """``fastload._torch``, imported by the first call that needs it and kept: later calls run
    no import statement (a process forked while another thread imports would wait for ever on
    that module's import lock), and ``import fastload`` (the CLI) does not pay for torch."""
    global _tensors
    if _tensors is None:
        try:
            import torch  # noqa: F401
        except ImportError as e:
            # `pip install fastload` does not pull torch (a 3 GB choice of build the user makes).
            raise ModuleNotFoundError(
                "fastload.load and fastload.stream return torch tensors and need PyTorch, which "
                f"is not importable here ({e}): install it, e.g. `pip install torch`",
                name="torch",
            ) from e
        from . import _torch

        _tensors = _torch
    return _tensors


def _target_for(device: Any, method: str | None) -> tuple[Any, str | None]:
    """The torch device for ``device``, and the native target ("cuda:N") when it is a GPU."""
    torch = _torch_glue().torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as e:
        raise ConfigError(
            f"invalid option device: {device!r} is not a device (use 'cpu', 'cuda', 'cuda:N' "
            "or a torch.device)",
            option="device",
        ) from e
    if dev.type not in DEVICE_TYPES:
        raise ConfigError(
            f"invalid option device: {device!r} is not supported "
            f"(fastload loads to {', '.join(sorted(DEVICE_TYPES))})",
            option="device",
        )
    if dev.type == "cpu":
        return dev, None
    if method is not None:
        # Checked before the driver is asked: a misspelt method is a ConfigError everywhere.
        _fastload.resolve_options(method=method)
    # Our own check first: without a driver it raises a clear FastloadError, where torch would
    # raise its own error from current_device().
    count = _fastload.cuda_device_count()
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    if index >= count:
        raise ConfigError(
            f"invalid option device: cuda:{index} does not exist: this machine has {count} "
            "CUDA device(s)",
            option="device",
        )
    dev = torch.device("cuda", index)
    return dev, f"cuda:{index}"


class Stream:
    """Iterator of ``(name, tensor)`` pairs in completion order; see :func:`stream`.

    Usable as a context manager; leaving it (or ``close()``) cancels the reads still pending.
    Threads may share it like a queue: each tensor goes to exactly one caller of ``next()``.
    A process forked after it was opened cannot iterate it (:class:`FastloadError`).
    """

    @_options.spelled_out
    def __init__(
        self,
        uri: Uri,
        *,
        _target: str | None = None,
        _reader: _fastload.Reader | None = None,
        **options: Unpack[Options],
    ) -> None:
        _options.check("Stream", options)
        dev, target = _target_for(options.get("device", "cpu"), options.get("method"))
        _torch = _torch_glue()
        if _target == "host":
            # The GPU path's staged pipeline into host memory (tests, and machines without one).
            target = "host"
        self._to_tensor: Callable[[str, tuple[int, ...], Any, str], torch.Tensor] = (
            _torch.to_tensor if target is None else _torch.from_bytes
        )
        native = _options.native(options)
        self._uris = _uris(uri)
        self._storage_options = native.get("storage_options")
        # parts=: the headers first (through a Reader whose files the load then reads, pinned
        # to the versions it saw), planned into byte ranges of the native load (see _parts).
        self._parts: _parts.Parts | None = None
        parts = options.get("parts")
        if parts is not None and not (isinstance(parts, Mapping) and not parts):
            from . import _parts

            if _reader is None:
                reader_options = {k: native[k] for k in _READER if k in native}
                _reader = _fastload.Reader(self._uris, **reader_options)
            self._parts = _parts.Parts(
                _reader.headers(), parts, native.pop("names", None), self._uris[0]
            )
            native["parts"] = self._parts.ranges
            self._pending_parts: deque[tuple[str, torch.Tensor]] = deque(self._parts.empty)
        self._native = _fastload.Stream(
            self._uris,
            **native,
            target=target,
            allocate=None if target is None else _torch.allocator(dev),
            # A safe_open handle's files, pinned to the versions it opened.
            reader=_reader,
        )
        self._pid = os.getpid()
        # Items of delivered segments not yet handed out, in order. Threads may share the stream
        # (like a queue): each item is popped by exactly one caller (deque's popleft and extend
        # are atomic), and dropped as it is handed out, so that the tensor alone keeps the memory
        # alive.
        self._pending: deque[_fastload.Item] = deque()
        self._closed = False
        # Items of delivered segments that close() dropped before they were handed out: the
        # native loader finished, the consumers did not.
        self._cut_items = 0

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        if self._pid != os.getpid():
            next(self._native)  # raises FastloadError: a forked child cannot use it
        if self._parts is not None:
            return self._next_part(self._parts)
        try:
            item = self._pending.popleft()
        except IndexError:
            item = self._next_item()
        try:
            return item.name, self._to_tensor(item.dtype, item.shape, item.data, item.name)
        except _torch_glue().UnsupportedDtype as e:
            self.close()
            message, file = self._in_file(e)
            raise FormatError(message, path=file) from None

    def _next_part(self, parts: _parts.Parts) -> tuple[str, torch.Tensor]:
        """The next tensor of a load with ``parts``: one read whole, or a part once its last
        piece landed (results of no bytes first)."""
        while True:
            try:
                return self._pending_parts.popleft()
            except IndexError:
                pass
            try:
                item = self._pending.popleft()
            except IndexError:
                item = self._next_item()
            try:
                raw = self._to_tensor(item.dtype, item.shape, item.data, item.name)
                done = parts.take(item.name, item.begin, raw)
            except _torch_glue().UnsupportedDtype as e:
                self.close()
                message, file = self._in_file(e)
                raise FormatError(message, path=file) from None
            if done is not None:
                return item.name, done

    def _next_item(self) -> _fastload.Item:
        """The first item of the next segment (the rest queued for whoever asks next)."""
        while True:
            try:
                batch = next(self._native)
            except StopIteration:
                # Another thread may have queued the last segment's items meanwhile: they are
                # handed out before the end.
                try:
                    return self._pending.popleft()
                except IndexError:
                    pass
                if self._cut_items:
                    raise self._closed_error() from None
                raise
            if self._closed:
                # Delivered as close() ran on another thread: dropped, as close() drops the queue.
                self._cut_items += len(batch)
                raise self._closed_error()
            if batch:
                self._pending.extend(batch[1:])
                return batch[0]

    def _closed_error(self) -> StreamClosedError:
        stats = self._native.stats()
        return StreamClosedError(
            "the stream was closed before it finished: "
            f"{stats.tensors_delivered - self._cut_items} of {stats.tensor_count} "
            + ("tensors delivered" if self._parts is None else "reads of tensors and parts done")
        )

    def _in_file(self, e: Any) -> tuple[str, str | None]:
        """The message and file of an unsupported dtype: the file is looked up from the headers
        (once, on this error path only)."""
        file: str | None = None
        try:
            report = json.loads(
                _fastload.inspect_json(self._uris, storage_options=self._storage_options)
            )
            file = next((t["file"] for t in report["tensors"] if t["name"] == e.tensor), None)
        except FastloadError:
            pass
        return e.describe(file), file

    def stats(self) -> dict[str, Any]:
        """Bytes and tensors planned, read and delivered so far; time to the first tensor; the
        method and options in force. After ``close()``, the counters as they were then (so the
        caller can tell how far a closed stream got)."""
        native = self._native.stats()
        stats = dict(native.as_dict())
        if self._parts is not None:
            stats.update(self._parts.stats())
        else:
            from ._regions import ReadStats

            whole = ReadStats(whole_tensors=native.tensor_count, whole_bytes=native.total_bytes)
            stats.update(whole.part_counts())
        return stats

    def close(self) -> None:
        """Cancels outstanding reads and frees buffers no tensor uses. Safe from any thread: it
        never waits for a ``next()`` in progress, which then raises :class:`StreamClosedError`
        (as does any later ``next()``) unless every tensor had been delivered."""
        self._closed = True
        while True:
            try:
                self._pending.popleft()
            except IndexError:
                break
            self._cut_items += 1
        self._native.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        native = getattr(self, "_native", None)
        if native is not None:
            native.close()


@_options.spelled_out
def stream(
    uri: Uri, *, process_group: Any = None, **options: Unpack[Options]
) -> Stream | DistributedStream:
    """Streams the tensors of a safetensors file, directory of shards or list of files.

    ``uri`` may also name objects in object storage: ``s3://bucket/key`` or a prefix
    ``s3://bucket/model/``, ``gs://``, ``az://``, ``http(s)://``. S3 reads the standard ``AWS_*``
    variables and boto3's ``~/.aws`` files (``AWS_PROFILE``), GCS ``GOOGLE_*`` (and
    ``STORAGE_EMULATOR_HOST``), Azure ``AZURE_STORAGE_*``; ``storage_options`` (object_store keys
    such as ``endpoint``, ``region``, ``access_key_id``, ``secret_access_key``, ``profile``,
    ``service_account``, ``account_name``, ``access_key``, ``connection_string``,
    ``skip_signature``) override them.

    Yields ``(name, tensor)`` as soon as each tensor's bytes have landed. Host memory held by the
    loader stays within ``memory_limit``; a tensor you keep owns its memory and stays valid.
    For a GPU, the device memory of tensors not yet yielded stays within ``memory_limit`` too
    (one knob for what fastload holds that you have not received; the page-locked ring and the
    device memory are each within it), so a slow consumer never piles the checkpoint up on the
    device; tensors you keep are not counted.

    Every wait honours Ctrl-C (KeyboardInterrupt; the reads are cancelled and buffers freed).
    ``close()`` from another thread makes the consumer's ``next()`` raise
    :class:`StreamClosedError` rather than end as if the load were complete.

    ``device``: ``"cpu"`` (the default), ``"cuda"``, ``"cuda:N"`` or a ``torch.device``. For a GPU,
    blocks are read into a reused ring of page-locked buffers (``memory_limit`` bytes) and copied
    asynchronously into memory torch allocates on the device, while later blocks are still being
    read; a tensor is yielded once its copies completed. Its memory belongs to the stream that was
    current when ``stream()`` (or ``load()``) was called. To use it on another stream ``side``, as
    with any torch tensor: ``side.wait_stream(<that stream>)`` before reading it there, and
    ``tensor.record_stream(side)`` before freeing it, or torch may hand the memory out again
    while ``side`` still uses it. Without a CUDA
    driver this raises :class:`FastloadError`. CUDA is never initialised at import.

    ``process_group`` (a ``torch.distributed`` group, or ``"default"`` for the default group):
    the ranks share the reads, each byte is read from storage once and exchanged over the group;
    see :mod:`fastload.distributed`. Every rank must call it and consume the stream to its end.
    """
    _options.check("stream", options)
    if process_group is not None:
        from . import distributed

        return distributed.stream(uri, process_group=process_group, **options)
    return Stream(uri, **options)


@_options.spelled_out
def load(
    uri: Uri, *, process_group: Any = None, **options: Unpack[Options]
) -> dict[str, torch.Tensor]:
    """Loads every tensor (or only ``names``) into a ``dict[str, torch.Tensor]``; the options are
    :func:`stream`'s (:class:`Options`).

    With ``process_group``, the group reads each byte once; see :func:`stream`."""
    _options.check("load", options)
    with stream(uri, process_group=process_group, **options) as s:
        return dict(s)


def load_file(
    filename: str | os.PathLike[str],
    device: Any = "cpu",
    *,
    backend: str = "mmap",
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
) -> dict[str, torch.Tensor]:
    """``safetensors.torch.load_file``: every tensor of ``filename`` (any URI fastload reads) in a
    dict, on ``device`` (``"cpu"``, ``"cuda:N"``, an int for a CUDA ordinal). ``backend`` is
    accepted for safetensors' signature; fastload picks how to read (see ``method``).
    ``keyset``, ``associated_data``: of a Tink-encrypted file, as ``load`` takes them."""
    _safetensors_backend(backend)
    return load(
        filename,
        device=_safetensors_device(device),
        keyset=keyset,
        associated_data=associated_data,
    )


def _safetensors_backend(backend: str) -> None:
    """safetensors' ``backend`` (how it reads): accepted, checked, changes nothing here."""
    if backend not in ("mmap", "pread"):
        raise ConfigError(
            f"invalid option backend: {backend!r} (safetensors takes 'mmap' or 'pread')",
            option="backend",
        )


def _safetensors_device(device: Any) -> Any:
    """safetensors' device spellings: an int is a CUDA ordinal, ``None`` the CPU."""
    if device is None:
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    return device


# Imported on first use (PEP 562): ``import fastload`` stays as cheap as safetensors' own, and
# ``load_file`` (above) needs none of it.
_LAZY = {
    "safe_open": "_safe_open",
    "SafeSlice": "_safe_open",
    "save_file": "_write",
    "save": "_write",
    "copy": "_copy",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'fastload' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def inspect(
    uri: Uri,
    *,
    storage_options: Mapping[str, object] | None = None,
    keyset: str | os.PathLike[str] | None = None,
    associated_data: bytes | str | None = None,
) -> dict[str, Any]:
    """What the checkpoint ``uri`` names holds, from its headers alone (no tensor data is read):
    the object ``fastload inspect --json`` prints, ``{"files": [...], "tensors": [...],
    "total": {...}}``; see the Python API page of the docs for every key. ``keyset``,
    ``associated_data``: of Tink-encrypted files, as ``load`` takes them."""
    text = _fastload.inspect_json(
        _uris(uri),
        storage_options=storage_options,
        keyset=keyset,
        associated_data=associated_data,
    )
    return dict(json.loads(text))


def cache_stats() -> dict[str, Any]:
    """What the local cache (the ``cache=`` option) did in this process so far: ``hits`` (objects
    read from a local copy), ``filled_bytes`` (bytes written while streaming), ``published``
    (copies verified and published), ``disabled_reason`` (why caching was last turned off for a
    load, e.g. a full disk; ``None`` if never).

    A load returns without waiting for its copies to be flushed to disk (and their sha256
    checked); this call waits for them first, and so does the interpreter's exit."""
    return dict(_fastload.cache_stats())


# Copies filled by loads that returned are published before the process ends.
atexit.register(_fastload.cache_stats)


def cached_memory() -> dict[str, int]:
    """Bytes of host memory fastload keeps for the next load: ``{"host": ..., "pinned": ...}``.

    Loads reuse their buffers: freed host buffers (up to ``memory_limit``) and the ring of
    page-locked staging buffers of GPU loads stay with the process, so a second load neither
    faults in fresh pages nor pins memory again. See :func:`release_memory`."""
    return dict(_fastload.cached_memory())


def release_memory() -> dict[str, int]:
    """Gives the memory :func:`cached_memory` counts back (to the OS, and page-locked memory to
    the CUDA driver); returns the bytes given back, by kind.

    For a process that loads once, such as an inference server after its weights are in place
    (the vLLM loader calls it then). Tensors are not affected; buffers a running load still uses
    are freed, not kept, when it is done with them; the next load caches again."""
    return dict(_fastload.release_memory())
