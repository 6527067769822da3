"""Type stubs for the native module (checked against it by `mypy.stubtest` in CI)."""

from collections.abc import Callable
from typing import Any, final

__all__ = [
    "Stream",
    "__version__",
    "cached_memory",
    "cli_main",
    "cuda_device_count",
    "inspect",
    "parse_size",
    "release_memory",
]

__version__: str

_Item = tuple[str, str, tuple[int, ...], Any]
_Piece = tuple[str, str, tuple[int, ...], Any, int]

@final
class Stream:
    def __new__(
        cls,
        uris: list[str],
        *,
        concurrency: Any = None,
        block_size: Any = None,
        memory_limit: Any = None,
        names: list[str] | None = None,
        method: str | None = None,
        storage_options: dict[str, Any] | None = None,
        parts: list[tuple[str, int, int]] | None = None,
        target: str | None = None,
        allocate: Callable[[list[int]], tuple[int | None, list[tuple[Any, int]]]] | None = None,
    ) -> Stream: ...
    def __iter__(self) -> Stream: ...
    # (name, dtype, shape, capsule), or with `parts` (name, "U8", (len,), capsule, begin); with
    # `target`, the owner object `allocate` returned takes the capsule's place.
    def __next__(self) -> list[_Item | _Piece]: ...
    def close(self) -> None: ...
    def stats(self) -> dict[str, Any]: ...

def parse_size(value: str) -> int: ...
def cli_main(argv: list[str]) -> int: ...
def cuda_device_count() -> int: ...
def inspect(
    uris: list[str], *, storage_options: dict[str, Any] | None = None
) -> list[dict[str, Any]]: ...
def cached_memory() -> dict[str, int]: ...
def release_memory() -> dict[str, int]: ...
