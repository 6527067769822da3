"""The page cache, for benchmarks and tests: drop files from it, read them into it, and ask how
much of them it holds. The one copy of these helpers (benches/ and tests/ import it; the Rust
`fastload bench` does the same in src/cli/bench.rs)."""

from __future__ import annotations

import os
import subprocess
from typing import Union

Path = Union[str, "os.PathLike[str]"]


def evict(*paths: Path) -> None:
    """Drops the files' pages from the page cache. Dirty pages cannot be dropped, so each file is
    flushed first (a file just written would otherwise stay cached)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(*paths: Path) -> None:
    """Reads the files once through the page cache."""
    view = memoryview(bytearray(8 << 20))
    for path in paths:
        with open(path, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def resident_bytes(*paths: Path) -> int | None:
    """Bytes of the files in the page cache (util-linux `fincore`), or None if it cannot tell."""
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *map(str, paths)],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        return sum(int(x) for x in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None
