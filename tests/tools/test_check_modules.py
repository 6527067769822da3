"""scripts/check_modules.py, the module-cycle check CI runs: on this repository and on small crates
written here that hold (or do not hold) a cycle."""

import subprocess
import sys
from pathlib import Path

from trees import write_tree

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "check_modules.py"


def check(root, *args):
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def crate(root, files, allowed=None):
    scripts = None if allowed is None else {"module_cycles_allowed.txt": allowed}
    return write_tree(root, {f"src/{name}": text for name, text in files.items()}, scripts)


# format (bottom) <- source <- plan (above); source's submodules are nodes of their own.
BASE = {
    "lib.rs": "//! Layers, lowest first:\n//!\n//! - [`format`](mod@format): bytes.\n"
    "//! - [`source`]: sources, e.g. `source::local`\n//!   (files).\n//! - [`plan`]: plans.\n\n"
    "pub mod format;\npub mod plan;\npub mod source;\npub use format::Header;\n",
    "format.rs": "/// Not an import: crate::plan::Plan\npub struct Header;\n"
    'pub const NAME: &str = "crate::plan::x";\n',
    "plan.rs": "use crate::{format::Header, source::Shard};\npub struct Plan(Header, Shard);\n",
    "source/mod.rs": "pub mod local;\npub struct Shard;\npub trait Source {}\n",
    "source/local.rs": "use super::Source;\npub fn open(_: &dyn Source) -> crate::Header {\n"
    "    crate::format::Header\n}\n",
}


def test_this_repository_has_no_unlisted_cycle():
    out = check(REPO)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 up the layers" in out.stdout
    edges = check(REPO, "--edges").stdout.splitlines()
    # Index files are format knowledge; the format imports nothing, error and options no layer
    # above theirs.
    assert "source::local -> format" in edges
    assert not [e for e in edges if e.startswith("format -> ")]
    for edge in ["error -> source", "options -> plan", "options -> cache"]:
        assert edge not in edges


def test_a_clean_crate_passes_and_comments_and_strings_are_not_imports(tmp_path):
    out = check(crate(tmp_path, BASE))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no module cycle" in out.stdout
    edges = check(tmp_path, "--edges").stdout.splitlines()
    # `crate::Header` is what lib.rs re-exports from format.
    assert edges == [
        "plan -> format",
        "plan -> source",
        "source::local -> format",
        "source::local -> source",
    ]


def test_sources_and_sinks_never_import_each_other(tmp_path):
    files = dict(BASE)
    files["lib.rs"] = (
        BASE["lib.rs"].replace("//!   (files).\n", "//!   (files), and [`sink`] beside it.\n")
        + "pub mod sink;\n"
    )
    files["sink.rs"] = "pub trait Sink {}\n"
    files["source/mod.rs"] = "pub mod object;\n" + BASE["source/mod.rs"]
    files["source/object.rs"] = "pub struct Remote;\n"
    assert check(crate(tmp_path, files)).returncode == 0
    # Neither the source itself nor any of its submodules: object stores included.
    for importer, imported in [
        ("sink.rs", "source::Shard"),
        ("sink.rs", "source::object::Remote"),
        ("source/local.rs", "sink::Sink"),
    ]:
        text = dict(files)
        text[importer] = files[importer] + f"pub use crate::{imported};\n"
        out = check(crate(tmp_path, text))
        assert out.returncode == 1, out.stdout
        assert "never import each other (APART)" in out.stdout
        crate(tmp_path, files)


def test_an_import_up_the_layers_that_closes_a_cycle_fails(tmp_path):
    files = dict(BASE)
    files["format.rs"] = "pub struct Header;\nfn f() -> usize {\n    crate::plan::SIZE\n}\n"
    files["plan.rs"] = BASE["plan.rs"] + "pub const SIZE: usize = 1;\n"
    out = check(crate(tmp_path, files))
    assert out.returncode == 1
    assert "format -> plan  [src/format.rs:3]" in out.stdout
    assert "module cycle among format, plan, for one: format -> plan -> format" in out.stdout


def test_a_cycle_through_super_and_a_child_module_fails_unless_allowed(tmp_path):
    files = dict(BASE)
    # source/mod.rs calls into its child, which imports the parent back (`super::Source`).
    files["source/mod.rs"] = (
        "pub mod local;\npub struct Shard;\npub trait Source {}\n"
        "#[cfg(test)]\nmod tests {\n    fn f() { let _ = super::local::open; }\n}\n"
    )
    out = check(crate(tmp_path, files))
    assert out.returncode == 1
    assert "for one: source -> source::local -> source" in out.stdout
    assert "src/source/mod.rs:6 (test)" in out.stdout

    allowed = "source -> source::local  # opening moves to source/open.rs\n"
    out = check(crate(tmp_path, {}, allowed))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "no module cycle once the 1 allowed imports go" in out.stdout

    # An allowed import that is gone fails: the list only shrinks.
    files["source/mod.rs"] = BASE["source/mod.rs"]
    out = check(crate(tmp_path, files))
    assert out.returncode == 1
    assert "source -> source::local  (GONE: remove it from the list)" in out.stdout


def test_an_allowlist_line_without_a_reason_is_refused(tmp_path):
    out = check(crate(tmp_path, BASE, "source -> source::local\n"))
    assert out.returncode != 0
    assert "expected `from -> to  # why`" in out.stderr


def test_dot_draws_every_edge(tmp_path):
    out = check(crate(tmp_path, BASE), "--dot")
    assert out.returncode == 0
    assert out.stdout.startswith("digraph modules {")
    assert '"plan" -> "source";' in out.stdout
    assert '"source::local" -> "format";' in out.stdout


def test_an_import_cycle_between_two_files_of_one_module_fails(tmp_path):
    files = dict(BASE)
    # plan.rs and its submodules import each other (a parent and its children are one unit);
    # its two submodules importing each other are a cycle.
    files["plan.rs"] = BASE["plan.rs"] + "mod report;\nmod verdict;\npub use report::Row;\n"
    files["plan/report.rs"] = "use super::verdict::Mode;\npub struct Row(Mode, super::Plan);\n"
    files["plan/verdict.rs"] = "pub struct Mode;\n"
    out = check(crate(tmp_path, files))
    assert out.returncode == 0, out.stdout + out.stderr

    files["plan/verdict.rs"] = "use super::report::Row;\npub struct Mode;\nfn f(_: Row) {}\n"
    out = check(crate(tmp_path, files))
    assert out.returncode == 1, out.stdout + out.stderr
    assert (
        "file import cycle among src/plan/report.rs, src/plan/verdict.rs, for one: "
        "src/plan/report.rs -> src/plan/verdict.rs -> src/plan/report.rs"
    ) in out.stdout
    assert "src/plan/verdict.rs -> src/plan/report.rs  [src/plan/verdict.rs:1]" in out.stdout

    allowed = "src/plan/verdict.rs -> src/plan/report.rs  # the row moves to a leaf\n"
    out = check(crate(tmp_path, {}, allowed))
    assert out.returncode == 0, out.stdout + out.stderr


def test_lib_rs_must_list_the_layers_of_the_check(tmp_path):
    files = dict(BASE)
    # plan listed below source: the crate's docs disagree with the check's table.
    files["lib.rs"] = (
        "//! - [`format`](mod@format): bytes.\n//! - [`plan`]: plans.\n//! - [`source`]: sources.\n"
        "\npub mod format;\npub mod plan;\npub mod source;\npub use format::Header;\n"
    )
    out = check(crate(tmp_path, files))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "src/lib.rs lists the layers otherwise than LAYERS in check_modules.py:" in out.stdout
    assert "  layer 2: lib.rs plan; LAYERS source\n  layer 3: lib.rs source; LAYERS plan" in (
        out.stdout
    )
