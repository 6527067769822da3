"""Exceptions raised by fastload. The native module maps every Rust error to one of these."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "FastloadError",
    "FormatError",
    "NotFoundError",
    "StorageError",
    "TensorNotFoundError",
]


class FastloadError(Exception):
    """Base class of every error fastload raises."""


class FormatError(FastloadError, ValueError):
    """A file is not a valid safetensors file; the message names the file and the problem."""


class StorageError(FastloadError, OSError):
    """Reading from a disk or an object store failed."""


class NotFoundError(StorageError, FileNotFoundError):
    """A file, directory or object does not exist."""


class TensorNotFoundError(FastloadError, KeyError):
    """Tensors requested with ``names=`` are in none of the files."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


class ConfigError(FastloadError, ValueError):
    """An option or URI that cannot be used."""
