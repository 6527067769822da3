"""Checks that what README.md and docs/ refer to exists (run by scripts/test.sh after
`mkdocs build --strict`, which checks the links and anchors between docs pages):

- every repository path they name (`src/source/cache/fill.rs`, `tests/test_hub.py::test_x`,
  `benches/run.py`, `docs/hub.md#errors`, ...) is a file or folder of the repository, and every
  relative link and anchor of README.md resolves (README is not part of the site);
- every `fastload.<name>` Python API they name exists: an attribute of the package, or a
  submodule and a name defined in it (read from its source, so that `fastload.vllm` and
  `fastload.sglang` need neither vLLM nor SGLang installed);
- every `fastload bench --flag`, `fastload inspect --flag` and `fastload copy --flag` they use
  appears in that command's `--help` (from `python -m fastload._cli`, else `cargo run --quiet
  --`);
- `fastload bench`'s labels, as docs/cli-bench.md explains them: the "read from" values and the
  `bound_by` verdicts it lists are the ones src/cli/verdict.rs prints, its sample's table header
  is the one a bench run prints (a tiny run here), and the sample's rows and verdict lines use
  only those labels;
- `fastload.inspect`'s shape, as docs/python-api.md, docs/cli-bench.md and `fastload inspect
  --help` give it, is the one it returns, and `fastload inspect --json` prints the same object;
- every option of each command with a section in docs/cli-bench.md (`bench`, `inspect`, `copy`,
  ...) is described there (the bench table's rows, the `- `--flag`: ...` lists of the others),
  and each description agrees with the option's `--help`: the same words (one may stop early,
  the page may go on after the help's words; examples after "e.g." aside) and the same default.

Usage: python scripts/check_docs.py   (exit status 1 and one line per problem when something
does not resolve). It needs fastload built: the tree's own (python/fastload with its native
module, as scripts/test.sh builds it) or an installed one (README's command 1, `pip install .`).
"""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
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
FLAG_RE = re.compile(r"\bfastload (bench|inspect|copy|serve)\b([^`\n]*)")
CODE_RE = re.compile(r"`([^`\n]+)`")
FENCE_RE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
# The bench synopsis and flag table name flags on their own, after `fastload bench`.
BENCH_PAGE = ROOT / "docs" / "cli-bench.md"
API_PAGE = ROOT / "docs" / "python-api.md"
# Where `fastload bench` keeps the labels it prints, and the phrases of its verdict lines.
VERDICT_RS = ROOT / "src" / "cli" / "verdict.rs"
VERDICT_PHRASES = ("bound by ", "ran low here", "no limit that applies could be measured here")


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


def cli_env() -> dict[str, str]:
    """The environment in which `python -m fastload._cli` runs the fastload imported here."""
    env = dict(os.environ)
    home = sys.modules.get("fastload")
    if home is not None and home.__file__:
        where = str(Path(home.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (where, env.get("PYTHONPATH")) if p)
    return env


def help_text(command: str) -> str:
    runs = [
        [sys.executable, "-m", "fastload._cli", command, "--help"],
        ["cargo", "run", "--quiet", "--", command, "--help"],
    ]
    for run in runs:
        try:
            out = subprocess.run(
                run, cwd=ROOT, capture_output=True, text=True, timeout=900, env=cli_env()
            )
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and "Usage:" in out.stdout:
            return out.stdout
    raise SystemExit(f"check_docs: cannot get `fastload {command} --help` (build fastload first)")


def check_flags(pages: dict[Path, str], problems: list[str]) -> None:
    used: dict[str, set[tuple[str, str]]] = {
        "bench": set(),
        "inspect": set(),
        "copy": set(),
        "serve": set(),
    }
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


HELP_OPTION_RE = re.compile(
    r"^\s+(?:-\w, )?(--[a-z][\w-]*)(?: <[^>]+>|\[=<[^>]+>\])?(?:\s{2,}(.*))?$"
)
DOC_ROW_RE = re.compile(r"^\| `(--[a-z][\w-]*)[^`]*` \| (.*) \|$")
DOC_ITEM_RE = re.compile(r"^- `(--[a-z][\w-]*)[^`]*`: (.*)$")


def help_options(command: str) -> dict[str, str]:
    """`fastload COMMAND --help`'s options: flag -> its description (without --help's own)."""
    options: dict[str, str] = {}
    flag = None
    for line in help_text(command).splitlines():
        m = HELP_OPTION_RE.match(line)
        if m:
            flag = m.group(1)
            options[flag] = m.group(2) or ""
        elif flag and line.startswith("        ") and line.strip():
            options[flag] += " " + line.strip()
        else:
            flag = None
    options.pop("--help", None)
    return options


def doc_options(text: str) -> dict[str, dict[str, str]]:
    """docs/cli-bench.md's description of each command's options: the bench table's rows and the
    `- `--flag ...`: description` items (continued on indented lines) of each command's section."""
    documented: dict[str, dict[str, str]] = {}
    command, item = None, None
    for line in text.splitlines():
        heading = re.match(r"^## `fastload (\w+)`", line)
        if line.startswith("## "):
            command = heading.group(1) if heading else None
            if command:
                documented.setdefault(command, {})
            item = None
            continue
        if command not in documented:
            continue
        row, bullet = DOC_ROW_RE.match(line), DOC_ITEM_RE.match(line)
        if row:
            documented[command][row.group(1)] = row.group(2).replace("\\|", "|")
        elif bullet:
            item = bullet.group(1)
            documented[command][item] = bullet.group(2)
        elif item and line.startswith("  ") and line.strip():
            documented[command][item] += " " + line.strip()
        else:
            item = None
    return documented


def split_default(text: str, doc: bool) -> tuple[list[str], list[str] | None]:
    """The words of a description (links as their text, no code marks, examples after "e.g."
    left out) and of its default, or None: `[default: X]` in --help; `(default X)` or a last
    `; default X` in the docs."""
    default = None
    if doc:
        # A cross-reference in parentheses is the page's own; other links read as their text.
        text = re.sub(r"\(\[[^\]]*\]\([^)]*\)\)", "", text)
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text).replace("`", "")
        m = re.search(r"\(default:? ", text)
        start = m.start() if m else -1
        if m:
            depth, end = 0, start
            for end in range(start, len(text)):
                depth += {"(": 1, ")": -1}.get(text[end], 0)
                if depth == 0:
                    break
            default, text = text[m.end() : end], text[:start] + text[end + 1 :]
        else:
            m = re.search(r"[;,] default:? (.*)$", text)
            if m:
                default, text = m.group(1), text[: m.start()]
    else:
        m = re.search(r"\[default: ([^\]]*)\]", text)
        if m:
            default, text = m.group(1), text[: m.start()] + text[m.end() :]
    text = re.sub(r"e\.g\. [^;)\[]*?(?=[;)\[]|, [a-z]|$)", "", text)

    def words(t: str) -> list[str]:
        return re.findall(r"[a-z0-9$_]+", t.lower())

    return words(text), (words(default) if default is not None else None)


def check_option_docs(text: str, problems: list[str]) -> None:
    documented = doc_options(text)
    for command, docs in documented.items():
        helps = help_options(command)
        for flag in sorted(set(helps) - set(docs)):
            problems.append(f"{BENCH_PAGE.name}: fastload {command} {flag}: not described")
        for flag in sorted(set(docs) & set(helps)):
            help_words, help_default = split_default(helps[flag], doc=False)
            doc_words, doc_default = split_default(docs[flag], doc=True)
            n = min(len(help_words), len(doc_words))
            where = f"{BENCH_PAGE.name}: fastload {command} {flag}"
            if help_words[:n] != doc_words[:n] or (len(doc_words) < len(help_words) and n < 3):
                at = next((i for i in range(n) if help_words[i] != doc_words[i]), n)
                problems.append(
                    f"{where}: the page says {' '.join(doc_words[at : at + 8])!r} where --help "
                    f"says {' '.join(help_words[at : at + 8])!r}"
                )
            if help_default != doc_default and help_default is not None:
                problems.append(
                    f"{where}: default {' '.join(doc_default or ['(none)'])!r} on the page, "
                    f"{' '.join(help_default)!r} in --help"
                )


def run_cli(*args: str) -> str:
    """`fastload ARGS`' stdout, from the package's script (the same parser as the binary)."""
    out = subprocess.run(
        [sys.executable, "-m", "fastload._cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env=cli_env(),
    )
    if out.returncode != 0:
        raise SystemExit(f"check_docs: fastload {' '.join(args)} failed: {out.stderr.strip()}")
    return out.stdout


def tiny_checkpoint(folder: Path) -> Path:
    """A two-tensor safetensors file, written by hand (no torch needed)."""
    header = {
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [3], "data_offsets": [8, 11]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path = folder / "tiny.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text + bytes(range(11)))
    return path


def verdict_labels() -> tuple[list[str], set[str]]:
    """The "read from" labels and the `bound_by` verdicts src/cli/verdict.rs defines."""
    code = VERDICT_RS.read_text(encoding="utf-8")
    listed = re.search(r"READ_FROM_LABELS: \[&str; \d+\] =\s*\[([^]]*)\]", code)
    if not listed:
        raise SystemExit(f"check_docs: no READ_FROM_LABELS in {VERDICT_RS}")
    read_from = re.findall(r'"([^"]+)"', listed.group(1))
    verdicts = set(re.findall(r'pub\(super\) const [A-Z_]+: &str = "([^"]+)";', code))
    return read_from, verdicts


def check_bench_labels(text: str, sample_run: str, problems: list[str]) -> None:
    """docs/cli-bench.md against the labels `fastload bench` prints."""
    page = BENCH_PAGE.name
    read_from, verdicts = verdict_labels()
    spans = set(CODE_RE.findall(FENCE_RE.sub("", text)))
    for label in read_from:
        for shown in (label, label.replace(" ", "_")):  # the table, and `read_from` in --json
            if shown not in spans and f'"{shown}"' not in spans:
                problems.append(f"{page}: bench's read-from value {shown!r} is not explained")
    for verdict in verdicts:
        if verdict not in spans and f'"{verdict}"' not in spans:
            problems.append(f"{page}: bench's verdict {verdict!r} (bound_by) is not explained")
    samples = [m.group(0) for m in FENCE_RE.finditer(text) if m.group(0).startswith("```text")]
    sample = next((b for b in samples if "fastload bench:" in b), None)
    if sample is None:
        problems.append(f"{page}: no sample of `fastload bench` output")
        return
    # The header row as a run prints it now.
    header = next((ln for ln in sample_run.splitlines() if ln.strip().startswith("run ")), None)
    shown = next((ln for ln in sample.splitlines() if ln.strip().startswith("run ")), None)
    if header is None or shown is None or header.split() != shown.split():
        problems.append(f"{page}: the sample's table header {shown!r} is not today's {header!r}")
    limits = set(re.findall(r"^  ([a-z_]+) +[\d.]+ GB/s", sample, re.M))
    code = VERDICT_RS.read_text(encoding="utf-8")
    hows = set(re.findall(r'"([a-z][^"]*)"', code))
    for phrase in VERDICT_PHRASES:
        if phrase not in code:
            problems.append(f"check_docs.py: {phrase!r} is no longer a verdict of {VERDICT_RS}")
    # The lines under a mode's line ("cold, 3 runs: ..."): what the runs did and what binds them.
    under_best = seen_mode = False
    for line in sample.splitlines():
        row = re.match(r"^ +\d+  (\S+(?: \S+)?) {2,}\d", line)
        if row and row.group(1) not in read_from:
            problems.append(f"{page}: sample row {line.strip()!r}: no such read-from label")
        mode_line = re.match(r"(cold|warm)(?: \([a-z ]+ runs\))?, \d+ runs?: ", line)
        seen_mode |= bool(mode_line)
        under_best = bool(mode_line) or (under_best and line.startswith("  "))
        if under_best and line.startswith("  "):
            how, _, verdict = line.strip().partition(": ")
            if how.startswith("first tensor at"):
                continue
            said = [p for p in VERDICT_PHRASES if p in verdict]
            if how not in hows or not said or "(noise)" in verdict:
                problems.append(f"{page}: sample line {line.strip()!r}: not a bench verdict")
            for bound in re.findall(r"bound by ([a-z_ ]+?)(?: of| \(|$)", line):
                if bound not in limits | verdicts:
                    problems.append(f"{page}: sample says 'bound by {bound}': no such verdict")
    if not seen_mode:
        problems.append(f"{page}: the sample has no mode line as a run prints (cold, N runs: ...)")


def documented_shape(text: str) -> dict[str, set[str]]:
    """`"files": [{file, size, ...}]`-style shapes of `inspect`'s object, in a text or code."""
    shape: dict[str, set[str]] = {}
    for key, inner in re.findall(r'"(files|tensors|total)":\s*\[?\{([^}]*)\}', text):
        shape[key] = set(re.findall(r"\w+", inner))
    return shape


def check_inspect_shape(package: object, tiny: Path, problems: list[str]) -> None:
    """fastload.inspect and `fastload inspect --json`: one object, the shape the docs give."""
    report = package.inspect(str(tiny))  # type: ignore[attr-defined]
    if report != json.loads(run_cli("inspect", str(tiny), "--json")):
        problems.append("fastload.inspect and `fastload inspect --json` return different objects")
    actual = {
        "files": set(report["files"][0]),
        "tensors": set(report["tensors"][0]),
        "total": set(report["total"]),
    }
    api = API_PAGE.read_text(encoding="utf-8")
    section = api[api.find("## What `inspect` returns") :]
    block = FENCE_RE.search(section)
    code = block.group(1) if block else ""
    givens = {
        f"{API_PAGE.name} (What `inspect` returns)": documented_shape(code),
        f"{BENCH_PAGE.name} (fastload inspect)": documented_shape(
            BENCH_PAGE.read_text(encoding="utf-8").split("## `fastload inspect`")[-1]
        ),
        "fastload inspect --help": documented_shape(" ".join(help_text("inspect").split())),
    }
    for where, given in givens.items():
        if given != actual:
            problems.append(f"{where}: inspect's shape {given} is not what it returns: {actual}")
    if block:
        for key, names in actual.items():
            for name in names:
                if f"`{key}.{name}`" not in section and f"`{key}[].{name}`" not in section:
                    problems.append(f"{API_PAGE.name}: inspect's `{key}.{name}` is not explained")


def import_fastload() -> object:
    """The tree's fastload (python/fastload with its native module), else an installed one."""
    sys.path.insert(0, str(ROOT / "python"))
    try:
        return importlib.import_module("fastload")
    except ImportError:
        pass
    # No native module in the tree (README's command 1 installs fastload instead of building it
    # here): the installed package.
    sys.path.remove(str(ROOT / "python"))
    for name in [m for m in sys.modules if m == "fastload" or m.startswith("fastload.")]:
        del sys.modules[name]
    try:
        return importlib.import_module("fastload")
    except ImportError as e:
        raise SystemExit(
            f"check_docs: cannot import fastload ({e}); it needs fastload built: run README's "
            "command 1 (pip install . into .venv) or 2 (bash scripts/test.sh builds it into "
            "python/fastload), then this script with that .venv's python"
        ) from e


def main() -> int:
    package = import_fastload()
    pages = {page: page.read_text(encoding="utf-8") for page in PAGES}
    problems: list[str] = []
    for page, text in pages.items():
        check_paths(page, text, problems)
        check_apis(page, text, package, problems)
    check_readme_links(problems)
    check_flags(pages, problems)
    check_option_docs(pages[BENCH_PAGE], problems)
    with tempfile.TemporaryDirectory() as folder:
        tiny = tiny_checkpoint(Path(folder))
        sample_run = run_cli("bench", str(tiny), "--repeat", "1", "--compare=none")
        check_bench_labels(pages[BENCH_PAGE], sample_run, problems)
        check_inspect_shape(package, tiny, problems)
    for problem in problems:
        print(f"check_docs: {problem}")
    if not problems:
        print(
            f"check_docs: {len(pages)} pages: every path, API and flag they name exists; bench's "
            "labels and inspect's shape are as documented"
        )
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
