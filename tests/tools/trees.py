"""Small source trees written for the tests of the repository's checks (scripts/check_*.py)."""

from __future__ import annotations

from pathlib import Path


def write_tree(root: Path, files: dict[str, str], scripts: dict[str, str] | None = None) -> Path:
    """`files` written under `root` (by their relative paths, folders made as needed), and
    `scripts` (a check's list of allowed exceptions) under `root`/scripts; returns `root`."""
    for name, text in {**files, **{f"scripts/{k}": v for k, v in (scripts or {}).items()}}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root
