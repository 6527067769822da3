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

import fastload
import pytest
import torch
from helpers import (
    BIG_ELEMS,
    BIG_TENSORS,
    GIL_ELEMS,
    MiB,
    assert_same_tensor,
    assert_same_tensors,
    big_name,
    cached_bytes,
    data_offset,
    evict,
    indexed_files,
    pattern,
    reference,
    run_probe,
)
from safetensors.torch import save_file

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


# The start of a probe of one stream of the big file (argv: path, memory_limit) from storage: the
# file out of the page cache, `read()` counting what the stream fetched since, `base` the RSS
# before, `it` the stream.
COLD_STREAM = """
path, limit = sys.argv[1], int(sys.argv[2])
evict(path)
def read():  # bytes fetched from storage so far, by pread or by mapping
    return max(rchar() - r0, cached_bytes(path))
gc.collect(); base = rss(); r0 = rchar()
it = fastload.stream(path, memory_limit=limit)
"""


def cold_stream_probe(code: str, path) -> dict:
    """``code`` after COLD_STREAM, in a fresh interpreter: the big file at ``path``, LIMIT."""
    return big_probe(COLD_STREAM + textwrap.dedent(code), path, LIMIT)


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
    assert_same_tensors(
        collect(fastload.stream(dtypes_file, names=chosen)), {n: want[n] for n in chosen}
    )


def test_stream_missing_name_raises_key_error(dtypes_file):
    with pytest.raises(KeyError) as info:
        collect(fastload.stream(dtypes_file, names=["F32.7", "no_such_tensor"]))
    assert isinstance(info.value, fastload.TensorNotFoundError)
    assert info.value.names == ["no_such_tensor"]


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
    save_file(
        {f"t{i:02d}": pattern((64 * 1024,), torch.float32, seed=i) for i in range(48)}, str(path)
    )
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
        _name, _t = next(it)
        del it, _t
    never_started = fastload.stream(big_file)
    del never_started
    gc.collect()
    assert_same_tensors(fastload.load(dtypes_file), reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# Memory and I/O, in fresh interpreters


def test_break_stops_reads_and_frees_buffers(big_file):
    size = big_file.stat().st_size
    r = cold_stream_probe(
        """
        ok = []
        for k, (name, t) in enumerate(it):
            ok.append(check(name, t))
            if k == 1:
                break
        del it, t
        time.sleep(1.0)  # a loader that keeps reading after the consumer left shows now
        after = settle(base + 2 * limit + 100 * MiB)
        read_after_break = read()
        time.sleep(0.5)
        emit(ok=ok, base=base, after=after, read=read_after_break, read_later=read())
        """,
        big_file,
    )
    assert r["ok"] == [True, True]
    assert r["read"] < size // 2, f"read {r['read'] / MiB:.0f} of {size / MiB:.0f} MiB, then broke"
    assert r["read_later"] - r["read"] <= LIMIT, "still reading after the iterator was dropped"
    grown = r["after"] - r["base"]
    assert grown < 2 * LIMIT + 100 * MiB, f"{grown / MiB:.0f} MiB still resident after break + del"


def test_first_tensor_arrives_before_the_file_is_read(big_file):
    size = big_file.stat().st_size
    r = cold_stream_probe(
        """
        def stats():  # the loader's own account, where it offers one
            return dict(it.stats()) if hasattr(it, "stats") else {}
        name, t = next(it)
        read_first, stats_first = read(), stats()
        ok = check(name, t)
        time.sleep(1.0)  # room for a loader without back-pressure to run ahead
        read_idle, held_idle, stats_idle = read(), rss() - base, stats()
        names = [name] + [n for n, _ in it]
        emit(ok=ok, read_first=read_first, read_idle=read_idle, held_idle=held_idle,
             stats_first=stats_first, stats_idle=stats_idle, names=names, read_total=read())
        """,
        big_file,
    )
    assert r["ok"]
    assert sorted(r["names"]) == [big_name(i) for i in range(BIG_TENSORS)]
    # The instrument sees this loader's reads at all (else the bounds below would be empty).
    assert r["read_total"] >= size * 0.9, r["read_total"]
    assert r["read_first"] < size // 2, f"{r['read_first'] / MiB:.0f} MiB read before the first"
    assert r["read_idle"] < size // 2, "read ahead of a consumer that stopped pulling"
    assert r["held_idle"] < size // 2, "buffered far past memory_limit while the consumer paused"
    for stats in (r["stats_first"], r["stats_idle"]):
        if "bytes_read" in stats:
            assert stats["bytes_read"] < size // 2, stats


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
        assert peak < size + 4 * LIMIT + 150 * MiB, (
            f"peak {peak / MiB:.0f} MiB: staged a second copy?"
        )
    for after in r["afters"]:
        assert after < 2 * LIMIT + 100 * MiB, f"{after / MiB:.0f} MiB still resident after del"


def test_release_memory_gives_cached_buffers_back(big_file):
    # Freed buffers stay with the process for the next load (up to memory_limit) until
    # release_memory() gives them to the OS; RSS shows it, and the next load caches again.
    limit = 4 * LIMIT
    r = big_probe(
        """
        path, limit = sys.argv[1], int(sys.argv[2])
        def drain():
            ok = True
            for name, t in fastload.stream(path, memory_limit=limit, method="read"):
                ok = ok and check(name, t)
                del t
            gc.collect()
            return ok
        ok = drain()
        cached = fastload.cached_memory()
        before = rss()
        freed = fastload.release_memory()
        after = rss()
        emptied = fastload.cached_memory()
        ok = drain() and ok
        emit(ok=ok, cached=cached, freed=freed, dropped=before - after, emptied=emptied,
             again=fastload.cached_memory())
        """,
        big_file,
        limit,
    )
    assert r["ok"]
    assert 16 * MiB <= r["cached"]["host"] <= limit and r["cached"]["pinned"] == 0, r
    assert r["freed"] == r["cached"], r
    assert r["emptied"] == {"host": 0, "pinned": 0}
    assert r["dropped"] >= r["freed"]["host"] - 16 * MiB, (
        f"RSS fell {r['dropped'] / MiB:.0f} MiB, {r['freed']['host'] / MiB:.0f} MiB released"
    )
    assert 16 * MiB <= r["again"]["host"] <= limit


def test_names_reads_only_those_tensors(big_file):
    evict(big_file)
    chosen = [7, 40]
    got = fastload.load(big_file, names=[big_name(i) for i in chosen])
    assert sorted(got) == [big_name(i) for i in chosen]
    assert int(got[big_name(40)][0]) == 40 * BIG_ELEMS
    # The kernel reads ahead of what is asked (8 MiB windows on these disks), so look only at
    # tensors at least two away from a chosen one (and from the header, which is read too):
    # none of their pages may have been fetched.
    base, size = data_offset(big_file), BIG_ELEMS * 4
    far = [i for i in range(1, BIG_TENSORS) if all(abs(i - c) > 2 for c in chosen)]
    fetched = {i: cached_bytes(big_file, base + i * size, base + (i + 1) * size) for i in far}
    assert not any(fetched.values()), {big_name(i): n for i, n in fetched.items() if n}


def test_fork_after_load(dtypes_file):
    r = run_probe(
        """
        path = sys.argv[1]
        before = fastload.load(path)
        pid = os.fork()
        if pid == 0:  # the child: a fresh runtime must serve it, not the parent's dead threads
            try:
                again = fastload.load(path)
                same = all(torch.equal(again[k].reshape(-1).view(torch.uint8),
                                       before[k].reshape(-1).view(torch.uint8)) for k in before)
                os._exit(0 if same and len(again) == len(before) else 1)
            except BaseException:
                os._exit(2)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not done:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        after = fastload.load(path)  # and the parent still works
        emit(child=os.waitstatus_to_exitcode(status) if done else "hung", parent=len(after))
        """,
        dtypes_file,
    )
    assert r["child"] == 0, f"load in a forked child: {r['child']} (1 wrong data, 2 raised)"
    assert r["parent"] == len(reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# The GIL


def _longest_stall(work, path, runs: int = 2) -> tuple[float, float]:
    """Runs `work()` on a cold page cache while another Python thread spins.

    Returns (longest time the spinner went without running, seconds `work` took), over `runs`
    runs. The checkpoint is one 512 MiB tensor, so a loader that holds the GIL while it waits
    for that tensor stalls the spinner for about the whole load; one that releases it stalls
    it only for scheduler noise. Robust to other processes loading the CPUs, unlike rates.
    """
    stalls: list[tuple[float, float]] = []
    state = {"stop": False}

    def spin():
        last = time.perf_counter()
        while not state["stop"]:
            now = time.perf_counter()
            if now - last > 0.01:
                stalls.append((last, now))
            last = now

    th = threading.Thread(target=spin, daemon=True)
    th.start()
    longest = seconds = 0.0
    try:
        for _ in range(runs):
            evict(path)
            time.sleep(0.02)
            t0 = time.perf_counter()
            work()
            t1 = time.perf_counter()
            seconds = max(seconds, t1 - t0)
            time.sleep(0.02)  # lets the spinner record a stall that ends after work() returns
            inside = [min(b, t1) - max(a, t0) for a, b in list(stalls) if b > t0 and a < t1]
            longest = max([longest, *inside])
    finally:
        state["stop"] = True
        th.join()
    return longest, seconds


def _check_stall(longest, seconds):
    if seconds < 0.2:
        pytest.skip(f"the load took {seconds * 1000:.0f} ms: too short to observe the GIL")
    assert longest < seconds / 2, (
        f"another Python thread stood still for {longest:.2f} s of a {seconds:.2f} s load"
    )


def test_load_releases_the_gil(gil_file):
    results = []
    longest, seconds = _longest_stall(lambda: results.append(fastload.load(gil_file)), gil_file)
    for out in results:
        assert list(out) == ["w"]
        assert int(out["w"][-1]) == GIL_ELEMS - 1
    results.clear()
    _check_stall(longest, seconds)


def test_stream_releases_the_gil(gil_file):
    runs = []

    def consume():
        runs.append([(n, int(t[-1])) for n, t in fastload.stream(gil_file, memory_limit="64MiB")])

    longest, seconds = _longest_stall(consume, gil_file)
    for seen in runs:
        assert seen == [("w", GIL_ELEMS - 1)]
    _check_stall(longest, seconds)
