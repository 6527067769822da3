"""Credentials never appear in a message: a token or password a server echoes back, a URL's
password, a presigned URL's signature and session token, in the errors of the Python API, the
command line and `fastload bench`, before and after pickling."""

from __future__ import annotations

import json
import subprocess
import sys

import fastload
import pytest
from servers import answer

# The answering server's fixture, bound here so that pytest finds it.
serve = answer.serve
TOKEN = "hf_Echoed_Token_4242_abcdef"


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


# A presigned URL's signature and session token, and a URL's password, in a URI fastload was
# given: every message that shows the URI shows it without them.
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
