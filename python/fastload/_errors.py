"""Exceptions raised by fastload. The native module maps every Rust error to one of these.

What a caller may act on is an attribute, not only words in the message: ``ConfigError.option``,
``TensorNotFoundError.names``, ``FormatError.path`` and ``NotFoundError.filename``. The
attributes survive pickling (the distributed loader sends errors between ranks).

When safetensors is installed, every one of them is also a ``safetensors.SafetensorError``, as
``fastload.safe_open`` is a drop-in for ``safetensors.safe_open``: code that catches safetensors'
errors (a missing tensor, a closed file, a bad header, an unknown framework or device) catches
fastload's. safetensors stays optional: without it the base is ``Exception``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar, cast

if TYPE_CHECKING:
    _Base = Exception
else:
    try:
        from safetensors import SafetensorError as _Base
    except Exception:  # not installed, or an install that fails to import: no parity to keep
        _Base = Exception

__all__ = [
    "ConfigError",
    "FastloadError",
    "FormatError",
    "NotFoundError",
    "StorageError",
    "StreamClosedError",
    "TensorNotFoundError",
]


_T = TypeVar("_T")


def _scrub(value: _T) -> _T:
    """``value`` with credentials replaced by ``***`` when it is text (see ``_fastload.scrub``):
    the native module's messages come scrubbed, and so do those raised in Python, which may
    quote a URI with a password or a presigned signature in it."""
    if not isinstance(value, str):
        return value
    try:
        from ._fastload import scrub
    except ImportError:  # the native module failed to import: its error is the one to show
        return value
    return cast(_T, scrub(value))


class FastloadError(_Base):
    """Base class of every error fastload raises (a ``safetensors.SafetensorError`` where
    safetensors is installed). Its text arguments, and the attributes its subclasses name files
    by, are scrubbed of credentials."""

    def __init__(self, *args: object) -> None:
        super().__init__(*(_scrub(a) for a in args))


class FormatError(FastloadError, ValueError):
    """A file is not a valid safetensors file; the message names the file and the problem.

    ``path``: the file (or index file) at fault, when known. ``segment``: for an encrypted file
    (``keyset=``), the index of the segment that failed authentication, when one did."""

    def __init__(
        self, message: str, *, path: str | None = None, segment: int | None = None
    ) -> None:
        super().__init__(message)
        self.path = _scrub(path)
        self.segment = segment


class StorageError(FastloadError, OSError):
    """Reading from a disk or an object store failed."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file, directory or object does not exist (``filename`` names it).

    The message reads as safetensors' does (``No such file or directory: PATH``), without the
    ``[Errno 2] ...: 'PATH'`` that ``OSError`` would wrap it in; ``errno`` and ``filename`` are
    set all the same."""

    def __str__(self) -> str:
        return self.strerror if self.strerror else super().__str__()


class TensorNotFoundError(FastloadError, KeyError):
    """Tensors requested with ``names=`` are in none of the files.

    ``names``: the missing names, sorted; ``uri``: where they were looked for."""

    def __init__(self, message: str, *, names: list[str] | None = None, uri: str = "") -> None:
        super().__init__(message)
        self.names = [] if names is None else list(names)
        self.uri = _scrub(uri)

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigError(FastloadError, ValueError):
    """An option or URI that cannot be used, or a name from the checkpoint (an index entry, an
    ``auto_map`` module, a pipeline component, a listed object) that would reach outside it
    (``option`` is then ``"uri"``).

    ``option``: the option at fault (``"block_size"``, ``"uri"``, ``"device"``, an environment
    variable such as ``"FASTLOAD_CONCURRENCY"``, a vLLM extra-config key, ...), when known."""

    def __init__(self, message: str, *, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


class StreamClosedError(FastloadError, ValueError):
    """A stream was closed before it delivered every tensor, and its consumer asked for more: by
    ``close()`` from another thread while this one iterated, by Ctrl-C during a ``next()``, or a
    ``next()`` after such a close. A ``ValueError`` like reading a closed file; the tensors
    already yielded stay valid. A stream that finished, or ended with an error, ends as usual."""


class DestinationExistsError(StorageError, FileExistsError):
    """A write's destination exists and ``overwrite=True`` was not given; ``filename`` names it."""
