"""Checks that what README.md and docs/ refer to exists (run by scripts/test.sh after
`mkdocs build --strict`, which checks the links and anchors between docs pages):

- every repository path they name (`src/source/cache/fill.rs`, `tests/test_hub.py::test_x`,
  `benches/run.py`, `docs/hub.md#errors`, ...) is a file or folder of the repository, and every
  relative link and anchor of README.md resolves (README is not part of the site);
- every `fastload.<name>` Python API they name exists: an attribute of the package, or a
  submodule and a name defined in it (read from its source, so that `fastload.vllm` and
  `fastload.sglang` need neither vLLM nor SGLang installed);
- every `fastload bench --flag` and `fastload inspect --flag` they use appears in that command's
  `--help` (from `python -m fastload._cli`, else `cargo run --quiet --`).

Usage: python scripts/check_docs.py   (exit status 1 and one line per problem when something
does not resolve)
"""

from __future__ import annotations

import ast
import importlib
import re
import subprocess
import sys
import unicodedata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Top-level entries of the repository a path may start with; a word such as `model/` in an
# example is not a repository path.
TOP = ("src/", "tests/", "benches/", "scripts/", "python/", "fuzz/", "docs/", ".ci/")
TOP_FILES = {"README.md", "pyproject.toml", "Cargo.toml", "Cargo.lock", "mkdocs.yml"}
TOP_FILES |= {p.name for p in ROOT.glob("requirements*.txt")}
# A path: a top-level folder then path characters, or a top-level file name.
PATH_RE = re.compile(
    r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./-]*[\w/]"
    r"|(?:" + "|".join(re.escape(f) for f in sorted(TOP_FILES)) + r"))(?:::(\w+))?(?:#([\w-]+))?"
)
API_RE = re.compile(r"\bfastload((?:\.\w+)+)")
FLAG_RE = re.compile(r"\bfastload (bench|inspect)\b([^`\n]*)")
CODE_RE = re.compile(r"`([^`\n]+)`")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
# The bench synopsis and flag table name flags on their own, after `fastload bench`.
BENCH_PAGE = ROOT / "docs" / "cli-bench.md"


def slug(heading: str) -> str:
    """The anchor Python-Markdown's toc extension (and so mkdocs, and near enough GitHub) gives a
    heading."""
    text = re.sub(r"`|\*\*|\[([^]]*)\]\([^)]*\)", r"\1", heading)
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    text = FENCE_RE.sub("", page.read_text(encoding="utf-8"))
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def code_spans(text: str) -> list[str]:
    """Inline code and fenced blocks: where paths, APIs and flags are written."""
    blocks = [m.group(1) for m in FENCE_RE.finditer(text)]
    return blocks + CODE_RE.findall(FENCE_RE.sub("", text))


def ignored(path: str) -> bool:
    """Whether git ignores the path: an output a documented command writes."""
    try:
        out = subprocess.run(["git", "check-ignore", "-q", path], cwd=ROOT, capture_output=True)
    except OSError:
        return False
    return out.returncode == 0


def check_paths(page: Path, text: str, problems: list[str]) -> None:
    for span in [*code_spans(text), *LINK_RE.findall(text)]:
        for m in PATH_RE.finditer(span):
            path, test, anchor = m.group(1), m.group(2), m.group(3)
            target = ROOT / path
            if not target.exists():
                if not ignored(path):  # an output a command writes, e.g. benches/out/
                    problems.append(f"{page.name}: {path}: no such file or folder")
            elif test and not re.search(rf"^\s*(async )?def {test}\b", target.read_text(), re.M):
                problems.append(f"{page.name}: {path}::{test}: no such test")
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                problems.append(f"{page.name}: {path}#{anchor}: no such heading")


def check_readme_links(problems: list[str]) -> None:
    """README.md is outside the site: its relative links and anchors are checked here."""
    readme = ROOT / "README.md"
    for link in LINK_RE.findall(FENCE_RE.sub("", readme.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path if path else readme
        if not target.exists():
            problems.append(f"README.md: link {link}: no such file")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            problems.append(f"README.md: link {link}: no such heading")


def defined_names(module: Path) -> set[str]:
    tree = ast.parse(module.read_text(encoding="utf-8"))
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
            if node.name == "__getattr__":  # names a module builds on first use (PEP 562)
                names |= {
                    c.value
                    for c in ast.walk(node)
                    if isinstance(c, ast.Constant) and isinstance(c.value, str)
                }
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


def api_exists(package: object, dotted: list[str]) -> bool:
    """`fastload.a.b...`: an attribute chain of the package, or a submodule (its file under
    python/fastload/) and a name defined in it, then attributes of that if importable."""
    obj = package
    for i, part in enumerate(dotted):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if i == 0:
            # A submodule: read, not imported (fastload.vllm and fastload.sglang import their
            # frameworks); the name after it must be defined there.
            module = ROOT / "python" / "fastload" / f"{part}.py"
            return module.exists() and all(n in defined_names(module) for n in dotted[1:2])
        return False
    return True


def check_apis(page: Path, text: str, package: object, problems: list[str]) -> None:
    for span in code_spans(text):
        for m in API_RE.finditer(span):
            dotted = m.group(1).lstrip(".").split(".")
            # `fastload.transformers.from_pretrained(...)`, `fastload.StorageError: ...`:
            # only the names, not what the text does with them.
            if dotted[-1] in {"py", "rs", "md", "json", "so"}:
                continue
            if not api_exists(package, dotted):
                problems.append(f"{page.name}: fastload.{'.'.join(dotted)}: not in the package")


def help_text(command: str) -> str:
    runs = [
        [sys.executable, "-m", "fastload._cli", command, "--help"],
        ["cargo", "run", "--quiet", "--", command, "--help"],
    ]
    for run in runs:
        try:
            out = subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and "Usage:" in out.stdout:
            return out.stdout
    raise SystemExit(f"check_docs: cannot get `fastload {command} --help` (build fastload first)")


def check_flags(pages: dict[Path, str], problems: list[str]) -> None:
    used: dict[str, set[tuple[str, str]]] = {"bench": set(), "inspect": set()}
    for page, text in pages.items():
        for span in code_spans(text):
            for line in span.splitlines():
                for m in FLAG_RE.finditer(line):
                    for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", m.group(2)):
                        used[m.group(1)].add((flag, page.name))
        if page == BENCH_PAGE:
            # The flag table of `fastload bench` and the synopsis's continuation lines.
            for line in text.splitlines():
                if line.startswith("| `--") or line.startswith("               ["):
                    for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", line):
                        used["bench"].add((flag, page.name))
    for command, flags in used.items():
        if not flags:
            continue
        known = set(re.findall(r"(?<![\w-])(--[a-z][\w-]*)", help_text(command)))
        for flag, page_name in sorted(flags):
            if flag not in known:
                problems.append(f"{page_name}: fastload {command} {flag}: not in its --help")


def main() -> int:
    sys.path.insert(0, str(ROOT / "python"))
    try:
        package = importlib.import_module("fastload")
    except ImportError as e:
        raise SystemExit(f"check_docs: cannot import fastload ({e}); build it first") from e
    pages = {page: page.read_text(encoding="utf-8") for page in PAGES}
    problems: list[str] = []
    for page, text in pages.items():
        check_paths(page, text, problems)
        check_apis(page, text, package, problems)
    check_readme_links(problems)
    check_flags(pages, problems)
    for problem in problems:
        print(f"check_docs: {problem}")
    if not problems:
        print(f"check_docs: {len(pages)} pages: every path, API and flag they name exists")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
