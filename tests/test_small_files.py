"""The small files beside a checkpoint (issue 29, items 7, 10 and 12): a reused destination is
refreshed when the checkpoint changed (kept only while the store says a file is unchanged), six
processes filling one destination all succeed, the pulls for libraries and engines fetch what
they read and nothing else (a repo of 1,500 files costs a handful of requests; weights and other
binaries are never pulled with the config; a large file nobody requires is skipped, a required
one is an error), and the temporary folder of `small_files(uri)` is gone when the process exits.
Request audits: the servers' logs; filesystem audits: tests/audit.py."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import fastload
import pytest
from audit import Tree, normal, outside
from fastload import _fastload, _integration, _remote_files

# --------------------------------------------------------------------- item 7: stale files


@pytest.fixture
def s3_model(seaweed, request):
    """A fresh prefix of SeaweedFS (it answers If-None-Match) and its storage options."""
    from servers import s3 as s3_server

    prefix = f"small-{request.node.name[:40]}-{os.getpid()}/"

    def put(files: dict[str, bytes]) -> None:
        s3_server.upload(
            seaweed.client(), s3_server.BUCKET, {prefix + k: v for k, v in files.items()}
        )

    def delete(name: str) -> None:
        seaweed.client().delete_object(Bucket=s3_server.BUCKET, Key=prefix + name)

    uri = f"s3://{s3_server.BUCKET}/{prefix}"
    return uri, seaweed.storage_options(), put, delete


def test_a_reused_destination_follows_the_checkpoint(s3_model, tmp_path):
    """small_files(dest=...) twice, the checkpoint changed in between (config and tokenizer
    rewritten, a tokenizer file deleted): the destination holds the new files, not the old."""
    pytest.importorskip("transformers")
    import fastload.transformers

    uri, options, put, delete = s3_model
    put({"config.json": b'{"v": 1}', "tokenizer.json": b'{"t": 1}', "vocab.txt": b"a\n"})
    dest = tmp_path / "dest"
    fastload.transformers.small_files(uri, storage_options=options, dest=dest)
    assert (dest / "config.json").read_bytes() == b'{"v": 1}'
    assert (dest / "vocab.txt").is_file()
    put({"config.json": b'{"v": 2}', "tokenizer.json": b'{"t": 2}'})
    delete("vocab.txt")
    fastload.transformers.small_files(uri, storage_options=options, dest=dest)
    assert (dest / "config.json").read_bytes() == b'{"v": 2}'
    assert (dest / "tokenizer.json").read_bytes() == b'{"t": 2}'
    assert not (dest / "vocab.txt").exists()


def test_unchanged_files_are_kept_and_tampered_ones_fetched_again(s3_model, tmp_path):
    """A second fetch of unchanged objects keeps the files (the store answers "not modified" to
    the ETag they were fetched at); a file changed on disk since is fetched again."""
    uri, options, put, _ = s3_model
    put({"config.json": b'{"v": 1}', "tokenizer.json": b'{"t": 1}'})
    dest = tmp_path / "dest"
    dest.mkdir()
    names = ["config.json", "tokenizer.json"]
    assert _remote_files.fetch_small_files(uri, names, dest, storage_options=options) == names
    inodes = {n: (dest / n).stat().st_ino for n in names}
    (dest / "tokenizer.json").write_bytes(b"edited")
    edited = (dest / "tokenizer.json").stat().st_ino
    assert _remote_files.fetch_small_files(uri, names, dest, storage_options=options) == names
    assert (dest / "config.json").stat().st_ino == inodes["config.json"]  # not rewritten
    assert (dest / "tokenizer.json").read_bytes() == b'{"t": 1}'
    assert (dest / "tokenizer.json").stat().st_ino != edited
    # What the record keeps is the store's answer: asked with its ETag, the store says "not
    # modified" and the file is kept.
    meta = json.loads((dest / ".cache/fastload/config.json.json").read_text())
    assert meta["etag"] and meta["uri"] == uri + "config.json"
    got = _fastload.fetch_small_file(
        uri + "config.json", str(dest), "config.json", 100, storage_options=options
    )
    assert got == ("kept", 0)


def test_a_destination_reused_for_another_checkpoint_gets_its_files(tmp_path):
    """A destination filled from one checkpoint, then from another whose server gives its
    config the same ETag (nginx's is the file's mtime and size: two files of one size written in
    the same second share it): each copy records the object it copies, as the local cache's
    copies do, so the other checkpoint's file is fetched, not kept as "not modified"."""
    from servers.http import start_server

    a = start_server({"/m/config.json": b'{"v": 1}'})
    b = start_server({"/m/config.json": b'{"v": 2}'})
    try:
        a.etags["/m/config.json"] = b.etags["/m/config.json"] = '"5f3a1c-8"'
        dest = tmp_path / "dest"
        assert _remote_files.fetch_small_files(a.url("m/"), ["config.json"], dest)
        assert _remote_files.fetch_small_files(a.url("m/"), ["config.json"], dest)
        assert [r[3] for r in a.behaviour.log] == [200, 304]  # kept: the server said so
        assert _remote_files.fetch_small_files(b.url("m/"), ["config.json"], dest)
        assert (dest / "config.json").read_bytes() == b'{"v": 2}'
    finally:
        a.close()
        b.close()


def test_the_engine_pull_removes_files_whose_objects_are_gone(s3_model, tmp_path):
    """vLLM's folder for a URI is reused between runs: a tokenizer file deleted from the prefix
    must not stay behind (a stale extra tokenizer file changes what the tokenizer loads)."""
    uri, options, put, delete = s3_model
    put({"config.json": b"{}", "tokenizer.model": b"old", "tokenizer.json": b"{}"})
    folder = tmp_path / "engine"
    log = logging.getLogger("test")
    _integration.pull_small_files(uri, options, str(folder), True, log)
    assert (folder / "tokenizer.model").read_bytes() == b"old"
    (folder / "mine.json").write_text("{}")  # not fastload's: left alone
    delete("tokenizer.model")
    put({"config.json": b'{"v": 2}'})
    _integration.pull_small_files(uri, options, str(folder), True, log)
    assert not (folder / "tokenizer.model").exists()
    assert (folder / "config.json").read_bytes() == b'{"v": 2}'
    assert (folder / "mine.json").is_file()


FILL = """
import sys, time, os
from pathlib import Path
import fastload.transformers

uri, dest, go = sys.argv[1:4]
while not os.path.exists(go):  # all start together
    time.sleep(0.005)
folder = fastload.transformers.small_files(uri, dest=dest)
# (Other processes' temporary files may be there while they write.)
print(sorted(p.name for p in Path(folder).iterdir() if p.is_file() and p.name[0] != "."))
"""


def test_six_processes_fill_one_destination(tmp_path):
    """Six processes fill one destination at once, over many files: all succeed, and every file
    is whole (each written under a unique temporary name, renamed into place)."""
    pytest.importorskip("transformers")
    from servers.http import start_server

    files = {f"/m/{n}": json.dumps({"n": n, "pad": "x" * (1 << 20)}).encode() for n in
             ["config.json", "generation_config.json", *_remote_files.TOKENIZER_FILES]}  # fmt: skip
    server = start_server(files)
    try:
        dest, go = tmp_path / "dest", tmp_path / "go"
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", FILL, server.url("m/"), str(dest), str(go)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for _ in range(6)
        ]
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        server.close()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    want = sorted(k[len("/m/") :] for k in files)
    assert all(out.strip() == repr(want) for out, _ in outs), outs
    for k, v in files.items():
        assert (dest / k[len("/m/") :]).read_bytes() == v
    # No temporary file left behind.
    assert sorted(p.name for p in dest.iterdir() if p.is_file()) == want


# ------------------------------------------------------------- item 10: only what is read

# Beside the model: binaries of other frameworks and a repo's worth of other files.
JUNK = {
    "tf_model.h5": b"h5" * 1000,
    "rust_model.ot": b"ot" * 1000,
    "model.nemo": b"nemo" * 1000,
    "model.Q4_K_M.gguf": b"gguf" * 1000,
    "pytorch_model.bin": b"bin" * 1000,
    "training_args.pt": b"pt" * 1000,
    "flax_model.msgpack": b"mp" * 1000,
    "README.md": b"# a model",
    "assets/logo.png": b"png",
    "original/params.json": b"{}",
}
SMALL = {
    "tokenizer.json": b"{}",
    "tokenizer_config.json": b"{}",
    "special_tokens_map.json": b"{}",
    "chat_template.jinja": b"{{ messages }}",
    "modeling_tiny.py": b"# code",
}
CAP = 1 << 20  # the small-file limit the tests set; big.json is over it


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> dict[str, bytes]:
    pytest.importorskip("transformers")
    from hf_models import tree, write_llama

    return tree(write_llama(tmp_path_factory.mktemp("llama") / "llama"))


def many_files(llama: dict[str, bytes], count: int) -> dict[str, bytes]:
    """The model, its tokenizer files, `JUNK`, a 2 MiB `big.json` and `count` more files."""
    files = {**llama, **SMALL, **JUNK, "big.json": b" " * (2 * CAP)}
    files.update({f"data/part-{i:05d}.json": b"{}" for i in range(count)})
    return files


@pytest.fixture
def many_hub(llama, monkeypatch, tmp_path):
    from hf_models import use_hub
    from servers.hub import MockHub

    hub = MockHub()
    hub.add("org/many", many_files(llama, 1500))
    use_hub(hub, monkeypatch, tmp_path)
    yield hub
    hub.close()


def fetched(hub) -> list[str]:
    """The repo files the Hub was asked for (HEAD or GET of `resolve/`)."""
    out = []
    for _, path, _ in hub.requests():
        parts = normal(path).split("/", 5)
        if len(parts) == 6 and parts[3] == "resolve":
            out.append(parts[5])
    return sorted(set(out))


def test_transformers_from_a_hub_repo_of_many_files(many_hub, llama, tmp_path):
    """from_pretrained of a Hub repo of 1,500 files fetches the config, the generation config and
    the weights (streamed), asking the Hub a handful of times."""
    import fastload.transformers
    from transformers import LlamaForCausalLM

    before = Tree(tmp_path)
    model = fastload.transformers.from_pretrained(LlamaForCausalLM, "hf://org/many")
    assert model.config.hidden_size == 32
    assert fetched(many_hub) == ["config.json", "generation_config.json", "model.safetensors"]
    assert len(many_hub.requests()) < 20, many_hub.requests()
    # Only the HF cache (and transformers' own caches) were written.
    assert not [p for p in before.created(tmp_path / "hf_home") if "fastload" in p]


REMOTE_CONFIG = b"""
from transformers import LlamaConfig


class HubRemoteConfig(LlamaConfig):
    model_type = "hub_remote_tiny"
"""
REMOTE_MODEL = b"""
from transformers import LlamaForCausalLM

from .configuration_hub import HubRemoteConfig
from .helpers import NAME


class HubRemoteModel(LlamaForCausalLM):
    config_class = HubRemoteConfig
    flavour = NAME
"""


def test_remote_code_from_a_hub_repo_fetches_the_modules_it_uses(llama, monkeypatch, tmp_path):
    """trust_remote_code from a Hub repo: the modules auto_map names and the modules they import
    relatively, not the repo's other code (nor its other files)."""
    import fastload.transformers
    from hf_models import use_hub
    from servers.hub import MockHub
    from transformers import AutoModelForCausalLM

    config = json.loads(llama["config.json"])
    config["model_type"] = "hub_remote_tiny"
    config["auto_map"] = {
        "AutoConfig": "configuration_hub.HubRemoteConfig",
        "AutoModelForCausalLM": "modeling_hub.HubRemoteModel",
    }
    files = {**many_files(llama, 50), "config.json": json.dumps(config).encode()}
    files["configuration_hub.py"] = REMOTE_CONFIG
    files["modeling_hub.py"] = REMOTE_MODEL
    files["helpers.py"] = b"NAME = 'helped'\n"
    files["unrelated.py"] = b"raise SystemExit('never fetched')\n"
    hub = MockHub()
    try:
        hub.add("org/remote", files)
        use_hub(hub, monkeypatch, tmp_path)
        model = fastload.transformers.from_pretrained(
            AutoModelForCausalLM, "hf://org/remote", trust_remote_code=True
        )
        assert type(model).__name__ == "HubRemoteModel" and model.flavour == "helped"
        code = [f for f in fetched(hub) if f.endswith(".py")]
        assert code == ["configuration_hub.py", "helpers.py", "modeling_hub.py"], code
        assert "model.nemo" not in fetched(hub) and "data/part-00000.json" not in fetched(hub)
    finally:
        hub.close()


def test_small_files_from_a_hub_repo_of_many_files(many_hub):
    import fastload.transformers

    folder = fastload.transformers.small_files("hf://org/many")
    want = ["config.json", "generation_config.json", "special_tokens_map.json", "tokenizer.json"]
    want += ["tokenizer_config.json", "chat_template.jinja"]
    assert fetched(many_hub) == sorted(want)
    assert sorted(p.name for p in folder.iterdir()) == sorted(want)


def test_engines_pull_from_a_hub_repo_of_many_files(many_hub, monkeypatch, caplog, tmp_path):
    """vLLM's and SGLang's download_model for a Hub repo: the small files an engine reads, at the
    repo's root, none of the binaries, the large file skipped with a log line, in a handful of
    requests; `config.json` over the limit is an error."""
    monkeypatch.setattr(_integration, "SMALL_FILE_LIMIT", CAP)
    with caplog.at_level(logging.WARNING):
        folder = _integration.download_small_files("org/many", None, str(tmp_path / "dl"), None)
    want = sorted(["config.json", "generation_config.json", *SMALL])
    assert fetched(many_hub) == want
    assert sorted(p.name for p in Path(folder).iterdir()) == want
    assert len(many_hub.requests()) < 3 + 2 * len(want), many_hub.requests()
    assert any("big.json" in r.getMessage() and "skipped" in r.getMessage() for r in caplog.records)
    # The user's ignore patterns still apply.
    folder = _integration.download_small_files("org/many", None, str(tmp_path / "dl2"), ["*.py"])
    assert "modeling_tiny.py" not in os.listdir(folder)
    monkeypatch.setattr(_integration, "SMALL_FILE_LIMIT", 10)
    with pytest.raises(fastload.StorageError, match=r"config\.json: \d+ bytes, more than"):
        _integration.download_small_files("org/many", None, str(tmp_path / "dl3"), None)


@pytest.mark.parametrize("var", ["HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"])
def test_engines_pull_into_the_cache_the_environment_names(many_hub, monkeypatch, tmp_path, var):
    """With no download folder, an engine's Hub pull fills the Hugging Face cache the environment
    names now, the one its weights' hf:// reads use (the legacy ``HUGGINGFACE_HUB_CACHE`` over
    ``HF_HOME``; ``XDG_CACHE_HOME`` without it), though huggingface_hub read its variables when
    it was imported."""
    import huggingface_hub  # noqa: F401 (imported before the variable changes)

    monkeypatch.setenv(var, str(tmp_path / "named"))
    if var == "XDG_CACHE_HOME":
        monkeypatch.delenv("HF_HOME")
    cache = tmp_path / "named"
    cache = cache if var == "HUGGINGFACE_HUB_CACHE" else cache / "huggingface" / "hub"
    folder = Path(_integration.download_small_files("org/many", None, None, None))
    assert folder.parent.parent == cache / "models--org--many"
    assert (folder / "config.json").is_file()


def test_engines_pull_from_an_object_store_prefix_of_many_files(
    seaweed, llama, monkeypatch, caplog, tmp_path
):
    """The engines' object-store pull: one listing, then the small files an engine reads; none of
    the binaries; an unexpected large file skipped with a log line (config.json over the limit is
    an error); audited through a relay."""
    from servers import s3 as s3_server
    from servers.s3 import HttpFaultProxy

    files = {k: v for k, v in many_files(llama, 0).items() if "/" not in k}
    files.update({f"img_{i:03d}.png": b"png" for i in range(100)})
    prefix = f"many-{os.getpid()}/"
    s3_server.upload(seaweed.client(), s3_server.BUCKET, {prefix + k: v for k, v in files.items()})
    monkeypatch.setattr(_integration, "SMALL_FILE_LIMIT", CAP)
    host, port = seaweed.endpoint.rsplit("//", 1)[1].split(":")
    before = Tree(tmp_path)
    with HttpFaultProxy((host, int(port))) as relay, caplog.at_level(logging.WARNING):
        options = {**seaweed.storage_options(), "endpoint": relay.endpoint}
        uri = f"s3://{s3_server.BUCKET}/{prefix}"
        folder = tmp_path / "engine"
        _integration.pull_small_files(uri, options, str(folder), True, logging.getLogger("t"))
    want = sorted(["config.json", "generation_config.json", *SMALL])
    assert sorted(p.name for p in folder.iterdir() if p.is_file()) == want
    gets = [normal(t) for m, t, _ in relay.log if m == "GET" and "list-type" not in t]
    assert sorted(gets) == sorted(f"/{s3_server.BUCKET}/{prefix}{n}" for n in want)
    assert len(relay.log) == 1 + len(want), relay.log  # the listing, then each file once
    assert not outside(
        [t for _, t, _ in relay.log if "list-type" not in t], f"/{s3_server.BUCKET}/{prefix}"
    )
    assert any("big.json" in r.getMessage() for r in caplog.records)
    assert not before.created(folder)
    monkeypatch.setattr(_integration, "SMALL_FILE_LIMIT", 10)
    with pytest.raises(fastload.StorageError, match=r"config\.json: \d+ bytes, more than"):
        _integration.pull_small_files(
            f"s3://{s3_server.BUCKET}/{prefix}",
            seaweed.storage_options(),
            str(tmp_path / "other"),
            True,
            logging.getLogger("t"),
        )


def test_optional_files_over_the_limit_are_skipped_required_ones_refused(tmp_path):
    """By name (transformers, diffusers): an optional file over the limit is skipped, unread;
    a required one (the config, an index) is an error naming it."""
    from servers.http import start_server

    server = start_server({"/m/config.json": b"{}", "/m/tokenizer.json": b" " * 5000})
    try:
        dest = tmp_path / "dest"
        dest.mkdir()
        got = _remote_files.fetch_small_files(
            server.url("m/"), ["config.json", "tokenizer.json"], dest, max_size=1000
        )
        assert got == ["config.json"] and not (dest / "tokenizer.json").exists()
        with pytest.raises(fastload.StorageError, match=r"tokenizer\.json: 5000 bytes, more than"):
            _remote_files.fetch_small_files(
                server.url("m/"),
                ["tokenizer.json"],
                dest,
                max_size=1000,
                required=["tokenizer.json"],
            )
    finally:
        server.close()


# ------------------------------------------------------------ item 12: the temporary folder

EXIT = """
import os, sys
import fastload.transformers

folder = fastload.transformers.small_files(sys.argv[1])
assert (folder / "config.json").is_file()
pid = os.fork()
if pid == 0:
    sys.exit(0)  # a forked child's exit (atexit runs) leaves its parent's folder alone
os.waitpid(pid, 0)
assert folder.is_dir(), "the child removed the parent's folder"
print(folder)
"""


def test_the_temporary_folder_is_removed_at_exit(tmp_path):
    pytest.importorskip("transformers")
    from servers.http import start_server

    server = start_server({"/m/config.json": b"{}"})
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
        env["TMPDIR"] = str(tmp_path)
        out = subprocess.run(
            [sys.executable, "-c", EXIT, server.url("m/")],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
    finally:
        server.close()
    assert out.returncode == 0, out.stderr[-3000:]
    folder = Path(out.stdout.strip())
    assert folder.name.startswith("fastload-small-files-") and folder.parent == tmp_path
    assert not folder.exists()
    assert not list(tmp_path.iterdir())


def test_closing_a_checkpoint_removes_its_folder_now(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    ckpt = _remote_files.open_checkpoint("s3://bucket/model/")
    assert ckpt.local.is_dir() and ckpt.local.name.startswith("fastload-small-files-")
    ckpt.close()
    assert not list(tmp_path.iterdir())
    assert str(ckpt.local) not in _remote_files._temporary
