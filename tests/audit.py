"""Audits for the tests of names that come from data (test_outside.py, test_small_files.py):
what a call wrote on disk, and what it asked servers for, compared with what it may touch.

- `Tree`: every path under a folder (links not followed), taken before and after a call;
  `Tree.created(after)` lists what appeared.
- `outside(paths, prefix)`: the request paths (as the server saw them, percent-decoded) that do not
  lie under `prefix` once `.` and `..` are resolved, as a server resolving them would.
- `rust_debug(name)`: a name as fastload's refusals quote it (Rust's `{:?}`).
- `HOSTILE_PIECES`: what generated hostile names are made of (the property tests, the soak).
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

# Pieces hostile names are made of: dot segments in every spelling a URL decodes, separators a
# URL or Windows reads as '/', schemes, drives, a query, a fragment, NUL and other controls, white
# space, and plain name parts.
HOSTILE_PIECES = [
    "..", ".", "%2e", "%2E", "%2e%2e", "%252e", "%2f", "%5c", "/", "\\", "//", "C:", "s3:",
    "http://127.0.0.1/", "?", "#", "\0", "\n", "\x7f", "~", "a", "b.safetensors", "ü", " ",
    "-", "_", "model",
]  # fmt: skip


def hostile_name(rng, pieces: int = 8) -> str:
    """A name of 1 to `pieces` hostile pieces drawn by `rng` (a `random.Random`)."""
    return "".join(rng.choice(HOSTILE_PIECES) for _ in range(rng.randint(1, pieces)))


class Tree:
    """The paths under `root`, relative, without following links."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.paths = self._walk()

    def _walk(self) -> set[str]:
        found = set()
        for folder, dirs, files in os.walk(self.root, followlinks=False):
            for name in [*dirs, *files]:
                found.add(os.path.relpath(os.path.join(folder, name), self.root))
        return found

    def created(self, *allowed: Path) -> list[str]:
        """What appeared under the root since this tree was taken, outside the `allowed` folders
        (which may themselves appear)."""
        spared = [os.path.relpath(a, self.root) for a in allowed]
        new = self._walk() - self.paths
        return sorted(p for p in new if not any(p == s or p.startswith(s + os.sep) for s in spared))


def normal(path: str) -> str:
    """A request path as a server resolves it: decoded, `\\` as `/`, dot segments removed."""
    path = urllib.parse.unquote(urllib.parse.urlsplit(path).path).replace("\\", "/")
    return posixpath.normpath("/" + path.lstrip("/"))


def outside(paths: Iterable[str], prefix: str) -> list[str]:
    """The request paths not under `prefix` (a path ending in `/`)."""
    return [p for p in paths if not (normal(p) + "/").startswith(prefix)]


def rust_debug(text: str) -> str:
    """`text` as Rust's `{:?}` writes it (how the refusals quote names), without the quotes."""
    escapes = {"\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"', "\0": "\\0"}
    out = []
    for c in text:
        if c in escapes:
            out.append(escapes[c])
        elif not c.isprintable():
            out.append(f"\\u{{{ord(c):x}}}")
        else:
            out.append(c)
    return "".join(out)
