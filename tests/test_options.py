"""Options (sizes, concurrency, device, environment defaults, endpoints) and the exception
contract: a malformed or mistyped argument is a ConfigError naming it."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import fastload
import pytest
import torch
from helpers import MiB, assert_same_tensors, finish_probe, pattern, reference, start_probe
from safetensors.torch import save_file

# ---------------------------------------------------------------------------------------------
# Accepted values give the same bytes

SIZES = ["64KiB", "64MiB", "1GiB", "8MB", "100KB", 65536, 3 * MiB]


@pytest.mark.parametrize("value", SIZES)
def test_block_size(dtypes_file, value):
    assert_same_tensors(fastload.load(dtypes_file, block_size=value), reference(dtypes_file))


# Only values of 1 MiB and up: the loader may set a floor for its buffers (it does: 1 MiB).
@pytest.mark.parametrize("value", ["64MiB", "1GiB", "8MB", "1MiB", 3 * MiB])
def test_memory_limit(dtypes_file, value):
    assert_same_tensors(fastload.load(dtypes_file, memory_limit=value), reference(dtypes_file))


@pytest.mark.parametrize("concurrency", [1, 2, 8, 64])
def test_concurrency(dtypes_file, concurrency):
    assert_same_tensors(fastload.load(dtypes_file, concurrency=concurrency), reference(dtypes_file))


def test_all_options_on_stream(dtypes_file):
    got = dict(fastload.stream(dtypes_file, concurrency=3, block_size="64KiB", memory_limit="1MiB"))
    assert_same_tensors(got, reference(dtypes_file))


def test_stats_report_the_options_in_force(dtypes_file, monkeypatch):
    for var in ("FASTLOAD_CONCURRENCY", "FASTLOAD_BLOCK_SIZE", "FASTLOAD_MEMORY_LIMIT"):
        monkeypatch.delenv(var, raising=False)

    def in_force(**options) -> tuple[int, int, int]:
        with fastload.stream(dtypes_file, **options) as s:
            dict(s)
            stats = s.stats()
        return stats["concurrency"], stats["block_size"], stats["memory_limit"]

    # Local files: 16 reads in flight (object stores take 64: test_s3.py).
    assert in_force() == (16, 8 * MiB, 1024 * MiB)
    monkeypatch.setenv("FASTLOAD_CONCURRENCY", "5")
    assert in_force(block_size="64KiB", memory_limit="3MiB") == (5, 64 << 10, 3 * MiB)
    assert in_force(concurrency=2) == (2, 8 * MiB, 1024 * MiB)


@pytest.mark.parametrize("device", ["cpu", torch.device("cpu")])
def test_cpu_device(dtypes_file, device):
    got = fastload.load(dtypes_file, device=device)
    assert {t.device for t in got.values()} == {torch.device("cpu")}
    assert_same_tensors(got, reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# Rejected values name the option

BAD_VALUES = [
    ("block_size", "banana"),
    ("block_size", "12XB"),
    ("block_size", ""),
    ("block_size", "-1MiB"),
    ("block_size", -1),
    ("block_size", 0),
    ("memory_limit", "lots"),
    ("memory_limit", -5),
    ("memory_limit", 0),
    ("concurrency", 0),
    ("concurrency", -1),
    ("copy_streams", 0),
    ("copy_streams", 17),
    ("copy_streams", -2),
]


@pytest.mark.parametrize(("option", "value"), BAD_VALUES)
def test_bad_option_values(dtypes_file, option, value):
    with pytest.raises(ValueError) as info:
        fastload.load(dtypes_file, **{option: value})
    assert isinstance(info.value, fastload.ConfigError), type(info.value).__mro__
    assert info.value.option == option, info.value


@pytest.mark.parametrize(("option", "value"), BAD_VALUES[:1] + BAD_VALUES[-1:])
def test_bad_option_values_on_stream(dtypes_file, option, value):
    with pytest.raises(ValueError) as info:
        list(fastload.stream(dtypes_file, **{option: value}))
    assert isinstance(info.value, fastload.ConfigError)
    assert info.value.option == option, info.value


# Values of the wrong type are ConfigErrors too (never a TypeError of the native module).
WRONG_TYPES = [
    ("concurrency", True),
    ("concurrency", "4"),
    ("concurrency", 2.0),
    ("block_size", 1.5),
    ("block_size", False),
    ("memory_limit", [1]),
    ("method", "fast"),
    ("method", 1),
    ("copy_streams", True),
    ("copy_streams", "2"),
    ("copy_streams", 1.0),
    ("names", 7),
    ("names", ["F32.7", 3]),
    ("storage_options", "region=x"),
    ("storage_options", {1: "x"}),
]


@pytest.mark.parametrize(("option", "value"), WRONG_TYPES)
def test_wrong_types_name_the_option(dtypes_file, option, value):
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(dtypes_file, **{option: value})
    assert info.value.option == option, info.value


def test_options_are_resolved_by_the_native_module(monkeypatch):
    from fastload import _fastload

    for var in ("CONCURRENCY", "BLOCK_SIZE", "MEMORY_LIMIT", "COPY_STREAMS"):
        monkeypatch.delenv(f"FASTLOAD_{var}", raising=False)
    r = _fastload.resolve_options(["model/"], block_size="64KiB", names=iter("abca"))
    assert (r.concurrency, r.block_size, r.memory_limit) == (16, 64 << 10, 1 << 30)
    assert r.method == "auto" and r.names == ["a", "b", "c"] and r.copy_streams == 1
    assert _fastload.resolve_options(copy_streams=4).copy_streams == 4
    monkeypatch.setenv("FASTLOAD_COPY_STREAMS", "16")
    assert _fastload.resolve_options().copy_streams == 16
    assert _fastload.resolve_options(["s3://bucket/model/"]).concurrency == 64
    assert _fastload.resolve_options(method="PREAD").method == "read"
    monkeypatch.setenv("FASTLOAD_MEMORY_LIMIT", "2GiB")
    assert _fastload.resolve_options().memory_limit == 2 << 30
    with pytest.raises(fastload.ConfigError) as info:
        _fastload.resolve_options(memory_limit="1KiB")
    assert info.value.option == "memory_limit"


def test_bad_device(dtypes_file):
    with pytest.raises(ValueError) as info:
        fastload.load(dtypes_file, device="tpu:0")
    assert isinstance(info.value, fastload.ConfigError) and info.value.option == "device"


def test_options_are_keyword_only(dtypes_file):
    with pytest.raises(TypeError):
        fastload.load(dtypes_file, "cpu")
    with pytest.raises(TypeError):
        fastload.load(dtypes_file, chunk_size="1MiB")


# ---------------------------------------------------------------------------------------------
# Environment defaults (read in fresh interpreters: they may be read at import time)

ENV_PROBE = """
from safetensors.torch import load_file
path, option, good = sys.argv[1], sys.argv[2], sys.argv[3]

def attempt(**kw):
    try:
        got = fastload.load(path, **kw)
    except Exception as e:
        mro = [c.__name__ for c in type(e).__mro__]
        return {"error": mro, "option": getattr(e, "option", None)}
    want = load_file(path)
    same = set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and got[k].shape == want[k].shape
        and torch.equal(got[k].reshape(-1).view(torch.uint8), want[k].reshape(-1).view(torch.uint8))
        for k in want)
    return {"same": same}

explicit = {option: int(good) if option in ("concurrency", "copy_streams") else good}
emit(default=attempt(), explicit=attempt(**explicit))
"""

ENV_VARS = {o.name: o.env for o in fastload._fastload.OPTIONS if o.env}


@pytest.fixture(scope="module")
def large_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("env") / "large.safetensors"
    save_file(
        {"big": pattern((4 * MiB + 5,), torch.uint8), "f": pattern((9, 7), torch.float32)},
        str(path),
    )
    return path


ENV_CASES = {
    "concurrency": ("0", "2"),
    "block_size": ("banana", "1MiB"),
    "memory_limit": ("lots", "8MiB"),
    "copy_streams": ("99", "2"),
}
VALID_ENV = {
    "FASTLOAD_CONCURRENCY": "2",
    "FASTLOAD_BLOCK_SIZE": "64KiB",
    "FASTLOAD_MEMORY_LIMIT": "1MiB",
    "FASTLOAD_COPY_STREAMS": "3",
}


@pytest.fixture(scope="module")
def env_results(large_file):
    """Every environment scenario, each in its own interpreter, all started at once."""
    procs = {
        option: start_probe(ENV_PROBE, large_file, option, good, env={ENV_VARS[option]: bad})
        for option, (bad, good) in ENV_CASES.items()
    }
    procs["valid"] = start_probe(ENV_PROBE, large_file, "block_size", "128KiB", env=VALID_ENV)
    return {key: finish_probe(proc) for key, proc in procs.items()}


@pytest.mark.parametrize("option", list(ENV_CASES))
def test_bad_environment_value_is_reported_and_explicit_argument_wins(env_results, option):
    r = env_results[option]
    assert "error" in r["default"], f"{ENV_VARS[option]}={ENV_CASES[option][0]!r} was ignored"
    assert "ValueError" in r["default"]["error"] and "FastloadError" in r["default"]["error"], r
    # The variable the user set, not the option it stands for (FASTLOAD_CONCURRENCY=0 included).
    assert r["default"]["option"] == ENV_VARS[option], r
    assert r["explicit"] == {"same": True}, r["explicit"]


def test_valid_environment_values(env_results):
    r = env_results["valid"]
    assert r == {"default": {"same": True}, "explicit": {"same": True}}, r


# ---------------------------------------------------------------------------------------------
# Exceptions


def test_exception_hierarchy():
    assert issubclass(fastload.FastloadError, Exception)
    assert issubclass(fastload.FormatError, fastload.FastloadError)
    assert issubclass(fastload.FormatError, ValueError)
    assert issubclass(fastload.StorageError, fastload.FastloadError)
    assert issubclass(fastload.StorageError, OSError)


def _missing_uris(tmp_path, dtypes_file):
    missing = tmp_path / "nope" / "model.safetensors"
    return {
        "str": (str(missing), "model.safetensors"),
        "path": (missing, "model.safetensors"),
        "dir": (tmp_path / "no_dir", "no_dir"),
        "url": (missing.as_uri(), "model.safetensors"),
        "list": ([dtypes_file, tmp_path / "other.safetensors"], "other.safetensors"),
    }


@pytest.mark.parametrize("kind", ["str", "path", "dir", "url", "list"])
def test_missing_path_is_file_not_found(tmp_path, dtypes_file, kind):
    uri, shown = _missing_uris(tmp_path, dtypes_file)[kind]
    with pytest.raises(FileNotFoundError) as info:
        fastload.load(uri)
    assert isinstance(info.value, fastload.FastloadError), type(info.value).__mro__
    assert shown in str(info.value), str(info.value)
    with pytest.raises(FileNotFoundError):
        list(fastload.stream(uri))


def test_index_naming_a_missing_shard(tmp_path):
    save_file(
        {"a": pattern((3,), torch.float32)}, str(tmp_path / "model-00001-of-00002.safetensors")
    )
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002"):
        fastload.load(tmp_path)


def test_signatures_spell_out_every_option():
    """help() and inspect.signature show the options as keyword-only parameters, the same ones
    with the same defaults and annotations on every entry point (they are defined once, in
    src/options.rs's OPTIONS, and typed once, in fastload.Options)."""
    import inspect

    import fastload.distributed

    options = list(fastload.Options.__annotations__)
    assert options == list(TABLE), "fastload.Options and src/options.rs's OPTIONS differ"
    for fn in (
        fastload.load,
        fastload.stream,
        fastload.Stream,
        fastload.distributed.load,
        fastload.distributed.stream,
    ):
        params = inspect.signature(fn).parameters
        assert list(params)[-len(options) :] == options, fn
        for name in options:
            p = params[name]
            assert p.kind is inspect.Parameter.KEYWORD_ONLY, (fn, name)
            assert p.default == ("cpu" if name == "device" else None), (fn, name)
            assert p.annotation == _written(fastload.Options, name), (fn, name)
        assert not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), fn
    assert "memory_limit: 'Size | None' = None" in str(inspect.signature(fastload.load))


# ---------------------------------------------------------------------------------------------
# The option list, defined once: OPTIONS in src/options.rs (exported as _fastload.OPTIONS).
# What Python builds from it is checked above and in test_option_list_built_from_the_table; what
# must stay written out (for type checkers, stubtest and readers) is checked against it here,
# and each failure names the file to change. Adding an option: a row in OPTIONS, then these.

TABLE = {o.name: o for o in fastload._fastload.OPTIONS}
ROOT = Path(__file__).resolve().parent.parent
# The keyword-only parameters of _fastload.Stream that are not load options.
STREAM_ONLY = ["parts", "target", "allocate", "reader"]
# The extra-config keys of the engine loaders that are not load options.
ENGINE_ONLY = {"weights_uri", "distributed"}


def _written(typed_dict: type, name: str) -> str:
    """A TypedDict key's annotation as written in the source (TypedDict keeps postponed
    annotations as ForwardRefs)."""
    hint = typed_dict.__annotations__[name]
    return getattr(hint, "__forward_arg__", hint)


def _taken_by(taker: str) -> list[str]:
    return [o.name for o in fastload._fastload.OPTIONS if taker in o.takes]


def _aliases(module: ast.Module) -> dict[str, ast.expr]:
    """A module's top-level type aliases (``Size = Union[int, str]``, ``_Size = int | str``)."""
    return {
        node.targets[0].id: node.value
        for node in module.body
        if isinstance(node, ast.Assign)
        and len(node.targets) == 1
        and isinstance(node.targets[0], ast.Name)
        and isinstance(node.value, (ast.BinOp, ast.Subscript))
    }


def _members(node: ast.expr | str, aliases: dict[str, ast.expr]) -> frozenset[str]:
    """The members of an annotation's union, aliases expanded, ``Union[a, b]`` and ``a | b``
    alike, so that the stub's ``_Size | None`` equals ``Size | None`` of fastload.Options."""
    if isinstance(node, str):
        node = ast.parse(node, mode="eval").body
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _members(node.left, aliases) | _members(node.right, aliases)
    if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("Union", "Optional"):
        elts = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        extra = {"None"} if ast.unparse(node.value) == "Optional" else set()
        return frozenset(extra).union(*(_members(e, aliases) for e in elts))
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return _members(node.value, aliases)
    if isinstance(node, ast.Name) and node.id in aliases:
        return _members(aliases[node.id], aliases)
    return frozenset({ast.unparse(node)})


def _parse(relative: str) -> ast.Module:
    return ast.parse((ROOT / relative).read_text(), relative)


OPTIONS_ALIASES = _aliases(_parse("python/fastload/_options.py"))


def _keyword_only(fn: ast.FunctionDef) -> dict[str, tuple[ast.expr | None, ast.expr | None]]:
    """A stub function's keyword-only parameters: name -> (annotation, default)."""
    return {a.arg: (a.annotation, d) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)}


# Environment variables for which every value is valid (FASTLOAD_CACHE: any other is a directory).
ENV_ANY_VALUE = {"FASTLOAD_CACHE", "FASTLOAD_PEER_TOKEN"}


def test_option_list_environment_variables(monkeypatch):
    """Each variable the table names is the one the native module reads for that option: a bad
    value of it is refused, naming the variable (README's table shows the same names)."""
    from fastload import _fastload

    envs = {o.name: o.env for o in TABLE.values() if o.env}
    assert {"concurrency", "block_size", "memory_limit", "method", "cache", "verify"} <= set(envs)
    for env in envs.values():
        monkeypatch.delenv(env, raising=False)
    for name, env in envs.items():
        assert _members(TABLE[name].type, OPTIONS_ALIASES), name
        if env in ENV_ANY_VALUE:
            continue
        monkeypatch.setenv(env, "not a valid value")
        with pytest.raises(fastload.ConfigError) as info:
            _fastload.resolve_options()
        assert info.value.option == env, f"src/options.rs: {name} reads {info.value.option}"
        monkeypatch.delenv(env)
    _fastload.resolve_options()


def _differ(got: list[str], want: list[str]) -> str:
    missing = [n for n in want if n not in got]
    extra = [n for n in got if n not in want]
    if missing or extra:
        return f"missing {missing}, not in OPTIONS {extra}"
    return f"order {got}, OPTIONS' order {want}"


def test_option_list_built_from_the_table():
    """What Python builds from the table at import: the option set, the native subset, the
    engines' keys and safe_open's reader options."""
    from fastload import _integration, _options, _safe_open

    assert _options.OPTIONS == set(TABLE)
    assert _options.native(dict.fromkeys(TABLE)) == dict.fromkeys(_taken_by("native"))
    assert "device" not in _taken_by("native")
    assert list(_integration.LOAD_KEYS) == _taken_by("extra_config")
    assert _integration.KEYS == set(_taken_by("extra_config")) | ENGINE_ONLY
    assert list(_safe_open._READER_OPTIONS) == _taken_by("reader")


def test_option_list_typed_dict():
    """python/fastload/_options.py: ``Options`` (what mypy and pyright check calls against) has
    one key per option, in table order, annotated as the table says, each described in its
    docstring."""
    hints = fastload.Options.__annotations__
    where = "python/fastload/_options.py: class Options"
    assert list(hints) == list(TABLE), f"{where}: {_differ(list(hints), list(TABLE))}"
    for name, o in TABLE.items():
        hint = _written(fastload.Options, name)
        assert hint == o.type, f"{where}: {name}: {hint!r} != {o.type!r}"
        assert f"``{name}``:" in (fastload.Options.__doc__ or ""), f"{where} docstring: {name}"


def test_option_list_safe_open():
    """python/fastload/_safe_open.py: ``SafeOpenOptions`` has the options the table says
    safe_open takes, typed as in Options; others are refused as a signature refuses them."""
    from fastload._safe_open import SafeOpenOptions

    where = "python/fastload/_safe_open.py: class SafeOpenOptions"
    hints = SafeOpenOptions.__annotations__
    want = _taken_by("safe_open")
    assert list(hints) == want, f"{where}: {_differ(list(hints), want)}"
    for name in hints:
        hint = _written(SafeOpenOptions, name)
        assert hint == TABLE[name].type, f"{where}: {name}: {hint!r}"
    assert set(_taken_by("reader")) <= set(hints)


def test_safe_open_refuses_options_it_does_not_take(dtypes_file):
    refused = sorted(set(TABLE) - set(_taken_by("safe_open")) - {"device"})
    assert refused == ["names", "parts"], refused
    for key in (*refused, "chunk_size"):
        with pytest.raises(
            TypeError, match=f"safe_open\\(\\) got an unexpected keyword argument '{key}'"
        ):
            fastload.safe_open(dtypes_file, **{key: None})
    with fastload.safe_open(dtypes_file, verify=False, cache=False, concurrency=2) as f:
        assert f.keys()


def test_option_list_native_signatures():
    """The ``#[pyo3(signature)]``s (src/python/stream.rs, src/python/options.rs,
    src/python/reader.rs) take the options the table says each takes, as keyword-only
    parameters defaulting to None (not given)."""
    import inspect

    native, reader = _taken_by("native"), _taken_by("reader")
    for fn, place, want in (
        (fastload._fastload.Stream, "src/python/stream.rs: Stream::new", native + STREAM_ONLY),
        (fastload._fastload.resolve_options, "src/python/options.rs: resolve_options", native),
        (fastload._fastload.Reader, "src/python/reader.rs: Reader::new", reader),
    ):
        params = inspect.signature(fn).parameters
        kw = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        assert kw == want, f"{place}: #[pyo3(signature)]: {_differ(kw, want)}"
        assert all(params[n].default is None for n in kw), place


def test_option_list_conversion_errors_name_the_option():
    """A value of no accepted type is refused by the option's converter (src/python/args.rs),
    naming the option as the table spells it, for every option the native module takes."""
    from fastload import _fastload

    for name in _taken_by("native"):
        with pytest.raises(fastload.ConfigError) as info:
            _fastload.resolve_options(**{name: object()})
        assert info.value.option == name, f"src/python/args.rs: {name} -> {info.value.option}"
    for name in _taken_by("reader"):
        with pytest.raises(fastload.ConfigError) as info:
            _fastload.Reader(["model.safetensors"], **{name: object()})
        assert info.value.option == name, f"src/python/args.rs: {name} -> {info.value.option}"


def test_option_list_stub():
    """python/fastload/_fastload.pyi: ``Stream.__new__``, ``resolve_options`` and
    ``Reader.__new__`` list the options the table says each takes (stubtest checks the stub
    against the native module, this the stub against the table), typed as in Options, and the
    stub's docstring describes every native option."""
    stub = _parse("python/fastload/_fastload.pyi")
    aliases = _aliases(stub)
    found: dict[str, ast.FunctionDef] = {}
    for node in stub.body:
        if isinstance(node, ast.FunctionDef):
            found[node.name] = node
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{node.name}.{item.name}"] = item
    native, reader = _taken_by("native"), _taken_by("reader")
    for fn, want in (
        ("Stream.__new__", native + STREAM_ONLY),
        ("resolve_options", native),
        ("Reader.__new__", reader),
    ):
        where = f"python/fastload/_fastload.pyi: {fn}"
        params = _keyword_only(found[fn])
        assert list(params) == want, f"{where}: {_differ(list(params), want)}"
        for name in want:
            annotation, default = params[name]
            assert isinstance(default, ast.Constant) and default.value is None, (where, name)
            # The native `parts` are byte ranges (what fastload.Stream plans `parts` into).
            if name in TABLE and name not in STREAM_ONLY:
                got = _members(annotation, aliases)
                typed = _members(TABLE[name].type, OPTIONS_ALIASES)
                assert got == typed, f"{where}: {name}: {sorted(got)} != {sorted(typed)}"
    doc = ast.get_docstring(stub) or ""
    for name in native:
        assert f"- ``{name}``:" in doc, f"python/fastload/_fastload.pyi docstring: {name}"


def _docs_table(page: str, header: str) -> list[list[str]]:
    """The rows of the table under the line ``header`` in ``page`` (under docs/), as lists of
    cells; a link ``[text](target)`` reads as ``"text"``, as the option table's help writes it."""
    lines = (ROOT / "docs" / page).read_text().splitlines()
    start = lines.index(header) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        line = re.sub(r"\[([^\]]+)\]\([^)]+\)", r'"\1"', line)
        rows.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return rows


def test_option_list_docs():
    """docs/options.md's table has one row per option, in table order, with the table's
    words (an option's help and default are written in src/options.rs)."""
    rows = _docs_table("options.md", "| option | meaning | default | environment |")
    wanted = [
        [f"`{o.name}`", o.help, o.default, f"`{o.env}`" if o.env else ""] for o in TABLE.values()
    ]
    for want in wanted:
        line = "| " + " | ".join(want) + " |"
        assert want in rows, f"docs/options.md table: the row of {want[0]} should be\n{line}"
    names = [r[0] for r in rows]
    assert names == [w[0] for w in wanted], (
        f"docs/options.md table: {_differ(names, [w[0] for w in wanted])}"
    )


def test_option_list_engines():
    """The vLLM and SGLang loaders' extra-config keys: documented in each module's docstring
    and in docs/vllm.md's extra config keys table (the keys themselves are built from the table)."""
    import fastload.sglang
    import fastload.vllm
    from fastload import _integration

    for module in (fastload.vllm, fastload.sglang):
        for key in _integration.KEYS:
            assert f"``{key}``" in (module.__doc__ or ""), f"{module.__file__} docstring: {key}"
    rows = _docs_table("vllm.md", "| key | meaning |")
    keys = {r[0].strip("`") for r in rows}
    missing = sorted(_integration.KEYS - keys)
    assert not missing, f"docs/vllm.md extra config keys table lacks {missing}"


# ---------------------------------------------------------------------------------------------
# API edges


def test_names_as_one_str_is_one_tensor(dtypes_file):
    want = reference(dtypes_file)
    name = sorted(want)[0]
    got = fastload.load(dtypes_file, names=name)
    assert list(got) == [name]
    assert_same_tensors(got, {name: want[name]})


def test_process_group_of_the_wrong_type_is_a_config_error(dtypes_file):
    for bad in (5, object()):
        with pytest.raises(fastload.ConfigError) as info:
            fastload.load(dtypes_file, process_group=bad)
        assert info.value.option == "process_group"


def test_bad_device_lists_the_valid_ones(dtypes_file):
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(dtypes_file, device="gpu")
    assert info.value.option == "device"
    assert "cuda:N" in str(info.value) and "cpu" in str(info.value), info.value


def test_stats_after_close_are_the_final_counters(dtypes_file):
    s = fastload.stream(dtypes_file, memory_limit="1MiB")
    next(s)
    s.close()
    stats = s.stats()
    assert stats["tensors_delivered"] >= 1, stats
    assert stats["tensor_count"] == len(reference(dtypes_file)), stats


def test_load_without_torch_says_what_to_install(dtypes_file):
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import fastload\n"
        "try:\n"
        "    fastload.load(sys.argv[1])\n"
        "except ModuleNotFoundError as e:\n"
        "    print(e.name, '|', e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(dtypes_file)], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    name, message = out.stdout.split("|", 1)
    assert name.strip() == "torch" and "pip install torch" in message, out.stdout


@pytest.mark.parametrize("key", ["timeout", "connect_timeout", "pool_idle_timeout"])
@pytest.mark.parametrize("value", ["5 parsecs", "-3", "soon", "nan"])
def test_bad_durations_in_storage_options_name_the_option(key, value):
    """Checked when the store is built, before any request (the endpoint is never contacted)."""
    for uri in ("s3://bucket/m.safetensors", "http://127.0.0.1:9/m.safetensors"):
        options = {key: value}
        if uri.startswith("s3"):
            options |= {"endpoint": "http://127.0.0.1:9", "skip_signature": "true"}
        with pytest.raises(fastload.ConfigError) as info:
            fastload.load(uri, storage_options=options)
        assert info.value.option == f'storage_options["{key}"]'
        assert "not a duration" in str(info.value)


def test_good_durations_in_storage_options_are_accepted(tmp_path):
    """Seconds, fractions and units all pass the check (the load then fails to connect)."""
    for value in ("5", "2.5", "30s", "500ms", "2m"):
        with pytest.raises(fastload.StorageError):
            fastload.load(
                "http://127.0.0.1:9/m.safetensors",
                storage_options={"timeout": value, "connect_timeout": value, "max_retries": "0"},
            )


def test_empty_directory_names_the_directory_once(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(fastload.NotFoundError) as info:
        fastload.load(tmp_path)
    assert info.value.filename == str(tmp_path)
    assert str(info.value).count("no .safetensors files in this directory") == 1


def test_options_type_hints_resolve_without_importing_torch_first():
    # typing.get_type_hints evaluates the annotations; torch is imported only then, not by
    # `import fastload` (checked in a fresh interpreter).
    code = (
        "import sys, typing, fastload\n"
        "assert 'torch' not in sys.modules\n"
        "hints = typing.get_type_hints(fastload.Options)\n"
        "import torch\n"
        "assert hints['device'] == typing.Union[str, torch.device], hints['device']\n"
        "assert hints['concurrency'] == typing.Optional[int], hints['concurrency']\n"
        "print(sorted(hints))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "memory_limit" in out.stdout


# Endpoints from options and variables: a malformed one is a ConfigError naming where it came
# from, never a panic.
BAD_ENDPOINTS = ["data:,x", "mailto:x@y", "javascript:alert(1)", "ftp://host/x", "not a url"]


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
def test_a_malformed_hf_endpoint_is_a_config_error(hub_env, endpoint):
    hub_env.setenv("HF_ENDPOINT", endpoint)
    with pytest.raises(fastload.ConfigError) as e:
        fastload.load("hf://org/repo")
    assert e.value.option == "HF_ENDPOINT"
    assert "panicked" not in str(e.value) and "internal error" not in str(e.value)


@pytest.mark.parametrize("endpoint", BAD_ENDPOINTS)
@pytest.mark.parametrize(
    "uri, options",
    [
        ("hf://org/repo", {}),
        ("s3://bucket/x.safetensors", {"skip_signature": "true", "region": "us-east-1"}),
        ("gs://bucket/x.safetensors", {"skip_signature": "true"}),
        ("az://container/x.safetensors", {"account_name": "acct", "skip_signature": "true"}),
    ],
)
def test_a_malformed_endpoint_option_is_a_config_error(hub_env, uri, options, endpoint):
    hub_env.delenv("HF_ENDPOINT", raising=False)
    options = {**options, "endpoint": endpoint, "max_retries": "0", "retry_timeout": "1"}
    if uri.startswith("hf://"):
        options = {"endpoint": endpoint}
    with pytest.raises(fastload.ConfigError) as e:
        fastload.load(uri, storage_options=options)
    assert e.value.option == 'storage_options["endpoint"]', str(e.value)
    assert "panicked" not in str(e.value)


@pytest.mark.parametrize("var", ["AWS_ENDPOINT_URL", "AWS_ENDPOINT"])
def test_a_malformed_endpoint_variable_is_a_config_error(hub_env, var):
    hub_env.setenv(var, "data:,x")
    with pytest.raises(fastload.ConfigError) as e:
        fastload.load(
            "s3://bucket/x.safetensors",
            storage_options={"skip_signature": "true", "region": "us-east-1"},
        )
    assert e.value.option == var, str(e.value)


def test_the_cli_reports_a_malformed_endpoint(hub_env):
    env = {**os.environ, "HF_ENDPOINT": "data:,x", "RUST_BACKTRACE": "0"}
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "inspect", "hf://org/repo"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert proc.returncode == 1, proc.stderr
    assert "HF_ENDPOINT" in proc.stderr
    assert "panicked" not in proc.stderr


# A URI of the wrong type or empty.


@pytest.mark.parametrize("uri", [None, 3, [None], ["a.safetensors", 4]])
def test_a_uri_of_the_wrong_type_is_a_config_error(uri):
    for call in (fastload.load, fastload.stream, fastload.inspect):
        with pytest.raises(fastload.ConfigError) as e:
            call(uri)
        assert e.value.option == "uri"
        assert "NoneType" in str(e.value) or "int" in str(e.value)


@pytest.mark.parametrize("uri", ["", [""], ["  "]])
def test_an_empty_uri_is_a_config_error(uri):
    with pytest.raises(fastload.ConfigError) as e:
        fastload.load(uri)
    assert e.value.option == "uri"
    assert "empty" in str(e.value)
