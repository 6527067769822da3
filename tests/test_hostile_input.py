"""Input from outside, as a hostile user or a broken server gives it (issue 25, items 5, 6, 7, 10
and 11): malformed endpoints are a `ConfigError` naming the option, never a panic; bodies read
whole stop at a cap while they stream; credentials never appear in a message; a broken index file
is an error naming it, not skipped; and the odd inputs (None, "", non-UTF-8 paths, a tensor too
big to map, a file missing from an offline cache) each get the typed error the README describes.

Servers are tiny threaded HTTP servers on 127.0.0.1, started here.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import fastload
import huggingface_hub
import pytest
from helpers import assert_same_tensors, reference, run_probe, write_one_tensor
from servers.base import HUNG_UP, Handler, Server
from servers.hub import MockHub

TOKEN = "hf_Echoed_Token_4242_abcdef"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
BAD_ENDPOINTS = ["data:,x", "mailto:x@y", "javascript:alert(1)", "ftp://host/x", "not a url"]
# Over the 100 MB cap on bodies read whole.
HUGE = 120 * 1000 * 1000


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return monkeypatch


class _Handler(Handler):
    """Answers as `server.answer(handler)` says; HTTP/1.1 with chunked bodies available."""

    def do_GET(self):
        self.server.answer(self)

    do_HEAD = do_GET

    def reply(self, status: int, body: bytes = b"", headers=()) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def chunked(self, parts: Iterator[bytes], headers=()) -> None:
        """A 200 whose body has no Content-Length: only reading it tells how long it is."""
        self.send_response(200)
        self.send_header("Transfer-Encoding", "chunked")
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        try:
            for part in parts:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
            self.wfile.write(b"0\r\n\r\n")
        except HUNG_UP:
            pass
        self.close_connection = True


class AnswerServer(Server):
    def __init__(self, answer):
        self.answer = answer
        super().__init__(_Handler)


@pytest.fixture
def serve():
    servers: list[AnswerServer] = []

    def start(answer) -> AnswerServer:
        servers.append(AnswerServer(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def padded_json(prefix: bytes, total: int) -> Iterator[bytes]:
    """`prefix` then spaces, `total` bytes in all, in 1 MB chunks: valid JSON so far."""
    yield prefix
    left = total - len(prefix)
    block = b" " * (1 << 20)
    while left > 0:
        yield block[: min(left, len(block))]
        left -= len(block)


# -- 5. malformed endpoints -------------------------------------------------------------------


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


# -- 6. bodies read whole have a cap ---------------------------------------------------------


def test_a_huge_local_index_is_refused_without_reading_it(tmp_path):
    write_one_tensor(tmp_path / "a.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    with open(index, "wb") as f:
        f.write(b'{"weight_map": {"t": "a.safetensors"}')
        f.truncate(600 * 1000 * 1000)  # sparse: costs no disk
    for uri in (tmp_path, index):
        with pytest.raises(fastload.FormatError) as e:
            fastload.load(uri)
        assert e.value.path == str(index)
        assert "100000000 bytes" in str(e.value), str(e.value)


def api_answer(files: list[str]) -> bytes:
    return json.dumps({"sha": COMMIT, "siblings": [{"rfilename": f} for f in files]}).encode()


def test_a_huge_hub_api_answer_stops_at_the_cap(hub_env, serve):
    """A chunked answer (no Content-Length) is cut off at the cap while it streams."""
    sent = []

    def answer(h):
        body = padded_json(b'{"sha": "' + COMMIT.encode() + b'", "x": "', HUGE)
        sent.append(h.path)
        h.chunked(body)

    server = serve(answer)
    hub_env.setenv("HF_ENDPOINT", server.base)
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/repo")
    assert "more than 100000000 bytes" in str(e.value), str(e.value)
    assert "hf://org/repo@main" in str(e.value)
    assert sent and sent[0].startswith("/api/models/org/repo/revision/main")


def test_a_huge_hub_index_stops_at_the_cap(hub_env, serve):
    index = "model.safetensors.index.json"

    def answer(h):
        if h.path.startswith("/api/models/"):
            h.reply(200, api_answer([index, "a.safetensors"]))
        elif h.path.endswith(index) and h.command == "HEAD":
            h.reply(200, b"", [("ETag", '"abc"'), ("X-Linked-Size", "1000")])
        elif h.path.endswith(index):
            h.chunked(padded_json(b'{"weight_map": {"t": "a.safetensors", "x": "', HUGE))
        else:
            h.reply(404)

    server = serve(answer)
    hub_env.setenv("HF_ENDPOINT", server.base)
    with pytest.raises(fastload.FormatError) as e:
        fastload.load("hf://org/repo")
    assert "more than 100000000 bytes" in str(e.value), str(e.value)
    assert index in (e.value.path or "")


# -- 7. secrets never appear in messages -----------------------------------------------------


def echo(h) -> None:
    """A 4xx that repeats the request's Authorization header in a header and in the body."""
    auth = h.headers.get("Authorization", "")
    status = 404 if h.path.endswith("missing.safetensors") else 403
    body = f"<?xml version='1.0'?><Error><Code>Denied</Code><Message>{auth}</Message></Error>"
    h.reply(status, f"you sent {auth} {body}".encode(), [("X-Error-Message", f"you sent {auth}")])


def test_an_echoed_hub_token_is_scrubbed(hub_env, serve):
    server = serve(echo)
    hub_env.setenv("HF_ENDPOINT", server.base)
    hub_env.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/repo")
    text = str(e.value)
    assert "you sent" in text  # the Hub's message is still shown...
    assert TOKEN not in text and "4242" not in text  # ...without the token
    with pytest.raises(fastload.FastloadError) as e:
        fastload.load("hf://org/repo", storage_options={"token": TOKEN + "_option"})
    assert "4242" not in str(e.value)


@pytest.mark.parametrize("name", ["missing.safetensors", "denied.safetensors"])
def test_a_url_password_is_scrubbed(serve, name):
    server = serve(echo)
    host = server.base.removeprefix("http://")
    uri = f"http://user:PASS_w0rd_9@{host}/{name}"
    with pytest.raises(fastload.FastloadError) as e:
        fastload.load(uri, storage_options={"max_retries": "0"})
    shown = [str(e.value), str(getattr(e.value, "filename", "")), repr(e.value.args)]
    for text in shown:
        assert "PASS_w0rd_9" not in text, text
        # Basic auth sends base64("user:PASS_w0rd_9"); echoed, it is a credential too.
        assert "dXNlcjpQQVNTX3cwcmRfOQ" not in text, text


def test_the_cli_scrubs_a_url_password(serve):
    server = serve(echo)
    host = server.base.removeprefix("http://")
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "inspect", f"http://u:PASS_w0rd_9@{host}/d.bin"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert "PASS_w0rd_9" not in proc.stderr and "dXNlcjpQQVNTX3cwcmRfOQ" not in proc.stderr


# Issue 29, item 3: the surfaces the registry did not cover. A presigned URL's signature and
# session token, and a URL's password, in a URI fastload was given.
PRESIGNED = (
    "X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE7%2F20261126"
    "&X-Amz-Security-Token=FwoSessionToken77&X-Amz-Signature=deadbeef5151"
)
SECRET_PARTS = ("PASS_w0rd_9", "AKIAEXAMPLE7", "FwoSessionToken77", "deadbeef5151")


def assert_no_secret(text: str) -> None:
    for part in SECRET_PARTS:
        assert part not in text, text


@pytest.fixture
def sharded_server():
    from safetensors.torch import save
    from servers.http import start_server

    files = {
        "/m/a.safetensors": save({"a": torch_arange(4)}),
        "/m/b.safetensors": save({"b": torch_arange(8)}),
        "/m/model.safetensors.index.json": json.dumps(
            {"weight_map": {"a": "a.safetensors", "b": "b.safetensors"}}
        ).encode(),
    }
    server = start_server(files)
    yield server.base.removeprefix("http://")
    server.close()


def torch_arange(n: int):
    import torch

    return torch.arange(n, dtype=torch.float32)


@pytest.mark.parametrize("form", ["password", "presigned"])
def test_safe_open_of_an_index_url_shows_no_secret(sharded_server, form):
    path = "m/model.safetensors.index.json"
    uri = (
        f"http://user:PASS_w0rd_9@{sharded_server}/{path}"
        if form == "password"
        else f"http://{sharded_server}/{path}?{PRESIGNED}"
    )
    with pytest.raises(fastload.ConfigError) as e:
        fastload.safe_open(uri, framework="pt")
    assert "names 2" in str(e.value)  # the message is still there...
    assert_no_secret(str(e.value))  # ...without the credentials
    assert_no_secret(repr(e.value.args))


def test_errors_raised_in_python_are_scrubbed():
    import pickle

    uri = f"https://user:PASS_w0rd_9@host/m/?{PRESIGNED}"
    for err in (
        fastload.ConfigError(f"{uri}: bad", option="uri"),
        fastload.NotFoundError(f"{uri}config.json: no such object"),
        fastload.FormatError(f"{uri}: bad header", path=uri),
        fastload.TensorNotFoundError(f"{uri}: no tensor x", names=["x"], uri=uri),
    ):
        again = pickle.loads(pickle.dumps(err))
        for e in (err, again):
            texts = [str(e), repr(e.args), str(getattr(e, "path", "")), str(getattr(e, "uri", ""))]
            for text in texts:
                assert_no_secret(text)
            assert "user:***@host" in str(e)


@pytest.mark.parametrize("json_out", [False, True])
def test_bench_shows_no_secret(sharded_server, json_out):
    uri = f"http://user:PASS_w0rd_9@{sharded_server}/m/a.safetensors?{PRESIGNED}"
    args = ["bench", "--repeat", "1", uri] + (["--json"] if json_out else [])
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", *args], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert_no_secret(proc.stdout + proc.stderr)
    if json_out:
        shown = json.loads(proc.stdout)["uris"]
        # The query goes with every request (a presigned URL), so it is a secret whole.
        assert shown == [f"http://user:***@{sharded_server}/m/a.safetensors?***"]
    else:
        assert "user:***@" in proc.stdout


# -- 10. broken index files are errors naming the index ---------------------------------------


@pytest.mark.parametrize("kind", ["dangling link", "fifo", "link to /dev/zero", "directory"])
def test_a_broken_index_is_an_error_naming_it(tmp_path, kind):
    write_one_tensor(tmp_path / "a.safetensors")
    write_one_tensor(tmp_path / "stray.safetensors")
    index = tmp_path / "model.safetensors.index.json"
    if kind == "dangling link":
        index.symlink_to(tmp_path / "gone.json")
    elif kind == "fifo":
        os.mkfifo(index)
    elif kind == "directory":
        index.mkdir()
    else:
        index.symlink_to("/dev/zero")
    with pytest.raises(fastload.FastloadError) as e:
        fastload.load(tmp_path)
    assert str(index) in str(e.value)
    assert not isinstance(e.value, fastload.NotFoundError) or e.value.filename == str(index)


# -- 11. messages and types -------------------------------------------------------------------


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


def test_non_utf8_paths_load(tmp_path):
    """Linux paths are bytes: a bytes path and its os.fsdecode() form (with surrogates) load."""
    raw = os.fsencode(tmp_path) + b"/caf\xe9-\xff"
    os.mkdir(raw)
    # The reference writer takes UTF-8 paths only: written under a plain name, then renamed.
    plain = write_one_tensor(tmp_path / "w.safetensors")
    want = reference(plain)
    os.rename(plain, raw + b"/w\xff.safetensors")
    for uri in (raw, os.fsdecode(raw), raw + b"/w\xff.safetensors", Path(os.fsdecode(raw))):
        assert_same_tensors(fastload.load(uri), want)
    assert [t["name"] for t in fastload.inspect(raw)["tensors"]] == list(want)
    with pytest.raises(fastload.NotFoundError) as e:
        fastload.load(raw + b"/missing\xff.safetensors")
    assert "missing" in str(e.value)
    # The command line too (its arguments are bytes on Linux).
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "inspect", raw, "--json"],
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert b'"w"' in proc.stdout


def test_a_tensor_too_big_to_map_names_the_file_and_tensor(tmp_path):
    """Under an address-space limit, a 1 TiB tensor (in a sparse file) cannot be mapped: the
    error says which file and tensor, whatever the method."""
    path = tmp_path / "huge.safetensors"
    n = 1 << 40
    header = {
        "small": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "huge_tensor": {"dtype": "U8", "shape": [n], "data_offsets": [8, 8 + n]},
    }
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        f.truncate(8 + len(h) + 8 + n)
    got = run_probe(
        """
        import resource, sys, fastload
        vm = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmSize"))
        limit = vm * 1024 + (8 << 30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        out = {}
        for method in ("read", "mmap"):
            try:
                fastload.load(sys.argv[1], method=method, names=["huge_tensor"])
                out[method] = None
            except fastload.FastloadError as e:
                out[method] = [type(e).__name__, str(e)]
        emit(**out)
        """,
        path,
    )
    for method, (kind, text) in got.items():
        assert kind == "StorageError", (method, text)
        assert str(path) in text and "huge_tensor" in text, (method, text)


def test_offline_a_missing_file_is_not_found_and_a_missing_revision_is_named(
    hub_env, tmp_path, dtypes_file
):
    hub = MockHub()
    try:
        commit = hub.add("org/m", {"model.safetensors": dtypes_file.read_bytes()})
        cache = tmp_path / "hf_home" / "hub"
        huggingface_hub.snapshot_download("org/m", endpoint=hub.base, cache_dir=cache)
    finally:
        hub.close()
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    hub_env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert_same_tensors(fastload.load("hf://org/m"), reference(dtypes_file))
    for uri in ("hf://org/m/nope.safetensors", f"hf://org/m@{commit}/nope.safetensors"):
        with pytest.raises(fastload.NotFoundError) as e:
            fastload.load(uri)
        assert "nope.safetensors" in e.value.filename, e.value.filename
        assert "revision" not in str(e.value), str(e.value)
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/m@v9/model.safetensors")
    assert not isinstance(e.value, fastload.NotFoundError)
    assert "revision v9" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
