"""Raw limits measured in the same run as the loaders: page cache control, disk and memory rates.

- disk O_DIRECT: the storage's own rate, many requests in flight, page cache bypassed (fio io_uring,
  8 MiB requests, queue depth 32; a Python thread pool of O_DIRECT preadv if there is no fio).
- disk buffered x8 / x1: cold, 8 readers on 8 regions (or one reader) through the page cache, so the
  kernel's readahead runs ahead of each. On these virtual disks 8 buffered readers were consistently
  faster than O_DIRECT at queue depth 32 (2.0-2.8 vs 0.9-2.4 GB/s), so both count as the cold limit.
- page-cache read: warm, buffered 8 MiB read() calls by one thread into a reused buffer
  (copy_to_user). Plain Python: fio's psync reads from page cache came out 2x slower here, varying a
  lot, which would understate the ceiling.
- memcpy: 1 GiB copy between pre-faulted buffers, 1 thread (numpy) and torch's intra-op threads.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

MiB = 2**20


# --- page cache ---


def evict(paths: list[str]) -> None:
    """Drop the files' pages from the page cache (flushing any dirty ones first)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[str]) -> None:
    """Read the files once through the page cache."""
    buf = bytearray(8 * MiB)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass


def resident_bytes(paths: list[str]) -> int | None:
    """Bytes of the files in the page cache (util-linux fincore), or None if it cannot tell."""
    if not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *paths],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
        return sum(int(x) for x in out.split())
    except (subprocess.SubprocessError, ValueError):
        return None


# --- disk ---


def _regions(paths: list[str], streams: int) -> list[tuple[str, int, int]]:
    """(path, offset, length): the files cut into about `streams` contiguous regions of equal
    bytes (8 MiB aligned); one stream reads the files one after another."""
    sizes = [os.path.getsize(p) for p in paths]
    share = -(-sum(sizes) // streams)
    share = -(-share // (8 * MiB)) * 8 * MiB
    out = []
    for p, size in zip(paths, sizes):
        for off in range(0, size, share):
            out.append((p, off, min(share, size - off)))
    return out


def _fio(paths: list[str], direct: bool, iodepth: int, streams: int) -> dict:
    """Sequential 8 MiB reads; streams > 1 runs one fio job per region, all at once."""
    glob = [
        "[global]",
        "rw=read",
        "bs=8M",
        "invalidate=0",
        "group_reporting=1",
        f"direct={int(direct)}",
        f"iodepth={iodepth}",
        "ioengine=io_uring" if direct else "ioengine=psync",
    ]
    jobs = []
    if streams == 1:
        names = ":".join(p.replace(":", "\\:") for p in paths)  # fio separates files with ':'
        jobs += ["[s0]", f"filename={names}", "file_service_type=sequential"]
    else:
        for i, (p, off, length) in enumerate(_regions(paths, streams)):
            jobs += [
                f"[s{i}]",
                f"filename={p.replace(':', chr(92) + ':')}",
                f"offset={off}",
                f"size={length}",
            ]
    with tempfile.NamedTemporaryFile("w", suffix=".fio", delete=False) as f:
        f.write("\n".join(glob + jobs) + "\n")
    try:
        out = subprocess.run(
            ["fio", "--readonly", "--output-format=json", f.name],
            capture_output=True,
            text=True,
            timeout=600,
            check=True,
        ).stdout
    finally:
        os.unlink(f.name)
    read = json.loads(out[out.index("{") :])["jobs"][0]["read"]
    how = "io_uring O_DIRECT" if direct else "psync buffered"
    return {
        "gb_per_s": read["bw_bytes"] / 1e9,
        "bytes": read["io_bytes"],
        "seconds": read["runtime"] / 1e3,
        "tool": f"fio {how}, 8 MiB, {streams} stream(s) x queue depth {iodepth}",
    }


def _python_direct(paths: list[str], streams: int, threads: int = 32, block: int = 8 * MiB) -> dict:
    """O_DIRECT preadv of 8 MiB blocks from a thread pool, into page-aligned reused buffers; the
    regions' blocks are interleaved so all streams advance together."""
    per_region = [
        [(p, o) for o in range(off, off + length, block)]
        for p, off, length in _regions(paths, streams)
    ]
    tasks = [t for group in itertools.zip_longest(*per_region) for t in group if t]
    bufs = [mmap.mmap(-1, block) for _ in range(threads)]
    fds = {p: os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths}
    free = list(range(threads))

    def one(task):
        i = free.pop()
        try:
            return os.preadv(fds[task[0]], [bufs[i]], task[1])
        finally:
            free.append(i)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        total = sum(ex.map(one, tasks))
    seconds = time.perf_counter() - t0
    for fd in fds.values():
        os.close(fd)
    return {
        "gb_per_s": total / seconds / 1e9,
        "bytes": total,
        "seconds": seconds,
        "tool": f"python O_DIRECT preadv, {threads} threads, {block // MiB} MiB,"
        f" {streams} stream(s)",
    }


def disk_direct(paths: list[str], streams: int = 1) -> dict:
    """The storage's own rate: O_DIRECT, 32 reads of 8 MiB in flight (spread over `streams`
    regions read at once; on this virtual disk that made no difference)."""
    if shutil.which("fio"):
        try:
            return _fio(paths, direct=True, iodepth=max(4, 32 // streams), streams=streams)
        except (subprocess.SubprocessError, ValueError, KeyError) as e:
            print(f"fio failed ({e}); using the Python O_DIRECT reader", file=sys.stderr)
    return _python_direct(paths, streams)


def _python_buffered(paths: list[str], readers: int) -> dict:
    """Each reader reads its region in order with 8 MiB read()s into one reused buffer."""

    def reader(region):
        p, off, length = region
        buf = memoryview(bytearray(8 * MiB))
        n = 0
        with open(p, "rb", buffering=0) as f:
            f.seek(off)
            while n < length:
                got = f.readinto(buf[: min(len(buf), length - n)])
                if not got:
                    break
                n += got
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(readers) as ex:
        total = sum(ex.map(reader, _regions(paths, readers)))
    seconds = time.perf_counter() - t0
    return {
        "gb_per_s": total / seconds / 1e9,
        "bytes": total,
        "seconds": seconds,
        "tool": f"python buffered read, {readers} readers, 8 MiB",
    }


def buffered_read(paths: list[str], readers: int, prefer_fio: bool = True) -> dict:
    if prefer_fio and shutil.which("fio"):
        try:
            return _fio(paths, direct=False, iodepth=1, streams=readers)
        except (subprocess.SubprocessError, ValueError, KeyError) as e:
            print(f"fio failed ({e}); using Python reads", file=sys.stderr)
    return _python_buffered(paths, readers)


# --- memory ---


def memcpy(size: int = 2**30, repeat: int = 5) -> dict:
    """Copy between two pre-faulted buffers; best of repeat. Runs in this process."""
    import numpy as np
    import torch

    src = np.ones(size, dtype=np.uint8)
    dst = np.zeros(size, dtype=np.uint8)
    best = min(_timed(lambda: np.copyto(dst, src)) for _ in range(repeat))
    ts, td = torch.from_numpy(src), torch.from_numpy(dst)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    best_t = min(_timed(lambda: td.copy_(ts)) for _ in range(repeat))
    fresh = _timed(lambda: np.ones(size, dtype=np.uint8))
    return {
        "numpy_1thread_gb_per_s": size / best / 1e9,
        "torch_gb_per_s": size / best_t / 1e9,
        "torch_threads": torch.get_num_threads(),
        "fresh_fill_gb_per_s": size / fresh / 1e9,
        "bytes": size,
    }


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


if __name__ == "__main__":
    # python benches/limits.py memcpy  -> one JSON line (run.py calls this in a fresh process)
    if sys.argv[1:] == ["memcpy"]:
        print(json.dumps(memcpy()))
    else:
        files = sys.argv[1:]
        evict(files)
        print("direct 1 stream", disk_direct(files))
        evict(files)
        print("buffered cold x8", buffered_read(files, 8))
        evict(files)
        print("buffered cold x1", buffered_read(files, 1))
        warm(files)
        print("page cache", buffered_read(files, 1, prefer_fio=False))
