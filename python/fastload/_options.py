"""The keyword options of a load, defined once for ``load``, ``stream``, ``Stream`` and
``fastload.distributed.load`` / ``stream``.

Why a ``TypedDict`` taken as ``**options: Unpack[Options]`` (PEP 692) rather than seven keyword
parameters in each of six signatures: one class says which options exist and what each takes, and
type checkers still check every call's keywords and value types against it (mypy, pyright).
``Unpack`` comes from ``typing_extensions`` under ``TYPE_CHECKING`` only (type checkers ship it):
the package keeps no runtime dependency and runs on Python 3.9, where ``typing`` has no
``Unpack``. At run time an unknown keyword raises ``TypeError``, as a plain signature would
(:func:`check`), and :func:`spelled_out` gives each function the signature it would have with the
options written out, so ``help()``, ``inspect.signature`` and tools that introspect at run time
(notebooks, ``benches/run.py``) still see every option, its type and its default. Considered and
not taken: an options object (callers would build one instead of passing keywords: a breaking
change), and a decorator that copies one function's signature onto others (mypy cannot see
through it).

Values are converted and checked by the native module (each shape one ``FromPyObject`` type in
``src/python/args.rs``); environment variables and defaults live in Rust (``src/options.rs``) and
Python copies none of them.

Which options exist is defined once too: the table ``OPTIONS`` in ``src/options.rs``, exported as
``_fastload.OPTIONS`` (each option's name, annotation, signature default, default, environment
variable, help and the places that take it). The written-out signatures, :data:`OPTIONS`,
:func:`native` and the engines' extra-config keys (:func:`taken_by`) are built from it at import;
what must stay written out for type checkers and readers (:class:`Options`, the ``.pyi``, README's
table, ``SafeOpenOptions``) is checked against it by ``tests/test_options.py``
(``test_option_list_*``), which names the place that differs.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, TypeVar, Union

from . import _fastload
from ._errors import ConfigError

if TYPE_CHECKING:
    from types import EllipsisType

    import torch
else:
    EllipsisType = type(Ellipsis)

    class _Torch:
        """Stands for the ``torch`` module in this module's annotations at run time, importing it
        only when something resolves them (``typing.get_type_hints(fastload.Options)``), so that
        ``import fastload`` never imports torch; ``Any`` where torch is not installed."""

        def __getattr__(self, name: str) -> Any:
            try:
                import torch
            except ImportError:
                return Any
            return getattr(torch, name)

    torch = _Torch()

Device = Union[str, "torch.device"]
Size = Union[int, str]
# One index of a part (``parts=``): an int, a slice of ints (steps >= 1) or ``...``; a tuple of
# them indexes several dims.
IndexItem = Union[int, slice, "EllipsisType"]
Index = Union[IndexItem, "tuple[IndexItem, ...]"]


class Options(TypedDict, total=False):
    """Options of a load, all keyword-only and optional.

    ``device``: ``"cpu"`` (default), ``"cuda"``, ``"cuda:N"`` or a ``torch.device``.
    ``concurrency``: reads in flight, an int >= 1; default ``FASTLOAD_CONCURRENCY``, else 16
    (64 when any URI is an object store).
    ``block_size``: bytes per read, an int or a size such as ``"8MiB"``; default
    ``FASTLOAD_BLOCK_SIZE``, else 8 MiB (4 KiB to 1 GiB).
    ``memory_limit``: host buffer bytes the loader may hold at once, an int or ``"1GiB"``; default
    ``FASTLOAD_MEMORY_LIMIT``, else 1 GiB (at least 1 MiB).
    ``names``: load only these tensors (any iterable of str, or one str for one tensor;
    duplicates are ignored); default every tensor.
    ``parts``: load only a part of these tensors, ``{name: index}``: ``index`` as torch's basic
    indexing takes it, with ints, slices of ints (steps >= 1; bounds clamped as torch clamps
    them) and one ``...`` (a tuple of them for several dims), e.g. ``{"w": (slice(None),
    slice(0, 2048))}`` for ``w[:, 0:2048]``. Each part comes back bitwise equal to indexing the
    whole tensor, and only the bytes it needs are read. Tensors without a part load whole (every
    tensor, or ``names``, which must then include each part's tensor). Anything else is refused
    with ``ConfigError`` (``option="parts"``) before anything is read.
    ``method``: how local files are read: ``"auto"`` (default, ``FASTLOAD_METHOD``: to CPU, maps
    files on a local filesystem and reads files on network and FUSE filesystems; to a GPU, reads
    into page-locked staging buffers), ``"mmap"``, ``"read"`` or ``"direct"``;
    ``stats()["method_reason"]`` says why a method ran. To a GPU, ``"mmap"`` has the device copy
    the files' mapped pages where they are (page-locked in place, read-only: no copy out of the
    page cache), falling back to staging buffers where it cannot (``stats()["lend_refused"]``
    says why). ``"direct"`` reads blocks that are not in the page cache around it (``O_DIRECT``)
    straight into the buffers ``"read"`` uses (to a GPU, the page-locked staging buffers),
    cached blocks as ``"read"`` does, falling back to ``"read"`` where a file cannot
    (``stats()["direct_refused"]`` says why).
    ``copy_streams``: copy queues of a GPU load (CUDA streams, 1 to 16): blocks are copied to
    the device on each in turn, so that more than one of its copy engines may run at once;
    default ``FASTLOAD_COPY_STREAMS``, else 1. CPU loads copy nothing and ignore it.
    ``storage_options``: object-store settings (``endpoint``, ``region``, ``access_key_id``, ...)
    that override the environment; values are converted with ``str()``.
    ``cache``: keep a local copy of remote objects, written while they stream: ``True`` (the
    default directory, ``$XDG_CACHE_HOME/fastload`` or ``~/.cache/fastload``; Hub files go to the
    Hugging Face cache), a directory (``str`` or ``os.PathLike``), ``False`` (off); default
    ``FASTLOAD_CACHE`` (``0``/``1`` or a directory), else off. A later load of the same object
    (same ETag or sha256) reads the copy.
    ``verify``: ``True`` checks the sha256 of every object whose store gives one (Hugging Face
    Hub LFS files) wherever its bytes come from (the network, the Hugging Face cache, a cached
    copy), and S3, GCS and Azure objects against the whole-object checksum their store keeps
    (CRC64NVME, CRC32C, sha256, MD5); a mismatch raises ``StorageError`` (a bad cached copy is
    removed and read again from the network); default ``FASTLOAD_VERIFY`` (``0``/``1``), else off.
    ``keyset``: the files are encrypted with Tink's streaming AEAD (``AES256_GCM_HKDF_1MB``):
    a cleartext JSON keyset, or the path of a file holding one (``str`` or ``os.PathLike``);
    default ``FASTLOAD_KEYSET``, else the files are read as they are. Never shown in messages.
    ``associated_data``: the associated data they were encrypted with (``bytes`` or ``str``);
    default empty.
    ``peers``: serves (``fastload serve``) holding the same files, ``"host:port"`` or
    ``"https://host:port"`` (a list, or one ``str`` comma-separated); default ``FASTLOAD_PEERS``.
    A file is read from the first peer that lists its origin's pinned version, the rest of a
    read from the next peer or the origin when one fails (docs/peers.md).
    ``peer_token``: the bearer token the peers take; default ``FASTLOAD_PEER_TOKEN``. Never shown.

    ``None`` for any of them means "not given".
    """

    device: Device
    concurrency: int | None
    block_size: Size | None
    memory_limit: Size | None
    names: Iterable[str] | None
    parts: Mapping[str, Index] | None
    method: str | None
    copy_streams: int | None
    storage_options: Mapping[str, object] | None
    cache: bool | str | os.PathLike[str] | None
    verify: bool | None
    keyset: str | os.PathLike[str] | None
    associated_data: bytes | str | None
    peers: Sequence[str] | str | None
    peer_token: str | None


OPTIONS: frozenset[str] = frozenset(o.name for o in _fastload.OPTIONS)


def taken_by(taker: str) -> tuple[str, ...]:
    """The options ``taker`` takes, in table order: ``"native"`` (``_fastload.Stream`` and
    ``resolve_options``), ``"reader"`` (``_fastload.Reader``), ``"safe_open"`` or
    ``"extra_config"`` (the vLLM and SGLang loaders' ``model_loader_extra_config``)."""
    return tuple(o.name for o in _fastload.OPTIONS if taker in o.takes)


_NATIVE = frozenset(taken_by("native"))


def check(function: str, options: Mapping[str, Any], allowed: Iterable[str] | None = None) -> None:
    """Raises the ``TypeError`` a signature with exactly these keywords (``allowed``, default
    every option) would raise."""
    allowed = OPTIONS if allowed is None else frozenset(allowed)
    for key in options:
        if key not in allowed:
            raise TypeError(f"{function}() got an unexpected keyword argument {key!r}")


def native(options: Mapping[str, Any]) -> dict[str, Any]:
    """The options the native loader takes (``taken_by("native")``: all but ``device``, which
    torch resolves)."""
    return {k: v for k, v in options.items() if k in _NATIVE}


# bytes: a Linux path that need not be UTF-8.
PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
Uri = Union[PathLike, Iterable[PathLike]]


def path_str(u: object, accepted: str) -> str:
    """A path or URI as a ``str`` (an ``os.PathLike`` by its path, ``bytes`` decoded as the file
    system does); anything else a ``ConfigError`` saying what is ``accepted``."""
    if isinstance(u, os.PathLike):
        u = os.fspath(u)
    if isinstance(u, bytes):
        u = os.fsdecode(u)
    if not isinstance(u, str):
        raise ConfigError(
            f"invalid option uri: expected a path or URI {accepted}, got {type(u).__name__}",
            option="uri",
        )
    return u


F = TypeVar("F", bound=Callable[..., Any])


def spelled_out(function: F) -> F:
    """Sets ``function.__signature__`` to its own signature with ``**options`` replaced by one
    keyword-only parameter per option of ``_fastload.OPTIONS``, in its order, with its
    annotation (written as :class:`Options` writes it) and signature default (``"cpu"`` for
    ``device``, ``None``, "not given", for the rest). Type checkers see the function
    unchanged."""
    own = inspect.signature(function)
    kept = [p for p in own.parameters.values() if p.kind is not p.VAR_KEYWORD]
    added = [
        inspect.Parameter(
            o.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=o.signature_default,
            # A string, as the function's own (postponed) annotations are.
            annotation=o.type,
        )
        for o in _fastload.OPTIONS
    ]
    function.__signature__ = own.replace(parameters=kept + added)  # type: ignore[attr-defined]
    return function
