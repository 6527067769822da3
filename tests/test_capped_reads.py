"""Bodies read whole (an index file, the Hub's API answers) stop at a cap, 100 MB, while they
stream: a huge or endless body is an error naming what was read, never memory exhausted."""

from __future__ import annotations

import json
from collections.abc import Iterator

import fastload
import pytest
from helpers import write_one_tensor
from servers import answer

# The answering server's fixture, bound here so that pytest finds it.
serve = answer.serve
COMMIT = "0123456789abcdef0123456789abcdef01234567"
# Over the 100 MB cap on bodies read whole.
HUGE = 120 * 1000 * 1000


def padded_json(prefix: bytes, total: int) -> Iterator[bytes]:
    """`prefix` then spaces, `total` bytes in all, in 1 MB chunks: valid JSON so far."""
    yield prefix
    left = total - len(prefix)
    block = b" " * (1 << 20)
    while left > 0:
        yield block[: min(left, len(block))]
        left -= len(block)


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
