#!/usr/bin/env python3
"""Sizes a reader can hold: no function in src/ or python/fastload/ over 80 lines, no file over 700.

A function counts from the line of its `fn`/`def` to the line that closes it (a nested function
or class counts in its own and in the one around it). A Rust file counts its lines but those of
its tests: `#[cfg(test)] mod tests { … }` blocks and the files such a declaration names
(`#[cfg(test)] mod tests;`), with theirs. Left out: the tests under tests/, Python's generated
stub (`_fastload.pyi`, only `.py` files are read), the benches and the fuzz targets.

One size is kept on purpose with a marker, a comment with its reason on one line:

    // size: one table of every scheme, read top to bottom      (Rust; `# size: …` in Python)

directly above a function (comments, attributes and decorators may come between) keeps that
function; anywhere else it keeps the file. A marker without a reason, or on something within
its limit, fails: the marker goes when the size does.

Sizes known to be cut by a planned step are listed in `scripts/size_allowed.txt`, one
`path  # why` (a file) or `path::name  # why` (its functions of that name; Python's nested names
as `outer.inner`, methods as `Class.method`) a line. An entry within its limit fails, so the list
only shrinks.

    python3 scripts/check_sizes.py              # check: every size over its limit, and why
    python3 scripts/check_sizes.py --all        # also list the largest within their limits
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from check_modules import IDENT, strip

MAX_FUNCTION = 80
MAX_FILE = 700

ROOT = Path(__file__).resolve().parent.parent
ALLOWED_NAME = "size_allowed.txt"
MARKER = re.compile(r"^\s*(?://|#)\s*size:(.*)$")


@dataclass
class Function:
    name: str
    line: int  # of its `fn` / `def`
    lines: int


@dataclass
class Measured:
    path: str  # relative to the root
    lines: int  # the file's, its tests left out
    functions: list[Function]
    markers: dict[int, str]  # line -> reason


# ---------------------------------------------------------------------------------------------
# Rust


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _close(code: str, open_at: int) -> int:
    """The position of the `}` that closes the `{` at `open_at` (the end if none does)."""
    depth = 0
    for i in range(open_at, len(code)):
        if code[i] == "{":
            depth += 1
        elif code[i] == "}":
            depth -= 1
            if depth == 0:
                return i
    return len(code) - 1


def _body_start(code: str, start: int) -> int | None:
    """Where the body of the function whose signature starts at `start` opens: its first `{`
    outside parentheses and brackets; `None` for a declaration (`fn f();` in a trait)."""
    depth = 0
    for i in range(start, len(code)):
        c = code[i]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth == 0 and c == "{":
            return i
        elif depth == 0 and c == ";":
            return None
    return None


def test_spans(code: str) -> list[tuple[int, int]]:
    """The `#[cfg(test)] mod x { … }` blocks of stripped `code`, as position spans."""
    spans = []
    for m in re.finditer(
        r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+" + IDENT + r"\s*\{", code
    ):
        spans.append((m.start(), _close(code, m.end() - 1)))
    return spans


def test_files(src: Path) -> set[Path]:
    """The files that `#[cfg(test)] mod x;` declarations name, and every file below them."""
    out: set[Path] = set()
    for f in sorted(src.rglob("*.rs")):
        code = strip(f.read_text())
        here = f.parent if f.name in ("mod.rs", "lib.rs", "main.rs") else f.with_suffix("")
        for m in re.finditer(
            r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", code
        ):
            name = m.group(1)
            out.update(c for c in (here / f"{name}.rs", here / name / "mod.rs") if c.exists())
            if (here / name).is_dir():
                out.update((here / name).rglob("*.rs"))
    return out


def measure_rust(path: Path, rel: str) -> Measured:
    raw = path.read_text()
    code = strip(raw)
    spans = test_spans(code)
    tests = {line for a, b in spans for line in range(_line_of(code, a), _line_of(code, b) + 1)}
    functions = []
    for m in re.finditer(r"\bfn\s+(" + IDENT + r")", code):
        if any(a <= m.start() <= b for a, b in spans):
            continue
        body = _body_start(code, m.end())
        if body is None:
            continue
        first, last = _line_of(code, m.start()), _line_of(code, _close(code, body))
        functions.append(Function(m.group(1), first, last - first + 1))
    lines = raw.count("\n") + (not raw.endswith("\n") and bool(raw))
    return Measured(rel, lines - len(tests), functions, markers(raw))


# ---------------------------------------------------------------------------------------------
# Python


def measure_python(path: Path, rel: str) -> Measured:
    raw = path.read_text()
    functions: list[Function] = []

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                end = child.end_lineno or child.lineno
                functions.append(Function(name, child.lineno, end - child.lineno + 1))
                walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                walk(child, prefix + child.name + ".")
            else:
                walk(child, prefix)

    walk(ast.parse(raw, filename=rel), "")
    return Measured(rel, len(raw.splitlines()), functions, markers(raw))


# ---------------------------------------------------------------------------------------------
# Markers and the allowed list


def markers(raw: str) -> dict[int, str]:
    return {
        n: m.group(1).strip()
        for n, line in enumerate(raw.splitlines(), 1)
        if (m := MARKER.match(line))
    }


def marked_function(raw_lines: list[str], line: int) -> int | None:
    """The line of the function a marker on `line` stands above, if it stands above one."""
    for n in range(line, len(raw_lines)):
        text = raw_lines[n].strip()
        if not text or text.startswith(("//", "#[", "#!", "@", "#")):
            continue
        return n + 1 if re.match(r"(?:[\w()]+\s+)*(?:fn|def)\s+" + IDENT, text) else None
    return None


def read_allowed(path: Path) -> tuple[dict[str, str], list[str]]:
    """Entries (`path` or `path::name`) -> why, and the problems of the list's lines."""
    allowed: dict[str, str] = {}
    problems = []
    if not path.exists():
        return allowed, problems
    for n, line in enumerate(path.read_text().splitlines(), 1):
        body, _, why = line.partition("#")
        body = body.strip()
        if not body:
            continue
        if " " in body or not why.strip():
            problems.append(
                f"{path.name}:{n}: expected `path  # why` or `path::name  # why`, got {line!r}"
            )
            continue
        allowed[body] = why.strip()
    return allowed, problems


def files(root: Path) -> list[tuple[Path, str]]:
    src, py = root / "src", root / "python" / "fastload"
    skip = test_files(src) if src.exists() else set()
    rust = [f for f in sorted(src.rglob("*.rs")) if f not in skip] if src.exists() else []
    python = sorted(py.rglob("*.py")) if py.exists() else []
    return [(f, str(f.relative_to(root))) for f in [*rust, *python]]


@dataclass
class Verdict:
    over: list[str] = field(default_factory=list)  # sizes over a limit, nothing keeping them
    kept: list[str] = field(default_factory=list)  # sizes over a limit, with why
    problems: list[str] = field(default_factory=list)  # markers and entries out of place
    used: set[str] = field(default_factory=set)  # the allowed list's entries that keep a size


def split_markers(m: Measured, raw_lines: list[str], v: Verdict) -> tuple[dict, tuple | None]:
    """`m`'s markers: those above a function (by the function's line), and the file's."""
    by_function: dict[int, tuple[int, str]] = {}
    file_marker = None
    for line, reason in m.markers.items():
        if not reason:
            v.problems.append(f"{m.path}:{line}: a size marker needs its reason on its line")
            continue
        target = marked_function(raw_lines, line)
        if target is None:
            file_marker = (line, reason)
        else:
            by_function[target] = (line, reason)
    return by_function, file_marker


def judge(what: str, size: int, limit: int, marker, entry: str, allowed, v: Verdict) -> None:
    """One size against its limit: over it, kept by a marker or an allowed entry, or a marker
    that is not needed."""
    if size <= limit:
        if marker:
            v.problems.append(f"{what}: {size} lines, within {limit}: remove its size marker")
        return
    where = f"{what}: {size} lines (over {limit})"
    if marker:
        v.kept.append(f"{where}: {marker[1]}")
    elif entry in allowed:
        v.used.add(entry)
        v.kept.append(f"{where}: allowed for now: {allowed[entry]}")
    else:
        v.over.append(where)


def check(root: Path, show_all: bool = False) -> int:
    allowed, problems = read_allowed(root / "scripts" / ALLOWED_NAME)
    v = Verdict(problems=problems)
    largest: list[tuple[int, str]] = []
    for path, rel in files(root):
        m = measure_rust(path, rel) if path.suffix == ".rs" else measure_python(path, rel)
        by_function, file_marker = split_markers(m, path.read_text().splitlines(), v)
        for f in m.functions:
            largest.append((f.lines, f"{rel}:{f.line} {f.name}"))
            marker = by_function.pop(f.line, None)
            what = f"{rel}:{f.line} {f.name}"
            judge(what, f.lines, MAX_FUNCTION, marker, f"{rel}::{f.name}", allowed, v)
        for line, _ in by_function.values():
            v.problems.append(f"{rel}:{line}: size marker above no function it could keep")
        judge(rel, m.lines, MAX_FILE, file_marker, rel, allowed, v)
    for entry in sorted(set(allowed) - v.used):
        v.problems.append(f"{ALLOWED_NAME}: {entry} is within its limit (or gone): remove it")
    if show_all:
        print(f"Largest functions (limit {MAX_FUNCTION} lines):")
        for lines, what in sorted(largest, reverse=True)[:15]:
            print(f"  {lines:5}  {what}")
    for title, items in [
        ("Kept over the limits, with their reasons:", v.kept),
        ("Over the limits (cut them, or keep one with a `size: <reason>` marker):", v.over),
        ("Problems:", v.problems),
    ]:
        if items:
            print(title + "".join(f"\n  {i}" for i in items))
    if v.over or v.problems:
        return 1
    print(f"sizes: no function over {MAX_FUNCTION} lines, no file over {MAX_FILE} but those kept")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--root", type=Path, default=ROOT, help="the tree to read (default: this repository)"
    )
    ap.add_argument("--all", action="store_true", help="also list the largest functions")
    args = ap.parse_args()
    return check(args.root.resolve(), args.all)


if __name__ == "__main__":
    sys.exit(main())
