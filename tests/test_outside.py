"""Names from data never reach outside the model (issue 29, items 1 and 2): an index's
`weight_map` entry that leaves the checkpoint's folder (`..`, `%2e%2e`, a backslash, an absolute
path or URL, another bucket, a drive, NUL, `?`, `#`) is refused with a `ConfigError` naming the
index and the entry by every path that resolves an index (fastload.load, the engines' stream,
safe_open, the distributed header read, transformers, diffusers) before any byte outside the
prefix is requested; the small-file writers (`fetch_small_files`, `transformers.small_files` with
`auto_map`, the engines' object-store pull, diffusers' `model_index.json` components) never
write outside the destination, never through a link already in it, and never read outside the
prefix. Each test audits the servers' request logs and the files under its temporary folder;
property tests draw hostile names with hypothesis."""

from __future__ import annotations

import json
import os
import tempfile
import urllib.parse
from pathlib import Path

import fastload
import pytest
import torch
from audit import HOSTILE_PIECES, Tree, normal, outside, rust_debug
from fastload import _fastload, _integration
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save

# Entries that leave the folder `/m<i>/` of the test server, each in its own index. `{victim}`
# is the URL of another checkpoint on the same server (`/victim/model.safetensors`).
HOSTILE = [
    "../victim/model.safetensors",
    "sub/../../victim/model.safetensors",
    "%2e%2e/victim/model.safetensors",
    "%2E%2e/victim/model.safetensors",
    ".%2e/victim/model.safetensors",
    "..%2fvictim%2fmodel.safetensors",
    "%252e%252e/victim/model.safetensors",
    "..\\victim\\model.safetensors",
    "sub\\..\\..\\victim\\model.safetensors",
    "/victim/model.safetensors",
    "/etc/passwd",
    "{victim}",
    "s3://other/model.safetensors",
    "C:model.safetensors",
    "C:/victim/model.safetensors",
    "ok.safetensors\0../../victim/model.safetensors",
    "ok.safetensors?x=../../victim/model.safetensors",
    "ok.safetensors#../../victim/model.safetensors",
    "./ok.safetensors",
    "sub//ok.safetensors",
]

# A diffusers AutoencoderKL this small builds in milliseconds; transformers never reads it
# (the index is refused before the config is).
CONFIG = {
    "_class_name": "AutoencoderKL",
    "model_type": "llama",
    "block_out_channels": [8],
    "norm_num_groups": 8,
    "latent_channels": 4,
    "layers_per_block": 1,
    "sample_size": 8,
    "down_block_types": ["DownEncoderBlock2D"],
    "up_block_types": ["UpDecoderBlock2D"],
}
INDEXES = ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json")


def tensors_file(value: float) -> bytes:
    return save({"w": torch.full((4,), value)})


def index(entry: str) -> bytes:
    return json.dumps({"weight_map": {"ok": "ok.safetensors", "w": entry}}).encode()


def checkpoint(entry: str) -> dict[str, bytes]:
    """A checkpoint folder whose index names `entry` beside a good shard."""
    files = {name: index(entry) for name in INDEXES}
    files["ok.safetensors"] = tensors_file(1.0)
    files["config.json"] = json.dumps(CONFIG).encode()
    return files


def engines(uri: str, **kw):
    return dict(_integration.stream(uri, "cpu", _integration.Options("fastload"), **kw))


def transformers_load(uri: str, **kw):
    import fastload.transformers
    from transformers import LlamaForCausalLM

    return fastload.transformers.from_pretrained(LlamaForCausalLM, uri, **kw)


def diffusers_load(uri: str):
    import fastload.diffusers
    from diffusers import AutoencoderKL

    return fastload.diffusers.from_pretrained(AutoencoderKL, uri)


# Every path that resolves an index: what the engines (vLLM, SGLang) stream through, the header
# read every rank of a distributed load runs first, and the two libraries' wrappers.
PATHS = {
    "load": lambda uri: fastload.load(uri),
    "engines": engines,
    "safe_open": lambda uri: fastload.safe_open(uri + INDEXES[0]),
    "distributed": lambda uri: _fastload.checkpoint_tensors([uri]),
    "transformers": transformers_load,
    "diffusers": diffusers_load,
}


@pytest.fixture(scope="module")
def server():
    from servers.http import start_server

    server = start_server({"/victim/model.safetensors": tensors_file(666.0)})
    victim = server.url("victim/model.safetensors")
    for i, entry in enumerate(HOSTILE):
        server.put({f"/m{i}/{k}": v for k, v in checkpoint(entry.format(victim=victim)).items()})
    yield server
    server.close()


@pytest.fixture
def tmp_only(tmp_path, monkeypatch):
    """Python's temporary files under `tmp_path/tmp`: a test sees every file a call wrote."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    return tmp_path


def imported(library: str) -> None:
    """The library and the classes the tests load, imported before an audit starts: their
    imports write caches of their own (torch inductor's) under the temporary folder."""
    pytest.importorskip(library)
    import fastload.transformers
    from transformers import LlamaForCausalLM  # noqa: F401

    if library == "diffusers":
        import fastload.diffusers  # noqa: F401
        from diffusers import AutoencoderKL, DiffusionPipeline  # noqa: F401


def refused(call, uri: str, entry: str) -> fastload.ConfigError:
    with pytest.raises(fastload.ConfigError) as info:
        call(uri)
    assert f'"{rust_debug(entry)}"' in str(info.value), info.value
    return info.value


@pytest.mark.parametrize("path", list(PATHS))
def test_index_entries_outside_are_refused_before_any_request(server, tmp_only, path):
    if path in ("transformers", "diffusers"):
        imported(path)
    call = PATHS[path]
    victim = server.url("victim/model.safetensors")
    for i, raw in enumerate(HOSTILE):
        entry = raw.format(victim=victim)
        before = Tree(tmp_only)
        del server.behaviour.log[:]
        err = refused(call, server.url(f"m{i}/"), entry)
        assert err.option == "uri"
        assert f"m{i}/" in str(err), err  # names the index (or the checkpoint's folder)
        asked = [p for _, p, _, _ in server.behaviour.log]
        assert not outside(asked, f"/m{i}/"), (entry, asked)
        # Nothing left on disk (the small files' temporary folder is gone too).
        assert not before.created(), (entry, before.created())


def test_the_refusal_names_the_index_and_the_entry(server):
    err = refused(fastload.load, server.url("m0/"), HOSTILE[0])
    assert server.url("m0/model.safetensors.index.json") in str(err)
    assert '"w"' in str(err) and "climbs out with '..'" in str(err)
    pytest.importorskip("transformers")
    err = refused(transformers_load, server.url("m2/"), HOSTILE[2])
    assert server.url("m2/model.safetensors.index.json") in str(err)


def test_s3_index_naming_another_bucket_or_prefix(seaweed, tmp_only):
    """On S3 (through a relay that logs every request): neither another bucket nor another
    prefix of this one is asked for, by a load or by transformers."""
    from servers import s3 as s3_server
    from servers.s3 import HttpFaultProxy

    client = seaweed.client()
    s3_server.upload(client, s3_server.BUCKET, {"victim/model.safetensors": tensors_file(666.0)})
    entries = ["../victim/model.safetensors", "%2e%2e/victim/model.safetensors"]
    entries += ["s3://other/model.safetensors", f"s3://{s3_server.BUCKET}/victim/model.safetensors"]
    host, port = seaweed.endpoint.rsplit("//", 1)[1].split(":")
    with HttpFaultProxy((host, int(port))) as relay:
        options = {**seaweed.storage_options(), "endpoint": relay.endpoint}
        for i, entry in enumerate(entries):
            files = {f"hostile{i}/{k}": v for k, v in checkpoint(entry).items()}
            s3_server.upload(client, s3_server.BUCKET, files)
            uri = f"s3://{s3_server.BUCKET}/hostile{i}/"
            del relay.log[:]
            refused(lambda u: fastload.load(u, storage_options=options), uri, entry)
            if _has("transformers"):
                refused(lambda u: transformers_load(u, storage_options=options), uri, entry)
            targets = [t for _, t, _ in relay.log]
            assert targets, "the relay saw no request"
            for target in targets:
                # A listing names its folder in the query, percent-encoded (prefix=hostile0%2F).
                path, _, query = target.partition("?")
                prefix = dict(urllib.parse.parse_qsl(query)).get("prefix", "")
                where = normal(path) + "/" + prefix
                assert where.startswith(f"/{s3_server.BUCKET}/hostile{i}/"), (entry, target)


def test_hub_index_entries_outside_the_repo(tmp_path, monkeypatch):
    """hf://: an index naming another repo's file (`../../other/...`) or another folder is
    refused by a load and by transformers; the Hub is asked for nothing outside the repo."""
    from hf_models import use_hub
    from servers.hub import MockHub

    hub = MockHub()
    try:
        hub.add("org/victim", {"model.safetensors": tensors_file(666.0)})
        entries = ["../victim/model.safetensors", "%2e%2e/%2e%2e/org/victim/model.safetensors"]
        entries += ["..\\..\\org\\victim\\model.safetensors", "hf://org/victim/model.safetensors"]
        for i, entry in enumerate(entries):
            hub.add(f"org/hostile{i}", checkpoint(entry))
        use_hub(hub, monkeypatch, tmp_path)
        for i, entry in enumerate(entries):
            del hub.log[:]
            refused(fastload.load, f"hf://org/hostile{i}", entry)
            if _has("transformers"):
                refused(transformers_load, f"hf://org/hostile{i}", entry)
            for method, path, _ in hub.requests():
                assert "victim" not in normal(path), (entry, method, path)
            assert not [p for _, p, _ in hub.requests(hub.storage)], "no weight bytes were read"
    finally:
        hub.close()


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


# ------------------------------------------------------------------------- property tests

PIECES = st.sampled_from(HOSTILE_PIECES)
NAMES = st.lists(PIECES, min_size=1, max_size=8).map("".join)


def _url_path(url: str) -> list[str] | None:
    """The path segments a WHATWG URL parser makes of `url` (an http URL): ends stripped of
    controls and spaces, tabs and newlines removed, cut at `?` and `#`, `\\` read as `/`, dot
    segments (`.`, `..` and their `%2e` spellings) resolved; None where it leaves the host."""
    url = url.strip("".join(map(chr, range(0x21)))).replace("\t", "").replace("\n", "")
    url = url.replace("\r", "").split("?")[0].split("#")[0].replace("\\", "/")
    if not url.startswith("http://h/"):
        return None
    out: list[str] = []
    segments = url[len("http://h/") :].split("/")
    for i, seg in enumerate(segments):
        low = seg.lower()
        if low in ("..", ".%2e", "%2e.", "%2e%2e"):
            if out:
                out.pop()
            if i == len(segments) - 1:
                out.append("")
        elif low in (".", "%2e"):
            if i == len(segments) - 1:
                out.append("")
        else:
            out.append(seg)
    return out


def resolves_inside(name: str) -> bool:
    """Whether every reading of `name` joined to the folder `/base/` names something under it:
    as a POSIX path, as a Windows path (no drive), as the end of a URL built by joining strings
    (what the integrations do) and by resolving a reference (what a URL library does), and as a
    path a server decodes before resolving (`%2e%2e` is `..`, `%2f` is `/`)."""
    import posixpath
    import urllib.parse
    from pathlib import PureWindowsPath

    if not name or "\0" in name or PureWindowsPath(name).drive:
        return False
    for url in ("http://h/base/" + name, urllib.parse.urljoin("http://h/base/", name)):
        path = _url_path(url)
        if path is None or len(path) < 2 or path[0] != "base" or path[1:] == [""]:
            return False
    for text in (name, urllib.parse.unquote(name)):
        full = posixpath.normpath(posixpath.join("/base", text.replace("\\", "/")))
        if not full.startswith("/base/"):
            return False
    return True


@given(NAMES)
@settings(max_examples=400, deadline=None)
def test_check_inside_accepts_only_names_that_stay_inside(name):
    """What check_inside lets through stays inside under every reading (the converse is not
    asked: it also refuses some names that would stay inside, such as `a/./b` or `50%.json`)."""
    try:
        _fastload.check_inside(name, "s3://b/m/")
    except fastload.ConfigError as e:
        assert "s3://b/m/" in str(e) and e.option == "uri"
        return
    assert resolves_inside(name), name


@given(entry=NAMES)
@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_loads_of_generated_index_entries_stay_in_the_prefix(server, entry):
    """A load of an index naming a generated entry: refused with a ConfigError naming it when
    the entry leaves the folder, and never a request outside the folder whatever happens."""
    prefix = f"/gen{abs(hash(entry)) % 10**9}/"
    server.put({f"{prefix}{k}": v for k, v in checkpoint(entry).items()})
    del server.behaviour.log[:]
    try:
        _fastload.check_inside(entry, "")
        inside = True
    except fastload.ConfigError:
        inside = False
    try:
        fastload.load(server.url(prefix))
    except fastload.ConfigError as e:
        assert not inside and f'"{rust_debug(entry)}"' in str(e), e
    except fastload.FastloadError:
        assert inside  # a name inside the folder that is not there: NotFoundError and the like
    asked = [p for _, p, _, _ in server.behaviour.log]
    assert not outside(asked, prefix), (entry, asked)
    if not inside:
        assert asked == [f"{prefix}{INDEXES[0]}"], asked  # the index, nothing after it


# ------------------------------------------------------------------------- small files

# Names of small files (object keys, auto_map modules, components) that would write
# `outside/pwned.py` beside the destination `dest/` (or read outside the prefix).
HOSTILE_FILES = [
    "../outside/pwned.py",
    "sub/../../outside/pwned.py",
    "%2e%2e/outside/pwned.py",
    "..%2foutside%2fpwned.py",
    "..\\outside\\pwned.py",
    "{outside}/pwned.py",
    "C:pwned.py",
    "s3://other/pwned.py",
    "pwned.py\0",
    "pwned.py?x=../outside",
    "..  ",
]


@pytest.fixture
def small_server():
    """`/m/` with a config and tokenizer file; `/outside/pwned.py` beside it."""
    from servers.http import start_server

    server = start_server(
        {
            "/m/config.json": b"{}",
            "/m/tokenizer.json": b"{}",
            "/outside/pwned.py": b"raise SystemExit('pwned')",
        }
    )
    yield server
    server.close()


def hostile_files(tmp_path: Path) -> list[str]:
    return [n.format(outside=tmp_path / "outside") for n in HOSTILE_FILES]


def test_small_file_names_outside_are_refused_before_any_request(small_server, tmp_only):
    from fastload._remote_files import fetch_small_files

    dest = tmp_only / "dest"
    dest.mkdir()
    for name in hostile_files(tmp_only):
        before = Tree(tmp_only)
        del small_server.behaviour.log[:]
        with pytest.raises(fastload.ConfigError) as info:
            # A good name beside it: nothing is fetched once one name is refused.
            fetch_small_files(small_server.url("m/"), ["config.json", name], dest)
        assert f'"{rust_debug(name)}"' in str(info.value) and small_server.url("m/") in str(
            info.value
        )
        assert small_server.behaviour.log == [], name
        assert not before.created(), (name, before.created())


def test_auto_map_modules_outside_are_refused(small_server, tmp_only):
    """config.json's auto_map naming a module outside the folder: `small_files` (which fetches
    remote code without trust_remote_code) and `from_pretrained(trust_remote_code=True)` refuse
    it naming the config and the module; nothing is written outside the destination and nothing
    outside the prefix is asked for."""
    imported("transformers")
    for i, module in enumerate(["../../outside/pwned", "..\\..\\outside\\pwned", "%2e%2e/x"]):
        config = {"model_type": "llama", "auto_map": {"AutoModel": f"{module}.Model"}}
        small_server.put({f"/a{i}/config.json": json.dumps(config).encode()})
        dest = tmp_only / f"dest{i}"
        before = Tree(tmp_only)
        del small_server.behaviour.log[:]
        uri = small_server.url(f"a{i}/")
        for call, kw in (
            (fastload.transformers.small_files, {"dest": dest}),
            (transformers_load, {"trust_remote_code": True}),
        ):
            with pytest.raises(fastload.ConfigError) as info:
                call(uri, **kw)
            assert small_server.url(f"a{i}/config.json") in str(info.value)
            assert f'"{rust_debug(module)}.py"' in str(info.value), info.value
        assert not before.created(dest), (module, before.created(dest))
        asked = [p for _, p, _, _ in small_server.behaviour.log]
        assert asked and not outside(asked, f"/a{i}/"), asked


def test_pipeline_components_outside_are_refused(small_server, tmp_only):
    """model_index.json naming a component folder outside the checkpoint: refused before any
    component file is fetched."""
    imported("diffusers")
    from diffusers import DiffusionPipeline

    index = {"_class_name": "StableDiffusionPipeline", "../outside": ["diffusers", "X"]}
    small_server.put({"/p/model_index.json": json.dumps(index).encode()})
    before = Tree(tmp_only)
    del small_server.behaviour.log[:]
    with pytest.raises(fastload.ConfigError) as info:
        fastload.diffusers.from_pretrained(DiffusionPipeline, small_server.url("p/"))
    assert small_server.url("p/model_index.json") in str(info.value)
    assert '"../outside"' in str(info.value)
    assert [p for _, p, _, _ in small_server.behaviour.log] == ["/p/model_index.json"]
    assert not before.created()


def test_engine_pull_refuses_keys_outside(seaweed, tmp_only):
    """The engines' object-store pull (vLLM, SGLang) lists the prefix: a listed key that is not
    a plain name inside it is refused naming it, before anything is written or read past the
    listing."""
    import logging

    from servers import s3 as s3_server
    from servers.s3 import HttpFaultProxy

    client = seaweed.client()
    host, port = seaweed.endpoint.rsplit("//", 1)[1].split(":")
    for i, key in enumerate(["%2e%2e.json", "..%2fpwned.json", "C:pwned.json", "x?y.json"]):
        prefix = f"pull{i}/"
        s3_server.upload(
            client, s3_server.BUCKET, {f"{prefix}config.json": b"{}", prefix + key: b"{}"}
        )
        folder = tmp_only / f"engine{i}"
        before = Tree(tmp_only)
        with HttpFaultProxy((host, int(port))) as relay:
            options = {**seaweed.storage_options(), "endpoint": relay.endpoint}
            with pytest.raises(fastload.ConfigError) as info:
                _integration.pull_small_files(
                    f"s3://{s3_server.BUCKET}/{prefix}",
                    options,
                    str(folder),
                    True,
                    logging.getLogger("test"),
                )
            assert f'"{rust_debug(key)}"' in str(info.value)
            # The listing, nothing after it.
            assert [m for m, _, _ in relay.log] == ["GET"], relay.log
            assert f"prefix={prefix[:-1]}%2F" in relay.log[0][1], relay.log
        assert not before.created(), before.created()


def test_no_write_through_links_in_the_destination(small_server, tmp_only):
    """A link already in the destination (a folder `sub -> elsewhere/`, a file `config.json ->
    elsewhere/x`) is never written through: the write is refused naming it, and the file the
    link points to is untouched."""
    from fastload._remote_files import fetch_small_files

    small_server.put({"/m/sub/config.json": b'{"new": 1}'})
    elsewhere = tmp_only / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "x").write_text("precious")
    dest = tmp_only / "dest"
    dest.mkdir()
    (dest / "sub").symlink_to(elsewhere, target_is_directory=True)
    (dest / "config.json").symlink_to(elsewhere / "x")
    (dest / "tokenizer.json").mkdir()
    for name, what in [
        ("sub/config.json", "a symbolic link or not a directory"),
        ("config.json", "a symbolic link"),
        ("tokenizer.json", "not a regular file"),
    ]:
        with pytest.raises(fastload.StorageError, match=what) as info:
            fetch_small_files(small_server.url("m/"), [name], dest)
        assert str(dest / name.split("/")[0]) in str(info.value)
    assert sorted(p.name for p in elsewhere.iterdir()) == ["x"]
    assert (elsewhere / "x").read_text() == "precious"
    # The destination itself may be a link (a folder the user points elsewhere).
    (tmp_only / "real").mkdir()
    (tmp_only / "link").symlink_to(tmp_only / "real", target_is_directory=True)
    assert fetch_small_files(small_server.url("m/"), ["config.json"], tmp_only / "link")
    assert (tmp_only / "real" / "config.json").read_bytes() == b"{}"


@given(name=NAMES)
@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_generated_small_file_names_stay_in_the_destination(small_server, tmp_path, name):
    """fetch_small_files of a generated name: refused (ConfigError naming it, no request) when
    it leaves the folder; otherwise fetched inside the destination, or skipped when the store
    has no such object. Either way nothing is created outside the destination and nothing
    outside the prefix is asked for."""
    from fastload._remote_files import fetch_small_files

    root = Path(tempfile.mkdtemp(dir=tmp_path))
    dest = root / "dest"
    dest.mkdir()
    small_server.put({f"/m/{name}": b"x"})
    before = Tree(root)
    del small_server.behaviour.log[:]
    try:
        _fastload.check_inside(name, "")
        inside = True
    except fastload.ConfigError:
        inside = False
    try:
        got = fetch_small_files(small_server.url("m/"), [name], dest)
    except fastload.ConfigError as e:
        assert not inside and f'"{rust_debug(name)}"' in str(e), e
        assert small_server.behaviour.log == []
    else:
        assert inside
        assert got in ([], [name])
        if got:
            assert (dest / name).read_bytes() == b"x"
    assert not before.created(dest), (name, before.created(dest))
    asked = [p for _, p, _, _ in small_server.behaviour.log]
    assert not outside(asked, "/m/"), (name, asked)


def test_paths_helper_sees_writes(tmp_path):
    """The audit itself: a file written outside the allowed folder is seen."""
    before = Tree(tmp_path)
    (tmp_path / "dest").mkdir()
    (tmp_path / "dest" / "x").write_text("ok")
    (tmp_path / "stray").write_text("no")
    assert before.created(tmp_path / "dest") == ["stray"]
    assert os.path.exists(tmp_path / "stray")
    assert outside(["/m/a", "/m/%2e%2e/x", "/m/..\\x", "/m", "/m/b/../../x"], "/m/") == [
        "/m/%2e%2e/x",
        "/m/..\\x",
        "/m/b/../../x",
    ]
    assert Path(tmp_path).is_dir()
