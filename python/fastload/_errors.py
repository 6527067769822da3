"""Exceptions raised by fastload. The native module maps every Rust error to one of these.

What a caller may act on is an attribute, not only words in the message: ``ConfigError.option``,
``TensorNotFoundError.names``, ``FormatError.path`` and ``NotFoundError.filename``. The
attributes survive pickling (the distributed loader sends errors between ranks).
"""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "FastloadError",
    "FormatError",
    "NotFoundError",
    "StorageError",
    "StreamClosedError",
    "TensorNotFoundError",
]


class FastloadError(Exception):
    """Base class of every error fastload raises."""


class FormatError(FastloadError, ValueError):
    """A file is not a valid safetensors file; the message names the file and the problem.

    ``path``: the file (or index file) at fault, when known. ``segment``: for an encrypted file
    (``keyset=``), the index of the segment that failed authentication, when one did."""

    def __init__(
        self, message: str, *, path: str | None = None, segment: int | None = None
    ) -> None:
        super().__init__(message)
        self.path = path
        self.segment = segment


class StorageError(FastloadError, OSError):
    """Reading from a disk or an object store failed."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file, directory or object does not exist (``filename`` names it)."""


class TensorNotFoundError(FastloadError, KeyError):
    """Tensors requested with ``names=`` are in none of the files.

    ``names``: the missing names, sorted; ``uri``: where they were looked for."""

    def __init__(self, message: str, *, names: list[str] | None = None, uri: str = "") -> None:
        super().__init__(message)
        self.names = [] if names is None else list(names)
        self.uri = uri

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigError(FastloadError, ValueError):
    """An option or URI that cannot be used.

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
