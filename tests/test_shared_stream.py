"""One stream, several consumer threads (issue 25, item 2): like a queue, each tensor is handed to
exactly one caller, none is lost, and the stream ends (or fails) for every caller."""

from __future__ import annotations

import fastload
import pytest
import torch
from helpers import drain_by_threads
from safetensors.torch import load_file, save_file

COUNT = 2000


@pytest.fixture(scope="module")
def many_small(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "many.safetensors"
    g = torch.Generator().manual_seed(25)
    tensors = {
        f"layer.{i}.w": torch.randint(-1000, 1000, (100 + i % 500,), generator=g, dtype=torch.int32)
        for i in range(COUNT)
    }  # 2.8 MB: about 11 segments of 256 KiB with memory_limit="1MiB"
    save_file(tensors, path)
    return path


def drain(stream, workers: int, want: dict | None = None):
    """`workers` threads iterate `stream` at once; returns the names each got, the names whose
    bytes differ from `want`, and what each thread raised. Tensors are checked and dropped as they
    come (as a consumer moving them to their place would), which keeps the consumers racing."""
    got: list[list[str]] = [[] for _ in range(workers)]
    wrong: list[str] = []

    def take(i, name, tensor):
        got[i].append(name)
        if want is not None and not (
            tensor.dtype == want[name].dtype and torch.equal(tensor, want[name])
        ):
            wrong.append(name)

    raised = drain_by_threads(stream, workers, take)
    return got, wrong, raised


@pytest.mark.parametrize("workers", [2, 4, 8])
@pytest.mark.parametrize("method", ["mmap", "read"])
def test_every_tensor_exactly_once(many_small, workers, method):
    want = load_file(many_small)
    for _ in range(5):
        # Small buffers: several segments, so that the consumers contend for each.
        stream = fastload.stream(many_small, method=method, memory_limit="1MiB", block_size="4KiB")
        got, wrong, raised = drain(stream, workers, want)
        assert raised == [None] * workers
        names = [name for per in got for name in per]
        assert len(names) == COUNT, f"{COUNT - len(names)} tensors lost"
        assert sorted(names) == sorted(want)
        assert wrong == []
        assert stream.stats()["tensors_delivered"] == COUNT


def test_close_ends_every_consumer_with_an_error(many_small):
    """A close() while consumers share the stream: each raises StreamClosedError (none ends as if
    the load were complete), and no tensor is handed out twice."""
    stream = fastload.stream(many_small, memory_limit="1MiB", block_size="4KiB")
    first = next(stream)
    stream.close()
    got, _, raised = drain(stream, 4)
    assert all(isinstance(e, fastload.StreamClosedError) for e in raised), raised
    names = [first[0]] + [name for per in got for name in per]
    assert len(names) == len(set(names))


@pytest.mark.parametrize("method", ["mmap", "read"])
def test_a_failed_load_fails_for_every_consumer(many_small, tmp_path, method):
    """The file is cut short while the stream still has segments to read: every consumer raises
    the load's error (a StorageError naming the file); none sees a plain end of iteration."""
    path = tmp_path / "cut.safetensors"
    data = many_small.read_bytes()
    path.write_bytes(data)
    stream = fastload.stream(path, method=method, memory_limit="1MiB", block_size="4KiB")
    first = next(stream)
    with open(path, "r+b") as f:
        f.truncate(len(data) // 2)
    got, _, raised = drain(stream, 4)
    assert all(isinstance(e, fastload.StorageError) for e in raised), raised
    assert all(str(path) in str(e) for e in raised), raised
    names = [first[0]] + [name for per in got for name in per]
    assert len(names) == len(set(names)) < COUNT
