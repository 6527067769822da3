"""Local files that change or are not what they seem (issue 14, items 4, 6 and 7): a file cut
short or replaced under a running load fails with a clear StorageError before any affected tensor
is handed out; the files open at once do not grow with the shard count; a FIFO, device or socket
is refused before it is opened, and an index that is one (or a dangling link, a folder) is an
error naming it; non-UTF-8 paths load; a tensor too big to map names its file and tensor. Cases
that would crash or hang before their fix run in a fresh interpreter with a timeout."""

from __future__ import annotations

import ctypes
import json
import os
import socket
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import fastload
import pytest
import torch
from fastload._pagecache import evict, resident_bytes
from helpers import assert_same_tensors, reference, run_probe, write_one_tensor
from safetensors.torch import save_file

MiB = 1 << 20


def run(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# Streams 8 tensors of 1 MiB one segment at a time; after the first tensor the file is changed
# (cut inside the last page of tensor 5, or replaced); every tensor handed out must equal the
# file's original bytes, and the stream must end with a StorageError naming the file.
CHANGE_UNDER_LOAD = """
    import os, sys
    import fastload, torch
    from safetensors.torch import load_file, save_file

    path, method, change = sys.argv[1], sys.argv[2], sys.argv[3]
    # Copies: safetensors' own tensors map the file, so they would change with it.
    want = {k: v.clone() for k, v in load_file(path).items()}
    out = []
    try:
        s = fastload.stream(path, method=method, block_size="256KiB", memory_limit="1MiB")
        for i, (name, t) in enumerate(s):
            assert t.equal(want[name]), f"{name} differs from the file's bytes"
            out.append(name)
            del t
            if i == 0:
                if change == "truncate":
                    # 100 bytes short of tensor t5's end: the rest of its last page reads as 0.
                    with open(path, "r+b") as f:
                        f.truncate(os.path.getsize(path) - 2 * (1 << 20) - 100)
                else:
                    other = path + ".new"
                    save_file({k: v + 1 for k, v in want.items()}, other)
                    os.replace(other, path)
        print("NO ERROR", out)
    except fastload.StorageError as e:
        print("StorageError", repr(str(e)), e.filename, out)
"""


@pytest.mark.parametrize("method", ["mmap", "read"])
@pytest.mark.parametrize("change", ["truncate", "replace"])
def test_file_changed_under_a_running_load(tmp_path, method, change):
    path = tmp_path / "m.safetensors"
    save_file({f"t{i}": torch.full((MiB // 4,), i, dtype=torch.float32) for i in range(8)}, path)
    proc = run(CHANGE_UNDER_LOAD, str(path), method, change)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("StorageError"), proc.stdout + proc.stderr
    assert str(path) in proc.stdout
    assert "changed while loading" in proc.stdout or "truncated" in proc.stdout, proc.stdout
    assert "Bad address" not in proc.stdout
    assert ("replaced" if change == "replace" else "truncated") in proc.stdout
    # Nothing of t5 or after came out (the cut is in t5; each tensor handed out was checked).
    assert "'t5'" not in proc.stdout.split("StorageError")[1].rsplit("[", 1)[1]


SHARDS = """
    import resource, sys
    import fastload

    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    uri = sys.argv[1]
    inspected = fastload.inspect(uri)["files"]
    loaded = fastload.load(uri)
    print(len(inspected), len(loaded))
"""


def test_more_shards_than_the_open_file_limit(tmp_path):
    d = tmp_path / "many"
    d.mkdir()
    for i in range(1500):
        save_file({f"s{i}": torch.tensor([i], dtype=torch.int32)}, d / f"{i:04}.safetensors")
    proc = run(SHARDS, str(d), timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["1500", "1500"]


def _fifo(tmp_path):
    path = tmp_path / "pipe.safetensors"
    os.mkfifo(path)
    return path


def _socket(tmp_path):
    path = tmp_path / "sock.safetensors"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    return path


def _device(tmp_path):
    path = tmp_path / "dev.safetensors"
    path.symlink_to("/dev/zero")  # a character device under a checkpoint's name
    return path


REFUSE = """
    import sys
    import fastload

    for reader in (fastload.load, fastload.inspect):
        try:
            reader(sys.argv[1])
            print("NO ERROR")
        except fastload.FormatError as e:
            print(type(e).__name__, e.path, str(e))
"""


@pytest.mark.parametrize(
    "make, kind",
    [(_fifo, "FIFO"), (_socket, "socket"), (_device, "character device")],
    ids=["fifo", "socket", "device"],
)
@pytest.mark.parametrize("in_dir", [False, True], ids=["file", "directory"])
def test_non_regular_files_are_refused_before_opening(tmp_path, make, kind, in_dir):
    path = make(tmp_path)
    if in_dir:
        save_file({"a": torch.zeros(2)}, tmp_path / "a.safetensors")
    # A FIFO would block the open for ever: the timeout turns that into a failure.
    proc = run(REFUSE, str(tmp_path if in_dir else path), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout
    for line in lines:
        assert line.startswith(f"FormatError {path} "), line
        assert f"is a {kind}, not a regular file" in line


def test_index_file_that_is_a_fifo(tmp_path):
    path = tmp_path / "model.safetensors.index.json"
    os.mkfifo(path)
    proc = run(REFUSE, str(path), timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count("is a FIFO, not a regular file") == 2, proc.stdout


def test_directory_named_like_a_shard_is_still_skipped(tmp_path):
    save_file({"a": torch.ones(2)}, tmp_path / "a.safetensors")
    (tmp_path / "sub.safetensors").mkdir()
    assert fastload.load(tmp_path)["a"].equal(torch.ones(2))


def _mapped_rss(path) -> int:
    """Bytes of this process's mappings of `path` that are in memory (/proc/self/smaps `Rss`)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if "-" in head[0] and len(head) >= 5:  # a mapping's header line
                inside = head[-1] == str(path)
            elif inside and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


def _evict(path) -> bool:
    """Drops `path` from the page cache; whether fincore then counts no page of it."""
    evict(path)
    return resident_bytes(path) == 0


def _kernel_has_cachestat(path) -> bool:
    """Whether cachestat(2) (Linux 6.5+; number 451 on every architecture) answers here: without
    it fastload cannot tell cached pages and populates every window, as before."""
    libc = ctypes.CDLL(None, use_errno=True)
    rng = (ctypes.c_uint64 * 2)(0, 4096)
    out = (ctypes.c_uint64 * 5)()
    with open(path, "rb") as f:
        return libc.syscall(451, f.fileno(), rng, out, 0) == 0


@pytest.fixture
def six_tensors(tmp_path):
    """A file of six int32 tensors of 4 MiB (24 MiB), and the tensors; skipped where the kernel
    cannot tell fastload which pages are cached (without it every window is populated)."""
    path = tmp_path / "m.safetensors"
    tensors = {f"t{i}": torch.arange(i * MiB, (i + 1) * MiB, dtype=torch.int32) for i in range(6)}
    save_file(tensors, path)
    if not _kernel_has_cachestat(path):
        pytest.skip("the kernel has no cachestat(2) (Linux < 6.5): fastload cannot tell")
    return path, tensors


def test_cached_files_are_mapped_lazily_and_others_populated(six_tensors):
    # Pages already in the page cache are mapped, not populated: each faults in on first access
    # (as safetensors' own mapping does), so the mapping holds no pages until the tensors are
    # read. Pages that are not cached are read in parallel before the tensor is handed out.
    path, want = six_tensors
    total = 24 * MiB
    for cached in (True, False):
        if not cached and not _evict(path):
            pytest.skip("cannot drop the file from the page cache here")
        with fastload.stream(path, method="mmap", memory_limit="16MiB") as s:
            got = dict(s)
            stats = s.stats()
        assert stats["bytes_read"] == stats["total_bytes"] == total
        if cached:
            assert stats["bytes_cached"] == total
            assert _mapped_rss(path) < total // 2
        else:
            # Populating a segment reads ahead into the next ones, which then are cached.
            assert stats["bytes_cached"] < total
            assert _mapped_rss(path) >= total - stats["bytes_cached"]
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert got[name].equal(t), name
        assert _mapped_rss(path) >= total
        del got


# A fresh interpreter loads a file whose pages are all cached: the load maps it on the calling
# thread, so the process has as many threads after the load as before (no runtime, no worker,
# no thread started to open it). Then the same file with pages to read: those are read by the
# runtime's threads, and the tensors are the same.
NO_THREAD_WHEN_WARM = """
    import json, os, sys
    import fastload, torch
    from fastload._pagecache import evict, resident_bytes

    def threads():
        return len(os.listdir("/proc/self/task"))

    path = sys.argv[1]
    before = threads()
    s = fastload.stream(path)
    warm = dict(s)
    out = {"before": before, "after": threads(), "cached": s.stats()["bytes_cached"],
           "total": s.stats()["total_bytes"]}
    evict(path)
    out["evicted"] = resident_bytes(path) == 0
    cold = fastload.load(path)
    out["cold_threads"] = threads()
    out["equal"] = warm.keys() == cold.keys() and all(warm[k].equal(cold[k]) for k in warm)
    print(json.dumps(out))
"""


def test_a_warm_load_starts_no_thread(six_tensors):
    path, _ = six_tensors
    with open(path, "rb") as f:  # every page cached, whatever happened since the write
        f.read()
    done = run(NO_THREAD_WHEN_WARM, str(path))
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["cached"] == out["total"] == 24 * MiB, out
    assert out["after"] == out["before"], out
    assert out["equal"], out
    if out["evicted"]:  # pages to read: the runtime's threads read them
        assert out["cold_threads"] > out["before"], out


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
