"""fastload.stream: every tensor once, owning its memory, bounded buffers, prompt cancellation.

Memory and I/O claims are measured in fresh interpreters (helpers.run_probe) on a 1 GiB
checkpoint of 64 int32 tensors; `memory_limit` is far below the checkpoint size, so a loader that
stages the file, ignores back-pressure or keeps reading after the consumer left shows up as
hundreds of MiB of resident memory or bytes read, not as a few percent.
"""

from __future__ import annotations

import gc
import textwrap
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

import fastload
from helpers import (
    BIG_ELEMS,
    BIG_TENSORS,
    MiB,
    assert_same_tensor,
    assert_same_tensors,
    big_name,
    indexed_files,
    pattern,
    reference,
    run_probe,
)

LIMIT = 64 * MiB

# Checks a tensor of the big checkpoint from a sample (full compares would allocate 16 MiB each).
CHECK_BIG = f"""
N = {BIG_ELEMS}
def check(name, t):
    i = int(name.split(".")[1])
    lo = i * N
    return (t.dtype == torch.int32 and t.shape == (N,) and t.is_contiguous()
            and int(t[0]) == lo and int(t[-1]) == lo + N - 1
            and torch.equal(t[::4097], torch.arange(lo, lo + N, 4097, dtype=torch.int32)))
"""


def big_probe(code: str, *args) -> dict:
    return run_probe(CHECK_BIG + textwrap.dedent(code), *args)


def collect(it) -> dict:
    out = {}
    for item in it:
        assert isinstance(item, tuple) and len(item) == 2, item
        name, t = item
        assert isinstance(name, str)
        assert name not in out, f"{name} yielded twice"
        out[name] = t
    return out


# ---------------------------------------------------------------------------------------------
# Results


def test_stream_yields_every_tensor_once(dtypes_file):
    assert_same_tensors(collect(fastload.stream(dtypes_file)), reference(dtypes_file))


def test_stream_many_tiny_tensors(tiny_file):
    assert_same_tensors(collect(fastload.stream(tiny_file)), reference(tiny_file))


def test_stream_sharded_directory(sharded_dir):
    got = collect(fastload.stream(sharded_dir))
    assert "stray.only" not in got
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


def test_stream_names(dtypes_file):
    want = reference(dtypes_file)
    chosen = ["C64.2x3x4", "F8_E5M2.7", "BOOL.17x13"]
    assert_same_tensors(collect(fastload.stream(dtypes_file, names=chosen)), {n: want[n] for n in chosen})


def test_stream_missing_name_raises_key_error(dtypes_file):
    with pytest.raises(KeyError, match="no_such_tensor"):
        collect(fastload.stream(dtypes_file, names=["F32.7", "no_such_tensor"]))


def test_stream_is_an_iterator(dtypes_file):
    it = fastload.stream(dtypes_file, names=["F32.7"])
    assert iter(it) is it
    name, t = next(it)
    assert name == "F32.7"
    assert_same_tensor(t, reference(dtypes_file)["F32.7"])
    for _ in range(2):
        with pytest.raises(StopIteration):
            next(it)


def test_large_tensors_stream_through_small_buffers(tmp_path):
    path = tmp_path / "large.safetensors"
    save_file(
        {
            "odd": pattern((4 * MiB + 13,), torch.uint8, seed=1),
            "f64": pattern((512, 1024), torch.float64, seed=2),  # 4 MiB
            "tiny": pattern((3,), torch.int16, seed=3),
        },
        str(path),
    )
    got = collect(fastload.stream(path, block_size="64KiB", memory_limit="1MiB"))
    assert_same_tensors(got, reference(path))


def test_kept_tensors_survive_buffer_reuse(tmp_path):
    # 12 MiB through a 1 MiB limit: the loader must reuse its buffers many times over, and
    # none of that may reach a tensor already handed out.
    path = tmp_path / "many.safetensors"
    save_file({f"t{i:02d}": pattern((64 * 1024,), torch.float32, seed=i) for i in range(48)}, str(path))
    it = fastload.stream(path, block_size="64KiB", memory_limit="1MiB", concurrency=4)
    kept = collect(it)
    del it
    gc.collect()
    assert_same_tensors(kept, reference(path))


def test_interleaved_streams(dtypes_file, tiny_file):
    a, b = fastload.stream(dtypes_file), fastload.stream(tiny_file)
    got_a, got_b = {}, {}
    done_a = done_b = False
    while not (done_a and done_b):
        for it, got, flag in ((a, got_a, "a"), (b, got_b, "b")):
            if (flag == "a" and done_a) or (flag == "b" and done_b):
                continue
            try:
                name, t = next(it)
                got[name] = t
            except StopIteration:
                if flag == "a":
                    done_a = True
                else:
                    done_b = True
    assert_same_tensors(got_a, reference(dtypes_file))
    assert_same_tensors(got_b, reference(tiny_file))


def test_abandoned_streams_leave_the_loader_usable(big_file, dtypes_file):
    for _ in range(3):
        it = fastload.stream(big_file, memory_limit="16MiB")
        name, t = next(it)
        del it
    never_started = fastload.stream(big_file)
    del never_started
    gc.collect()
    assert_same_tensors(fastload.load(dtypes_file), reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# Memory and I/O, in fresh interpreters


def test_break_stops_reads_and_frees_buffers(big_file):
    size = big_file.stat().st_size
    r = big_probe(
        """
        path, limit = sys.argv[1], int(sys.argv[2])
        gc.collect(); base = rss(); r0 = rchar()
        it = fastload.stream(path, memory_limit=limit)
        ok = []
        for k, (name, t) in enumerate(it):
            ok.append(check(name, t))
            if k == 1:
                break
        del it, t
        time.sleep(1.0)  # a loader that keeps reading after the consumer left shows now
        after = settle(base + 2 * limit + 100 * MiB)
        read_after_break = rchar() - r0
        time.sleep(0.5)
        emit(ok=ok, base=base, after=after, read=read_after_break, read_later=rchar() - r0)
        """,
        big_file,
        LIMIT,
    )
    assert r["ok"] == [True, True]
    assert r["read"] < size // 2, f"read {r['read'] / MiB:.0f} MiB of {size / MiB:.0f} after a break"
    assert r["read_later"] - r["read"] <= LIMIT, "still reading after the iterator was dropped"
    grown = r["after"] - r["base"]
    assert grown < 2 * LIMIT + 100 * MiB, f"{grown / MiB:.0f} MiB still resident after break + del"


def test_first_tensor_arrives_before_the_file_is_read(big_file):
    size = big_file.stat().st_size
    r = big_probe(
        """
        path, limit = sys.argv[1], int(sys.argv[2])
        gc.collect(); base = rss(); r0 = rchar()
        it = fastload.stream(path, memory_limit=limit)
        name, t = next(it)
        read_at_first = rchar() - r0
        ok = check(name, t)
        time.sleep(1.0)  # room for a loader without back-pressure to run ahead
        read_idle, held_idle = rchar() - r0, rss() - base
        names = [name] + [n for n, _ in it]
        emit(ok=ok, read_at_first=read_at_first, read_idle=read_idle, held_idle=held_idle,
             names=names, read_total=rchar() - r0)
        """,
        big_file,
        LIMIT,
    )
    assert r["ok"]
    assert sorted(r["names"]) == [big_name(i) for i in range(BIG_TENSORS)]
    assert r["read_at_first"] < size // 2, r
    assert r["read_idle"] < size // 2, "read ahead of a consumer that stopped pulling"
    assert r["held_idle"] < size // 2, "buffered far past memory_limit while the consumer paused"
    if r["read_total"]:  # zero when reads bypass read()/pread() (mmap, io_uring): nothing to compare
        assert r["read_total"] >= size, "finished without reading the whole checkpoint?"


def test_dropping_consumer_keeps_memory_near_limit(big_file):
    size = big_file.stat().st_size
    r = big_probe(
        """
        path, limit = sys.argv[1], int(sys.argv[2])
        gc.collect(); base = rss(); max0 = maxrss(); bad = []; n = 0
        with PeakRss() as peak:
            for name, t in fastload.stream(path, memory_limit=limit):
                if not check(name, t):
                    bad.append(name)
                n += 1
                del t
        max1 = maxrss()
        # ru_maxrss is exact but covers the whole process: use it only if this loop raised it.
        top = max(peak.peak, max1 if max1 > max0 else 0)
        emit(n=n, bad=bad, grown=top - base)
        """,
        big_file,
        LIMIT,
    )
    assert r["n"] == BIG_TENSORS and r["bad"] == []
    assert r["grown"] < 4 * LIMIT + 150 * MiB, (
        f"peak RSS grew {r['grown'] / MiB:.0f} MiB streaming {size / MiB:.0f} MiB "
        f"with memory_limit {LIMIT / MiB:.0f} MiB"
    )


def test_load_holds_one_copy_and_frees_it(big_file):
    size = big_file.stat().st_size
    r = big_probe(
        """
        path, limit = sys.argv[1], int(sys.argv[2])
        gc.collect(); base = rss(); max0 = maxrss(); peaks = []; afters = []; ok = True
        for _ in range(2):
            with PeakRss() as peak:
                d = fastload.load(path, memory_limit=limit)
            ok = ok and len(d) == 64 and all(check(n, t) for n, t in d.items())
            peaks.append(peak.peak - base)
            del d
            afters.append(settle(base + 2 * limit + 100 * MiB) - base)
        emit(ok=ok, peaks=peaks, afters=afters)
        """,
        big_file,
        LIMIT,
    )
    assert r["ok"]
    for peak in r["peaks"]:
        assert peak < size + 4 * LIMIT + 150 * MiB, f"peak {peak / MiB:.0f} MiB: staged a second copy?"
    for after in r["afters"]:
        assert after < 2 * LIMIT + 100 * MiB, f"{after / MiB:.0f} MiB still resident after del"


# ---------------------------------------------------------------------------------------------
# The GIL


def _spin_share(work) -> tuple[float, float]:
    """Runs `work()` while another Python thread counts; returns (share, seconds).

    share = iterations counted during `work` / iterations the thread manages alone in the same
    time. With the GIL held across the native call the counter only moves during the short
    Python parts of `work` (a share of about 0.01 for a one-second load); with it released the
    counter shares the CPUs with the loader's threads.
    """
    state = {"n": 0, "stop": False}

    def spin():
        n = 0
        while not state["stop"]:
            n += 1
            state["n"] = n

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    try:
        time.sleep(0.05)
        n0, t0 = state["n"], time.perf_counter()
        time.sleep(0.3)  # this thread idles: the counter runs alone
        alone_rate = (state["n"] - n0) / (time.perf_counter() - t0)
        n0, t0 = state["n"], time.perf_counter()
        work()
        seconds = time.perf_counter() - t0
        counted = state["n"] - n0
    finally:
        state["stop"] = True
        th.join()
    return counted / (alone_rate * seconds), seconds


def _check_share(share, seconds):
    if seconds < 0.1:
        pytest.skip(f"the load took {seconds * 1000:.0f} ms: too short to observe the GIL")
    assert share > 0.1, f"another thread ran {share:.1%} of its solo rate during a {seconds:.2f} s load"


def test_load_releases_the_gil(big_file):
    out = {}
    share, seconds = _spin_share(lambda: out.update(fastload.load(big_file)))
    assert len(out) == BIG_TENSORS
    assert int(out[big_name(63)][-1]) == BIG_TENSORS * BIG_ELEMS - 1
    out.clear()
    _check_share(share, seconds)


def test_stream_releases_the_gil(big_file):
    seen = []

    def consume():
        for name, t in fastload.stream(big_file, memory_limit="64MiB"):
            seen.append((name, int(t[0])))

    share, seconds = _spin_share(consume)
    assert sorted(seen) == [(big_name(i), i * BIG_ELEMS) for i in range(BIG_TENSORS)]
    _check_share(share, seconds)
