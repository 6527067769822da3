"""scripts/check_sizes.py, the size check CI runs: on this repository, and on small trees written
here whose functions and files are just within or just over the limits."""

import subprocess
import sys
from pathlib import Path

from trees import write_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_sizes.py"


def check(root):
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    )


def tree(root, files, allowed=None):
    return write_tree(root, files, None if allowed is None else {"size_allowed.txt": allowed})


def rust_fn(name, lines, marker=None):
    """A Rust function `lines` long, its first and last line counted; braces in its strings and
    comments are not blocks."""
    body = ['    let s = "{ not a block";', "    // } nor this"]
    body += ["    let _ = 1;"] * (lines - 2 - len(body))
    head = [f"// size: {marker}"] if marker else []
    return "\n".join([*head, f"pub fn {name}() {{", *body, "}", ""])


def py_fn(name, lines, indent=""):
    body = [f"{indent}    x = 1"] * (lines - 1)
    return "\n".join([f"{indent}def {name}():", *body, ""])


def test_this_repository_is_within_its_sizes():
    out = check(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no function over 80 lines, no file over 700" in out.stdout


def test_functions_and_files_at_the_limits_pass_and_one_line_more_fails(tmp_path):
    ok = {
        "src/lib.rs": rust_fn("eighty", 80) + "fn declared();\n",
        "src/big.rs": "\n".join(["// a line"] * 700) + "\n",
        "python/fastload/m.py": py_fn("eighty", 80) + "class C:\n" + py_fn("m", 80, "    "),
        # The generated stub is not read.
        "python/fastload/_fastload.pyi": py_fn("stub", 200),
    }
    out = check(tree(tmp_path / "ok", ok))
    assert out.returncode == 0, out.stdout
    over = {
        "src/lib.rs": rust_fn("eighty_one", 81),
        "src/big.rs": "\n".join(["// a line"] * 701) + "\n",
        "python/fastload/m.py": "class C:\n"
        + "    def outer(self):\n"
        + py_fn("inner", 81, "        ").replace("\n", "\n", 1),
    }
    out = check(tree(tmp_path / "over", over))
    assert out.returncode == 1
    assert "src/lib.rs:1 eighty_one: 81 lines (over 80)" in out.stdout, out.stdout
    assert "src/big.rs: 701 lines (over 700)" in out.stdout
    assert "python/fastload/m.py:3 C.outer.inner: 81 lines (over 80)" in out.stdout
    assert "python/fastload/m.py:2 C.outer: 82 lines (over 80)" in out.stdout


def test_tests_do_not_count(tmp_path):
    files = {
        "src/lib.rs": "mod a;\n",
        "src/a.rs": "pub fn f() {}\n\n#[cfg(test)]\nmod tests {\n"
        + rust_fn("long_test", 200)
        + "}\n\n#[cfg(test)]\nmod more;\n",
        "src/a/more.rs": "\n".join(["// a test line"] * 900) + "\n" + rust_fn("t", 100),
        "src/b/mod.rs": "#[cfg(test)]\nmod tests;\n" + "\n".join(["// code"] * 690) + "\n",
        "src/b/tests.rs": rust_fn("t", 100),
    }
    out = check(tree(tmp_path, files))
    assert out.returncode == 0, out.stdout
    # The same tests outside a test module count.
    files["src/a.rs"] = files["src/a.rs"].replace("#[cfg(test)]\nmod tests", "mod tests")
    out = check(tree(tmp_path, files))
    assert out.returncode == 1
    assert "src/a.rs:4 long_test: 200 lines (over 80)" in out.stdout, out.stdout


def test_a_marker_keeps_a_size_with_its_reason(tmp_path):
    files = {
        "src/lib.rs": rust_fn("table", 90, marker="one table of every scheme")
        + "\n#[inline]\n"
        + rust_fn("long", 85),
        "python/fastload/m.py": "# size: the generated dispatch, read top to bottom\n"
        + "\n".join(["x = 1"] * 710)
        + "\n\n\n@decorator\n# size: one state machine\n"
        + py_fn("machine", 100),
    }
    out = check(tree(tmp_path, files))
    assert out.returncode == 1
    assert "src/lib.rs:2 table: 90 lines (over 80): one table of every scheme" in out.stdout
    assert "python/fastload/m.py: 815 lines (over 700): the generated dispatch" in out.stdout
    assert "m.py:716 machine: 100 lines (over 80): one state machine" in out.stdout
    # A marker keeps only the function below it.
    assert "src/lib.rs:94 long: 85 lines (over 80)" in out.stdout.split("Over the limits")[1]


def test_markers_without_a_reason_or_a_size_to_keep_fail(tmp_path):
    files = {
        "src/lib.rs": "// size:\n" + rust_fn("long", 85),
        "src/short.rs": rust_fn("short", 10, marker="kept for no reason"),
    }
    out = check(tree(tmp_path, files))
    assert out.returncode == 1
    assert "src/lib.rs:1: a size marker needs its reason" in out.stdout, out.stdout
    assert "src/short.rs:2 short: 10 lines, within 80: remove its size marker" in out.stdout


def test_the_allowed_list_keeps_sizes_and_only_shrinks(tmp_path):
    files = {
        "src/lib.rs": rust_fn("long", 85),
        "python/fastload/m.py": "\n".join(["x = 1"] * 701) + "\n",
    }
    allowed = "src/lib.rs::long  # split by the next step\npython/fastload/m.py  # likewise\n"
    out = check(tree(tmp_path, files, allowed))
    assert out.returncode == 0, out.stdout
    assert "long: 85 lines (over 80): allowed for now: split by the next step" in out.stdout
    files["src/lib.rs"] = rust_fn("long", 80)
    out = check(tree(tmp_path, files, allowed))
    assert out.returncode == 1
    assert "src/lib.rs::long is within its limit (or gone): remove it" in out.stdout
    out = check(tree(tmp_path, files, "python/fastload/m.py\n"))
    assert out.returncode == 1
    assert "expected `path  # why`" in out.stdout
