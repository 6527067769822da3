"""Audits for the tests of names that come from data (test_outside.py, test_small_files.py):
what a call wrote on disk, and what it asked servers for, compared with what it may touch.

- `Tree`: every path under a folder (links not followed), taken before and after a call;
  `Tree.created(after)` lists what appeared.
- `outside(paths, prefix)`: the request paths (as the server saw them, percent-decoded) that do not
  lie under `prefix` once `.` and `..` are resolved, as a server resolving them would.
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse
from collections.abc import Iterable
from pathlib import Path


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
