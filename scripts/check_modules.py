#!/usr/bin/env python3
"""The import graph of the Rust crate under src/: fails on a module cycle, prints the layers.

Every `use crate::…`, `use super::…`, `use self::…` (brace groups expanded), every `crate::x::`,
`super::x` and `self::x` path in code, and every path through a child module that the file
declares (`local::open` in `source/mod.rs`) is resolved to a module and then to a node of the
graph: a top-level module (`plan`, `pipeline`, …), or, for the modules in SPLIT (`source`), one of
its submodules (`source::local`, `source::hub`, …; the module file itself is `source`). Comments,
strings and the crate root (`lib.rs`, which declares and re-exports) are left out; a path through a
name that `lib.rs` re-exports (`crate::Error`) counts as a path to the module it comes from.

The check fails when the graph has a cycle, and when the files do: an import cycle between two
files (`src/cli/report.rs` and `src/cli/verdict.rs`) fails even inside one node; a module's
file and its own submodules' files (which it declares, and which import it as `super::`) are
left out of that one. Edges listed in `scripts/module_cycles_allowed.txt` (`from -> to  # why`,
two nodes or two files) are known to be removed by a planned step and do not count; an allowed
edge that no longer exists fails, so the list only shrinks. It fails too when the layers that
src/lib.rs's crate docs list (one `//! - ` item a layer, lowest first) are not LAYERS below.

    python3 scripts/check_modules.py            # check, print the layers and the edges
    python3 scripts/check_modules.py --edges    # only the edges, one `from -> to` a line
    python3 scripts/check_modules.py --dot      # Graphviz of the graph (back edges red)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src"
ALLOWED = ROOT / "scripts" / "module_cycles_allowed.txt"

# Modules whose submodules are nodes of their own.
SPLIT = {"source"}

# The layers, lowest first: a module may import its own layer and the ones below. Shared leaves
# (errors, options, caps on whole reads, the runtime, per-process state, the scheme table and the
# cipher both directions use) serve every stage above the format. Nodes not listed (a new
# module) are reported.
LAYERS: list[tuple[str, list[str]]] = [
    ("format", ["format"]),
    (
        "shared leaves",
        ["arguments", "error", "options", "bounded", "runtime", "per_process", "uri", "tink"],
    ),
    ("memory", ["memory"]),
    # The object-store clients (a URI and storage options to a store) both directions build.
    ("object stores", ["store"]),
    # Reading and writing side by side, never importing each other (APART).
    ("source and sink", ["source", "source::*", "object", "hub", "cache", "sink"]),
    # Reads sources, writes sinks.
    ("copy", ["copy"]),
    ("plan", ["plan", "regions", "ranges", "ranks"]),
    ("device", ["device"]),
    ("pipeline", ["pipeline"]),
    # `fastload serve`: reads sources (and the write path's listing), holds files in the device
    # layer's page-locked memory; only the CLI runs it.
    ("serve", ["serve"]),
    ("bindings and CLI", ["python", "cli"]),
]

# Nodes that never import each other, whatever their layers (`x::*`: x's submodules): the two
# directions of the data meet only above both (`copy`) and in the leaves below both (`uri`,
# `tink`, `store`).
APART: list[tuple[str, str]] = [("source", "sink"), ("source::*", "sink")]
# The imports across APART kept for now, each with its reason; one that is gone fails (the
# list only shrinks).
APART_KEPT: dict[tuple[str, str], str] = {}

IDENT = r"[A-Za-z_][A-Za-z0-9_]*"


def matches(node: str, pattern: str) -> bool:
    return node == pattern or (pattern.endswith("::*") and node.startswith(pattern[:-1]))


def check_apart(nodes: set[str], edges: set[tuple[str, str]]) -> bool:
    """Whether no import joins an APART pair but those APART_KEPT lists (all still there, where
    the crate has both modules)."""
    ok = True
    for a, b in sorted(edges):
        crossing = any(
            (matches(a, x) and matches(b, y)) or (matches(a, y) and matches(b, x)) for x, y in APART
        )
        if crossing and (a, b) not in APART_KEPT:
            print(f"\n{a} -> {b}: these two never import each other (APART)")
            ok = False
    for (a, b), why in APART_KEPT.items():
        if {a, b} <= nodes and (a, b) not in edges:
            print(f"\n{a} -> {b} is gone: remove it from APART_KEPT")
            ok = False
        elif (a, b) in edges:
            print(f"\nkept across APART until it goes: {a} -> {b} ({why})")
    return ok


def layer_of(node: str) -> int | None:
    for i, (_, members) in enumerate(LAYERS):
        for m in members:
            if m == node or (m.endswith("::*") and node.startswith(m[:-1])):
                return i
    return None


# ---------------------------------------------------------------------------------------------
# Reading the source


def strip(code: str) -> str:
    """`code` with comments, string and char literals blanked (newlines kept)."""
    out: list[str] = []
    i, n = 0, len(code)
    while i < n:
        c = code[i]
        if code.startswith("//", i):
            j = code.find("\n", i)
            j = n if j < 0 else j
            i = j
            continue
        if code.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if code.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif code.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            out.append(re.sub(r"[^\n]", " ", code[i:j]))
            i = j
            continue
        m = (
            re.match(r'b?r(#*)"', code[i:])
            if c in "br" and (i == 0 or not code[i - 1].isalnum())
            else None
        )
        if m:
            end = '"' + m.group(1)
            j = code.find(end, i + m.end())
            j = n if j < 0 else j + len(end)
            out.append('""' + re.sub(r"[^\n]", " ", code[i + 2 : j]))
            i = j
            continue
        if c == '"':
            j = i + 1
            while j < n and code[j] != '"':
                j += 2 if code[j] == "\\" else 1
            out.append('""' + re.sub(r"[^\n]", " ", code[i + 2 : j + 1]))
            i = j + 1
            continue
        if c == "'":
            m = re.match(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'", code[i:])
            if m:
                out.append("' '")
                i += m.end()
                continue
        out.append(c)
        i += 1
    return "".join(out)


@dataclass
class Module:
    path: tuple[str, ...]  # ("source", "hub")
    file: Path
    test: bool = False
    children: set[str] = field(default_factory=set)


def module_path(file: Path) -> tuple[str, ...]:
    rel = file.relative_to(SRC).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] in ("mod", "lib"):
        parts.pop()
    return tuple(parts)


def split_use_tree(tree: str) -> list[str]:
    """`a::{b, c::{d, e as f}}` -> [a::b, a::c::d, a::c::e]; `self` in a group names the prefix."""
    tree = re.sub(r"\s+as\s+" + IDENT, "", tree)
    tree = re.sub(r"\s+", "", tree)

    def expand(prefix: str, t: str) -> list[str]:
        i = t.find("{")
        if i < 0:
            full = prefix + t
            return [full.removesuffix("::self")]
        head, body = t[:i], t[i + 1 : t.rindex("}")]
        parts, depth, cur = [], 0, ""
        for ch in body:
            if ch == "," and depth == 0:
                parts.append(cur)
                cur = ""
                continue
            depth += ch == "{"
            depth -= ch == "}"
            cur += ch
        parts.append(cur)
        return [x for p in parts if p for x in expand(prefix + head, p)]

    return expand("", tree)


class Graph:
    def __init__(self) -> None:
        self.modules: dict[tuple[str, ...], Module] = {}
        for f in sorted(SRC.rglob("*.rs")):
            if f.name == "main.rs" and f.parent == SRC:
                continue  # the binary: a crate of its own
            p = module_path(f)
            self.modules[p] = Module(p, f)
        for p in self.modules:
            if p:
                self.modules[p[:-1]].children.add(p[-1]) if p[:-1] in self.modules else None
        self.reexports: dict[str, tuple[str, ...]] = {}
        # edges[(from, to)] = list of "file:line (test)" sites
        self.edges: dict[tuple[str, str], list[str]] = defaultdict(list)
        # The same between files (`src/cli/report.rs`), leaving out a module's imports of its
        # own submodules and theirs of it (`super::`): a parent and its children are one unit.
        self.file_edges: dict[tuple[str, str], list[str]] = defaultdict(list)
        self._mark_tests()
        lib = self.modules[()]
        for use in re.finditer(r"pub\s+use\s+([^;]+);", strip(lib.file.read_text())):
            for full in split_use_tree(use.group(1)):
                segs = full.split("::")
                if segs[0] == "crate":
                    segs = segs[1:]
                if segs and segs[0] in lib.children:
                    self.reexports[segs[-1]] = tuple(segs[:-1])
        for m in self.modules.values():
            if m.path:
                self._scan(m)

    def _mark_tests(self) -> None:
        for m in self.modules.values():
            code = strip(m.file.read_text())
            for d in re.finditer(
                r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+(" + IDENT + r")\s*;", code
            ):
                child = self.modules.get((*m.path, d.group(1)))
                if child:
                    child.test = True
        for m in sorted(self.modules.values(), key=lambda m: len(m.path)):
            if m.path[:-1] in self.modules and self.modules[m.path[:-1]].test:
                m.test = True

    def node(self, path: tuple[str, ...]) -> str | None:
        if not path:
            return None
        if path[0] in SPLIT and len(path) > 1 and path[:2] in self.modules:
            return f"{path[0]}::{path[1]}"
        return path[0]

    def _resolve(
        self, segs: list[str], here: tuple[str, ...], children: set[str]
    ) -> tuple[str, ...] | None:
        """The module a path starting with `segs` reaches, from module `here`."""
        if not segs:
            return None
        if segs[0] == "crate":
            rest = segs[1:]
            if rest and rest[0] in self.reexports and rest[0] not in self.modules[()].children:
                return self.reexports[rest[0]]
            base: list[str] = []
        elif segs[0] == "super":
            base = list(here)
            rest = segs
            while rest and rest[0] == "super":
                base = base[:-1]
                rest = rest[1:]
        elif segs[0] == "self":
            base, rest = list(here), segs[1:]
        elif segs[0] in children:
            base, rest = list(here), segs
        else:
            return None
        # Walk as deep as real modules go: the rest are items.
        for s in rest:
            if tuple([*base, s]) in self.modules:
                base.append(s)
            else:
                break
        return tuple(base)

    def _scan(self, m: Module) -> None:
        code = strip(m.file.read_text())
        # Inline modules (`mod tests { … }`): where each opens and closes.
        stack: list[tuple[str, int, bool]] = []  # (name, depth at open, test)
        depth = 0
        spans: list[tuple[int, int, tuple[str, ...], bool]] = []
        starts: dict[int, tuple[str, bool]] = {}
        for d in re.finditer(
            r"(#\[cfg\(test\)\]\s*)?(?:pub(?:\([^)]*\))?\s+)?\bmod\s+(" + IDENT + r")\s*\{", code
        ):
            starts[d.end() - 1] = (d.group(2), bool(d.group(1)))
        seg_start = 0
        cur: tuple[str, ...] = m.path
        cur_test = m.test
        for i, ch in enumerate(code):
            if ch == "{":
                if i in starts:
                    spans.append((seg_start, i, cur, cur_test))
                    seg_start = i
                    name, test = starts[i]
                    stack.append((name, depth, test))
                    cur = (*cur, name)
                    cur_test = cur_test or test
                depth += 1
            elif ch == "}":
                depth -= 1
                if stack and stack[-1][1] == depth:
                    spans.append((seg_start, i, cur, cur_test))
                    seg_start = i
                    stack.pop()
                    cur = cur[:-1]
                    cur_test = m.test or any(t for _, _, t in stack)
        spans.append((seg_start, len(code), cur, cur_test))
        line_starts = [0] + [i + 1 for i, ch in enumerate(code) if ch == "\n"]

        def line_of(pos: int) -> int:
            lo, hi = 0, len(line_starts)
            while lo + 1 < hi:
                mid = (lo + hi) // 2
                if line_starts[mid] <= pos:
                    lo = mid
                else:
                    hi = mid
            return lo + 1

        src_node = self.node(m.path)
        rel = m.file.relative_to(ROOT)
        for start, end, here, test in spans:
            text = code[start:end]
            children = self.modules[m.path].children if here == m.path else set()
            targets: list[tuple[int, tuple[str, ...] | None]] = []
            used = []
            for u in re.finditer(r"\buse\s+([^;]+);", text):
                used.append((u.start(), u.end()))
                for full in split_use_tree(u.group(1)):
                    targets.append((u.start(), self._resolve(full.split("::"), here, children)))
            names = "|".join(["crate", "super", "self", *sorted(children)])
            for p in re.finditer(
                r"(?<![A-Za-z0-9_:])(?:" + names + r")(?:\s*::\s*" + IDENT + r")+", text
            ):
                if any(a <= p.start() < b for a, b in used):
                    continue
                segs = [s.strip() for s in p.group(0).split("::")]
                targets.append((p.start(), self._resolve(segs, here, children)))
            for pos, target in targets:
                self._file_edge(m, target, f"{rel}:{line_of(start + pos)}" + " (test)" * test)
                to = self.node(target) if target is not None else None
                if to is None or to == src_node:
                    continue
                site = f"{rel}:{line_of(start + pos)}" + (" (test)" if test else "")
                if site not in self.edges[(src_node, to)]:
                    self.edges[(src_node, to)].append(site)

    def _file_edge(self, m: Module, target: tuple[str, ...] | None, site: str) -> None:
        if target is None or target not in self.modules:
            return
        a, b = m.path, target
        if a[: len(b)] == b or b[: len(a)] == a:  # the same file, an ancestor or a descendant
            return
        edge = (self.file_of(a), self.file_of(b))
        if site not in self.file_edges[edge]:
            self.file_edges[edge].append(site)

    def file_of(self, path: tuple[str, ...]) -> str:
        return str(self.modules[path].file.relative_to(ROOT))

    def node_of_file(self, file: str) -> str | None:
        return next((self.node(p) for p in self.modules if p and self.file_of(p) == file), None)


def lib_layers(lib: Path, modules: set[str]) -> list[set[str]]:
    """The layers lib.rs's crate docs list, lowest first: one `//! - ` item a layer, and in each
    the crate's top-level modules it names in backticks (`source::open` names `source`)."""
    items: list[str] = []
    for line in lib.read_text().splitlines():
        if not line.startswith("//!"):
            if items:
                break
            continue
        text = line[3:]
        if text.startswith(" - "):
            items.append(text[3:])
        elif items and text.startswith("   "):
            items[-1] += " " + text.strip()
        elif items:
            break
    names = [re.findall(r"`(" + IDENT + r")(?:::[^`]*)?`", item) for item in items]
    return [{n for n in found if n in modules} for found in names]


def check_lib_layers(g: Graph) -> bool:
    """Whether lib.rs lists the layers of LAYERS, in their order and with their modules; prints
    where the two differ."""
    top = {p[0] for p in g.modules if len(p) == 1}
    # Layers without a module in this crate (a small crate of the tests) drop out of both.
    want = [found for _, members in LAYERS if (found := {m for m in members if m in top})]
    got = [found for found in lib_layers(g.modules[()].file, top) if found]
    if got == want:
        return True
    print(f"\nsrc/lib.rs lists the layers otherwise than LAYERS in {Path(__file__).name}:")
    for i in range(max(len(got), len(want))):
        a = sorted(got[i]) if i < len(got) else []
        b = sorted(want[i]) if i < len(want) else []
        if a != b:
            print(f"  layer {i + 1}: lib.rs {', '.join(a) or '-'}; LAYERS {', '.join(b) or '-'}")
    return False


# ---------------------------------------------------------------------------------------------
# Cycles


def cycles(nodes: set[str], edges: set[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    out: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        out[a].append(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    comps: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(out[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return comps


def shortest_cycle(start: str, edges: list[tuple[str, str]]) -> list[str]:
    """The shortest path from `start` back to itself over `edges`, as its nodes."""
    out: dict[str, list[str]] = defaultdict(list)
    for a, b in edges:
        out[a].append(b)
    came: dict[str, str] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in out[v]:
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(came[path[-1]])
                return [start, *path[::-1][1:], start] if v != start else [start, start]
            if w not in came:
                came[w] = v
                queue.append(w)
    return [start]


def read_allowed() -> list[tuple[str, str, str]]:
    if not ALLOWED.exists():
        return []
    out = []
    for n, line in enumerate(ALLOWED.read_text().splitlines(), 1):
        body, _, why = line.partition("#")
        body = body.strip()
        if not body:
            continue
        m = re.fullmatch(r"(\S+)\s*->\s*(\S+)", body)
        if not m or not why.strip():
            sys.exit(f"{ALLOWED.name}:{n}: expected `from -> to  # why`, got {line!r}")
        out.append((m.group(1), m.group(2), why.strip()))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dot", action="store_true", help="print the graph as Graphviz and stop")
    ap.add_argument("--edges", action="store_true", help="print the edges only and stop")
    ap.add_argument("--sites", action="store_true", help="with each edge, where it is written")
    ap.add_argument("--root", type=Path, help="the crate to read (default: this repository)")
    args = ap.parse_args()
    if args.root:
        global ROOT, SRC, ALLOWED
        ROOT = args.root.resolve()
        SRC, ALLOWED = ROOT / "src", ROOT / "scripts" / "module_cycles_allowed.txt"

    g = Graph()
    nodes = {g.node(p) for p in g.modules if p}
    nodes.discard(None)
    edges = set(g.edges)

    def is_back(a: str, b: str) -> bool:
        la, lb = layer_of(a), layer_of(b)
        return la is not None and lb is not None and lb > la

    if args.edges:
        for a, b in sorted(edges):
            sites = g.edges[(a, b)]
            only_tests = all(s.endswith("(test)") for s in sites)
            note = ("  [back]" if is_back(a, b) else "") + ("  [tests only]" if only_tests else "")
            print(f"{a} -> {b}{note}")
            if args.sites:
                for s in sites:
                    print(f"    {s}")
        return 0

    if args.dot:
        print("digraph modules {\n  rankdir=TB;\n  node [shape=box, fontname=monospace];")
        for i, (name, _) in enumerate(LAYERS):
            members = sorted(n for n in nodes if layer_of(n) == i)
            if members:
                print(f'  subgraph cluster_{i} {{ label="{name}"; rank=same;')
                for n in members:
                    print(f'    "{n}";')
                print("  }")
        for a, b in sorted(edges):
            style = " [color=red, penwidth=2]" if is_back(a, b) else ""
            print(f'  "{a}" -> "{b}"{style};')
        print("}")
        return 0

    failed = False
    print("Modules, top layer first; a module imports only from its own layer and those below:")
    width = max(len(name) for name, _ in LAYERS)
    for i, (name, _) in reversed(list(enumerate(LAYERS))):
        members = sorted(n for n in nodes if layer_of(n) == i)
        print(f"  {name:<{width}}  {', '.join(members)}")
        if i:
            print(f"  {'':<{width}}  |")
    unplaced = sorted(n for n in nodes if layer_of(n) is None)
    if unplaced:
        print(
            f"modules in no layer (add them to LAYERS in {Path(__file__).name}):",
            ", ".join(unplaced),
        )
        failed = True

    failed = not check_lib_layers(g) or failed
    failed = not check_apart(nodes, edges) or failed

    allowed = read_allowed()
    allowed_set = {(a, b) for a, b, _ in allowed}
    back = sorted(e for e in edges if is_back(*e))
    print(f"\n{len(edges)} imports between modules, {len(back)} up the layers")
    for a, b in back:
        failed = failed or (a, b) not in allowed_set
        print(f"  {a} -> {b}  [{', '.join(g.edges[(a, b)][:3])}]")

    if allowed:
        print(f"\nallowed until they are removed ({ALLOWED.relative_to(ROOT)}):")
        for a, b, why in allowed:
            gone = (a, b) not in edges and (a, b) not in g.file_edges
            failed = failed or gone
            note = "GONE: remove it from the list" if gone else why
            print(f"  {a} -> {b}  ({note})")

    remaining = edges - allowed_set
    comps = cycles(nodes, remaining)
    for comp in comps:
        failed = True
        members = set(comp)
        inside = sorted((a, b) for a, b in remaining if a in members and b in members)
        ups = [e for e in inside if is_back(*e)]
        start = ups[0][0] if ups else comp[0]
        loop = shortest_cycle(start, inside)
        print(f"\nmodule cycle among {', '.join(comp)}, for one: {' -> '.join(loop)}")
        for a, b in zip(loop, loop[1:]):
            print(f"  {a} -> {b}  [{', '.join(g.edges[(a, b)][:3])}]")
    file_comps = file_cycles(g, allowed_set)
    if not comps and not file_comps:
        if allowed:
            print(f"\nno module cycle once the {len(allowed)} allowed imports go")
        else:
            print("\nno module cycle")
    return 1 if failed or file_comps else 0


def file_cycles(g: Graph, allowed: set[tuple[str, str]]) -> list[list[str]]:
    """Prints and returns the import cycles between files (a module and its own submodules
    aside), without the allowed edges."""
    # An allowed edge names two files, or two modules (then every edge between their files).
    edges = {
        (a, b)
        for a, b in g.file_edges
        if (a, b) not in allowed and (g.node_of_file(a), g.node_of_file(b)) not in allowed
    }
    comps = cycles({f for e in edges for f in e}, edges)
    for comp in comps:
        inside = sorted((a, b) for a, b in edges if a in comp and b in comp)
        loop = shortest_cycle(comp[0], inside)
        print(f"\nfile import cycle among {', '.join(comp)}, for one: {' -> '.join(loop)}")
        for a, b in zip(loop, loop[1:]):
            print(f"  {a} -> {b}  [{', '.join(g.file_edges[(a, b)][:3])}]")
    return comps


if __name__ == "__main__":
    sys.exit(main())
