"""Shared helpers for the fastload tests.

Fixture files are written by the reference writer (`safetensors.torch.save_file`) and every
result is compared bitwise against the reference reader (`safetensors.torch.load_file`).
Memory and I/O behaviour is measured in fresh interpreters (`run_probe`) so that the test
process's own allocations and page cache use cannot hide or fake a result.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import mmap
import os
import struct
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from fastload import _pagecache
from safetensors.torch import load_file, save_file

MiB = 1 << 20

# Every safetensors dtype this torch can represent, by its name in the file format. Written out
# here on purpose, not taken from fastload._torch: the tests' oracle must not come from the code
# under test. A dtype the package dropped or misnamed would drop out of every fixture built from
# its table, unseen; from this one, the fixtures keep it and the parity tests fail
# (test_parity.py checks the two tables agree).
_DTYPE_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
DTYPES = {k: getattr(torch, v) for k, v in _DTYPE_NAMES.items() if hasattr(torch, v)}

# Shapes every dtype is written with: scalar, empties, odd sizes that break alignment.
SHAPES = [(), (0,), (3, 0, 2), (1,), (7,), (3, 5), (2, 3, 4), (17, 13)]

# A few names that exercise JSON escaping and UTF-8 handling in the header.
UNICODE_NAMES = ["模型.权重", "ünïcödé/λ.bias", "emoji_🚀_tensor", "with space", 'quote"and\\slash']


def pattern(shape, dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic bytes that differ per position and per seed (no RNG: fast and stable)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = math.prod(shape)
    raw = (torch.arange(n * itemsize, dtype=torch.int64) * 131 + seed * 17 + 7) % 251
    if dtype == torch.bool:
        raw = raw % 2  # anything but 0/1 is not a valid torch bool
    return raw.to(torch.uint8).view(dtype).reshape(shape)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (NaN-safe bitwise comparison)."""
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def assert_same_tensors(got, want) -> None:
    """`got` (a dict from fastload) matches `want` (from the reference reader) bit for bit."""
    assert isinstance(got, dict), type(got)
    missing = sorted(set(want) - set(got))
    extra = sorted(set(got) - set(want))
    assert not missing and not extra, f"missing {missing[:5]}, unexpected {extra[:5]}"
    for name, ref in want.items():
        assert_same_tensor(got[name], ref, name)


def assert_same_tensor(t, ref: torch.Tensor, name: str = "") -> None:
    assert isinstance(t, torch.Tensor), f"{name}: {type(t)}"
    assert t.dtype == ref.dtype, f"{name}: dtype {t.dtype} != {ref.dtype}"
    assert tuple(t.shape) == tuple(ref.shape), (
        f"{name}: shape {tuple(t.shape)} != {tuple(ref.shape)}"
    )
    assert t.device.type == "cpu", f"{name}: on {t.device}"
    assert t.is_contiguous(), f"{name}: not contiguous (strides {t.stride()})"
    assert torch.equal(raw_bytes(t), raw_bytes(ref)), f"{name}: bytes differ"


def staged_stream_bitwise(path, **options) -> dict:
    """Streams `path` through the staged pipeline (`device="cuda"`, or `_target="host"`) with
    `options`; checks every tensor bit for bit against the reference reader and that every byte
    was copied; returns the stream's stats."""
    import fastload

    with fastload.Stream(path, **options) as s:
        got = dict(s)
        stats = s.stats()
    want = reference(path)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert_same_tensor(got[name].cpu(), ref, name)
    assert stats["bytes_copied"] == stats["total_bytes"], stats
    return stats


def cuda_stream_bitwise(path, **options) -> dict:
    """:func:`staged_stream_bitwise` to the GPU."""
    torch.cuda.synchronize()
    return staged_stream_bitwise(path, device="cuda", **options)


def reference(*paths) -> dict:
    """What `safetensors.torch.load_file` returns for these files, merged."""
    out: dict = {}
    for p in paths:
        out.update(load_file(str(p)))
    return out


# ---------------------------------------------------------------------------------------------
# Fixture builders (called once per session from conftest.py)


def write_all_dtypes(path: Path) -> Path:
    """Every dtype in every shape, unicode names, and a __metadata__ block."""
    tensors = {}
    for i, (dname, dtype) in enumerate(DTYPES.items()):
        for j, shape in enumerate(SHAPES):
            if dname == "F4" and shape == ():
                continue  # the reference writer cannot store a scalar of a sub-byte dtype
            tensors[f"{dname}.{'x'.join(map(str, shape)) or 'scalar'}"] = pattern(
                shape, dtype, seed=i * 31 + j
            )
    for k, name in enumerate(UNICODE_NAMES):
        tensors[name] = pattern((k + 2, 3), torch.float32, seed=1000 + k)
    save_file(tensors, str(path), metadata={"format": "pt", "note": "ünïcödé ✓"})
    return path


# Cycled through by the many-tiny-tensors checkpoint.
_TINY = [
    ((3,), torch.float32),
    ((5,), torch.float16),
    ((1,), torch.uint8),
    ((2, 2), torch.bfloat16),
    ((), torch.int64),
    ((0,), torch.float32),
    ((3,), torch.bool),
]


def write_many_tiny(path: Path, count: int = 20_500) -> Path:
    tensors = {}
    for i in range(count):
        shape, dtype = _TINY[i % len(_TINY)]
        tensors[f"blocks.{i}.w"] = pattern(shape, dtype, seed=i)
    save_file(tensors, str(path))
    return path


def write_sharded(directory: Path, shards: int = 3, per_shard: int = 4) -> Path:
    """A sharded checkpoint with model.safetensors.index.json, plus files the index doesn't name.

    `stray.safetensors` holds one name of its own and one that collides with an indexed tensor
    (with different bytes): reading it at all changes the result or raises.
    """
    directory.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    total = 0
    for s in range(shards):
        fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        tensors = {
            f"layers.{s * per_shard + k}.weight": pattern((64, 33), torch.bfloat16, seed=s * 10 + k)
            for k in range(per_shard)
        }
        if s == 0:
            tensors["embed.weight"] = pattern((100, 8), torch.float32, seed=99)
        save_file(tensors, str(directory / fname), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    save_file(
        {
            "stray.only": pattern((4,), torch.float32, seed=7),
            "layers.0.weight": pattern((3,), torch.uint8),
        },
        str(directory / "stray.safetensors"),
    )
    (directory / "config.json").write_text("{}")
    return directory


def indexed_files(directory: Path) -> list[Path]:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    return sorted({directory / f for f in index["weight_map"].values()})


def write_multi_block(path: Path, seed: int = 0) -> Path:
    """About 3 MiB in several dtypes, so that 64 KiB blocks split tensors many times over.
    Another `seed` gives another version of the same file: the same size and header, other
    values (an object overwritten with it can only be told apart by its ETag)."""
    tensors = {
        "embed.weight": pattern((512, 640), torch.float32, seed=seed + 1),
        "layer.0.q": pattern((640, 640), torch.bfloat16, seed=seed + 2),
        "layer.0.k": pattern((333, 641), torch.float16, seed=seed + 3),
        "layer.0.norm": pattern((641,), torch.float32, seed=seed + 4),
        "layer.0.ids": pattern((70_001,), torch.int64, seed=seed + 5),
        "layer.0.mask": pattern((99_999,), torch.bool, seed=seed + 6),
        "scalar": pattern((), torch.float64, seed=seed + 7),
        "empty": pattern((0, 4), torch.float32, seed=seed + 8),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


BIG_TENSORS = 64
BIG_ELEMS = 4 * MiB  # int32 elements per tensor: 16 MiB each, 1 GiB in all


def big_name(i: int) -> str:
    return f"layer.{i:03d}"


def write_big(path: Path) -> Path:
    """1 GiB of int32: tensor i holds arange(i*N, (i+1)*N), so any misplaced block shows."""
    tensors = {
        big_name(i): torch.arange(i * BIG_ELEMS, (i + 1) * BIG_ELEMS, dtype=torch.int32)
        for i in range(BIG_TENSORS)
    }
    save_file(tensors, str(path))
    return path


GIL_ELEMS = 128 * MiB  # one int32 tensor of 512 MiB


def write_one_tensor(path: Path) -> Path:
    save_file({"w": torch.arange(GIL_ELEMS, dtype=torch.int32)}, str(path))
    return path


# ---------------------------------------------------------------------------------------------
# Storage: what was read, whichever way the loader reads (pread, mmap, ...)


def evict(path) -> None:
    """Drops the file's pages from the page cache (fastload's one helper: fsync, then fadvise)."""
    _pagecache.evict(path)


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t] + [ctypes.c_int] * 3 + [ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def cached_bytes(path, start: int = 0, end: int | None = None) -> int:
    """Bytes of `path[start:end]` in the page cache (mincore), counted in whole pages.

    After evict(), this is what buffered reads or mappings of the file brought in from storage
    (plus the kernel's read-ahead), whether the loader uses pread or mmap.
    """
    size = os.path.getsize(path)
    if size == 0:
        return 0
    page = os.sysconf("SC_PAGE_SIZE")
    vec = ctypes.create_string_buffer((size + page - 1) // page)
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert _libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    first, last = start // page, (size if end is None else end) // page
    return sum(b & 1 for b in vec.raw[first:last]) * page


def data_offset(path) -> int:
    """Where the data section of a safetensors file starts."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


@contextlib.contextmanager
def mounted_tmpfs(where: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` (`"2m"`) mounted at `where`/tmpfs: a disk that fills, for the tests of
    writes that fail part-way; the test is skipped where mounting is not allowed."""
    mnt = where / "tmpfs"
    mnt.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mnt)], capture_output=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


# ---------------------------------------------------------------------------------------------
# Fresh-interpreter probes

PROBE_PRELUDE = textwrap.dedent(
    f"""
    import gc, json, os, resource, sys, threading, time
    import psutil
    import torch
    import fastload
    sys.path.insert(0, {str(Path(__file__).parent)!r})
    from helpers import cached_bytes, evict

    MiB = 1 << 20
    PROC = psutil.Process()
    """
    """
    def rss():
        return PROC.memory_info().rss

    def rchar():
        # Bytes passed through read()/pread() by every thread of this process, cached or not.
        return PROC.io_counters().read_chars

    def maxrss():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    class PeakRss:
        # Samples RSS from a thread; the loader releases the GIL, so sampling keeps going.
        def __enter__(self):
            self.peak = rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
            return self
        def _run(self):
            while not self._stop.is_set():
                self.peak = max(self.peak, rss())
                time.sleep(0.002)
        def __exit__(self, *exc):
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, rss())

    def settle(limit, timeout=5.0):
        # Waits (bounded) for RSS to fall under `limit`; returns the last reading.
        deadline = time.monotonic() + timeout
        while True:
            gc.collect()
            now = rss()
            if now <= limit or time.monotonic() > deadline:
                return now
            time.sleep(0.05)

    def emit(**kw):
        print("RESULT " + json.dumps(kw), flush=True)
    """
)


def start_probe(code: str, *args, env: dict | None = None) -> subprocess.Popen:
    """Starts PROBE_PRELUDE + `code` in a fresh interpreter (FASTLOAD_* taken from `env` only)."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    full_env.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-c", PROBE_PRELUDE + textwrap.dedent(code), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
    )


def finish_probe(proc: subprocess.Popen, timeout: float = 180) -> dict:
    """Waits for a probe; returns what it passed to emit()."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (
        f"probe failed (rc {proc.returncode})\nstdout:\n{stdout[-3000:]}\nstderr:\n{stderr[-3000:]}"
    )
    return json.loads(lines[-1][len("RESULT ") :])


def run_probe(code: str, *args, env: dict | None = None, timeout: float = 180) -> dict:
    return finish_probe(start_probe(code, *args, env=env), timeout)


def timed_error(exc_type, fn, deadline: float):
    """Runs `fn`, which must raise `exc_type` within `deadline` seconds; returns the exception."""
    started = time.monotonic()
    with pytest.raises(exc_type) as info:
        fn()
    took = time.monotonic() - started
    assert took < deadline, f"took {took:.1f} s to fail"
    return info.value


def bucket_objects(dtypes_file: Path, tiny_file: Path) -> dict[str, Path | bytes]:
    """The objects every object-store test bucket holds (beside the `sharded/` directory)."""
    return {
        "all.safetensors": dtypes_file,
        "tiny.safetensors": tiny_file,
        "plain/a.safetensors": dtypes_file,
        "plain/b.safetensors": tiny_file,
        "plain/notes.txt": b"not a checkpoint",
    }


def drain_by_threads(stream, workers: int, take) -> list[BaseException | None]:
    """`workers` threads iterate `stream` at once (started together), each item handed to
    `take(thread_index, name, tensor)` as it comes; returns what each thread raised (None where
    it reached the end). Fails if a consumer hangs."""
    raised: list[BaseException | None] = [None] * workers
    start = threading.Barrier(workers)

    def consume(i: int) -> None:
        try:
            start.wait(timeout=60)
            for name, tensor in stream:
                take(i, name, tensor)
        except BaseException as e:  # returned, for the test to judge with what was received
            raised[i] = e

    threads = [threading.Thread(target=consume, args=(i,), daemon=True) for i in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a consumer hung"
    return raised


def run_ranks(
    world: int, argv: list[str], logs: Path, env: dict, deadline: float, cwd=None
) -> None:
    """Runs ``argv`` as ranks 0 to ``world - 1`` of a torch.distributed group (``env://`` on
    127.0.0.1: ``MASTER_ADDR``/``MASTER_PORT``, ``WORLD_SIZE``, ``RANK`` and ``LOCAL_RANK`` set
    over ``env``), each logging to ``logs/rank{r}.log``. Ranks still running after ``deadline``
    seconds are killed; fails naming a rank stuck or exited with an error, with its log's tail."""
    from servers.s3 import rendezvous_port

    env = {
        **env,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(rendezvous_port()),
        "WORLD_SIZE": str(world),
    }
    procs = []
    for r in range(world):
        with open(logs / f"rank{r}.log", "wb") as log:
            procs.append(
                subprocess.Popen(
                    argv,
                    env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=cwd,
                )
            )
    end = time.monotonic() + deadline
    try:
        for p in procs:
            p.wait(timeout=max(end - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        pass
    finally:
        hung = [r for r, p in enumerate(procs) if p.poll() is None]
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

    def tail(r: int) -> str:
        return (logs / f"rank{r}.log").read_text(errors="replace")[-3000:]

    assert not hung, f"ranks {hung} still running after {deadline:.0f} s:\n{tail(hung[0])}"
    for r, p in enumerate(procs):
        assert p.returncode == 0, f"rank {r} exited with {p.returncode}:\n{tail(r)}"


def gloo_threads() -> int:
    """How many of this process's threads are torch.distributed's gloo group's (by their names)."""
    names = []
    for task in Path("/proc/self/task").iterdir():
        try:
            names.append((task / "comm").read_text().strip())
        except OSError:  # a thread that ended meanwhile
            pass
    return sum(n.startswith(("pt_gloo", "gloo")) for n in names)


def wait_held(manifest: Callable[[], dict], timeout: float = 60.0) -> dict:
    """A serve's manifest (asked by `manifest()`) once it holds every file: its background fill
    is done, so it answers from what it holds, not from its origin."""
    deadline = time.monotonic() + timeout
    while True:
        got = manifest()
        if all(f["held"] for c in got["checkpoints"] for f in c["files"]):
            return got
        assert time.monotonic() < deadline, got
        time.sleep(0.1)
