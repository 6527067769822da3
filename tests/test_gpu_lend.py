"""GPU loads with ``method="mmap"``: the files' mapped pages lent to the device (page-locked in
place, read-only: ``cuMemHostRegister`` with ``CU_MEMHOSTREGISTER_READ_ONLY``) and copied from
there, with no CPU copy into staging buffers; where they cannot be, the rest of the load reads
into staging buffers as ``method="read"`` does, and ``stats()["lend_refused"]`` says why.

On the simulated driver (tests/fake_cuda/fake_cuda.c), which checks what the real one would
punish: memory that is not whole pages, read-only memory registered without the read-only flag,
overlapping registrations, and memory unregistered while queued copies still read it; and
``gpu``-marked tests on a real device (the GPU kit runs them).
"""

from __future__ import annotations

import json

import cuda_sim
import fastload
import pytest
import torch
from helpers import cuda_stream_bitwise, reference, run_probe

LOAD = """
import fastload, torch
from fastload import _fastload, _torch
from safetensors.torch import load_file
uri, ref, block, limit, loads = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])

def allocate(sizes):  # host tensors stand in for device memory
    ts = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    return None, [(t, t.data_ptr()) for t in ts]

import cuda_sim  # beside helpers: the simulator's calls so far, in this process

runs, bad, held = [], [], []
want = load_file(ref)
def same(a, b):
    flat = lambda t: t.reshape(-1).view(torch.uint8)
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(flat(a), flat(b))
for _ in range(loads):
    got = {}
    s = _fastload.Stream([uri], target="cuda:0", allocate=allocate, block_size=block,
                         memory_limit=limit, method="mmap", concurrency=4)
    for batch in s:
        for item in batch:
            got[item.name] = _torch.from_bytes(item.dtype, item.shape, item.data, uri)
        if len(got) == len(want):  # the last tensor is out: no lent page is still registered
            c = cuda_sim.calls()
            held.append(c.get("cuMemHostRegister", 0) - c.get("cuMemHostUnregister", 0))
    runs.append(s.stats().as_dict())
    bad += [n for n in want if n not in got or not same(want[n], got[n])]
emit(bad=bad, runs=runs, held=held)
"""


def _load(fake_cuda, tmp_path, uri, ref, block="64KiB", limit="1MiB", loads=1, **env):
    log = tmp_path / "log"
    out = run_probe(LOAD, uri, ref, block, limit, loads, env=cuda_sim.env(fake_cuda, log, **env))
    return out, cuda_sim.log(log)


def test_mmap_lends_every_block_and_pins_nothing_of_its_own(fake_cuda, multi_block_file, tmp_path):
    out, counters = _load(
        fake_cuda,
        tmp_path,
        str(multi_block_file),
        str(multi_block_file),
        loads=2,
        FAKE_CUDA_UNREGISTER_US="3000",  # releases that take time: still none held at the end
    )
    assert out["bad"] == [] and out["held"] == [0, 0]
    for stats in out["runs"]:
        assert stats["method"] == "mmap" and "mapped pages" in stats["method_reason"]
        assert stats["lend_refused"] is None
        assert stats["lent_bytes"] == stats["total_bytes"] == stats["bytes_copied"]
        assert stats["pinned_bytes"] == 0
        assert stats["phases_ms"]["lend"] > 0 and stats["phases_ms"]["unlend"] > 0
    assert counters["violations"] == 0, counters
    # No staging buffer was pinned: every copy came from the file's pages, each registration
    # undone once its copies were through, and never more at once than the memory limit.
    assert counters["host_allocs"] == 0, counters
    registered = counters["calls.cuMemHostRegister"]
    assert registered >= 2 * (3 << 20) // (64 << 10), counters
    assert counters["calls.cuMemHostUnregister"] == registered, counters
    assert counters["pinned_now"] == 0, counters
    assert 0 < counters["pinned_peak"] <= 1 << 20, counters
    assert counters["bytes"] == 2 * out["runs"][0]["total_bytes"]


def test_mmap_unregisters_only_after_slow_copies(fake_cuda, multi_block_file, tmp_path):
    # Copies that run late: a registration undone before its copies ran is a violation (and on
    # a GPU, a copy from pages no longer pinned).
    out, counters = _load(
        fake_cuda,
        tmp_path,
        str(multi_block_file),
        str(multi_block_file),
        FAKE_CUDA_LAG_US="20000",
        FAKE_CUDA_COPY_RATE=str(50 << 20),
    )
    assert out["bad"] == []
    assert out["runs"][0]["lent_bytes"] == out["runs"][0]["total_bytes"]
    assert counters["violations"] == 0, counters
    assert counters["pinned_now"] == 0, counters


def test_a_device_without_read_only_registration_reads_into_staging(
    fake_cuda, dtypes_file, tmp_path
):
    out, counters = _load(
        fake_cuda,
        tmp_path,
        str(dtypes_file),
        str(dtypes_file),
        block="4KiB",
        FAKE_CUDA_READ_ONLY_REGISTER="0",
    )
    assert out["bad"] == []
    stats = out["runs"][0]
    assert stats["lent_bytes"] == 0
    assert "CUDA_ERROR_NOT_SUPPORTED" in stats["lend_refused"], stats
    assert str(dtypes_file) in stats["lend_refused"]
    assert stats["bytes_copied"] == stats["total_bytes"]
    # Lending stopped at the first refusal: at most the reads then in flight asked.
    assert counters["calls.cuMemHostRegister"] <= 4, counters
    assert counters["host_allocs"] > 0 and counters["violations"] == 0, counters


def test_a_registration_that_fails_midway_reads_the_rest(fake_cuda, multi_block_file, tmp_path):
    out, counters = _load(
        fake_cuda,
        tmp_path,
        str(multi_block_file),
        str(multi_block_file),
        fail="cuMemHostRegister:5",
    )
    assert out["bad"] == []
    stats = out["runs"][0]
    assert 0 < stats["lent_bytes"] < stats["total_bytes"], stats
    assert "CUDA_ERROR_UNKNOWN" in stats["lend_refused"], stats
    assert stats["bytes_copied"] == stats["total_bytes"]
    assert counters["violations"] == 0, counters
    assert counters["calls.cuMemHostRegister"] == counters["calls.cuMemHostUnregister"], counters


def test_objects_are_not_lent(fake_cuda, http_store, dtypes_file, tmp_path):
    out, counters = _load(
        fake_cuda, tmp_path, http_store.uri("all.safetensors"), str(dtypes_file), block="4KiB"
    )
    assert out["bad"] == []
    stats = out["runs"][0]
    assert stats["lent_bytes"] == 0
    assert "cannot be mapped" in stats["lend_refused"], stats
    assert counters.get("calls.cuMemHostRegister", 0) == 0, counters


def test_cli_bench_lends_with_method_mmap(fake_cuda, gil_file, tmp_path):
    log = tmp_path / "log"
    argv = ["bench", str(gil_file), "--device", "cuda", "--method", "mmap", "--repeat", "1",
            "--block-size", "1MiB", "--memory-limit", "8MiB", "--json"]  # fmt: skip
    proc = cuda_sim.run_cli(fake_cuda, log, *argv)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert [(r["method"], r.get("lend_refused")) for r in report["runs"]] == [("mmap", None)]
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    assert counters["calls.cuMemHostRegister"] >= 512, counters
    assert counters["calls.cuMemHostRegister"] == counters["calls.cuMemHostUnregister"]
    assert counters["pinned_peak"] <= 8 << 20, counters


def test_mmap_is_taken_for_gpu_loads(dtypes_file):
    # Accepted with a device (no ConfigError before the driver); what it does there is above.
    try:
        got = fastload.load(dtypes_file, device="cuda", method="mmap")
    except fastload.ConfigError as e:
        raise AssertionError(f"method='mmap' refused for a GPU load: {e}") from e
    except fastload.FastloadError:
        return  # no driver here
    assert sorted(got) == sorted(reference(dtypes_file))


# ---------------------------------------------------------------------------------------------
# A real GPU

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.gpu
@gpu
def test_cuda_mmap_loads_bitwise_from_the_lent_pages(dtypes_file, gil_file):
    # Whether this driver lends read-only pages or not, the tensors are the file's; where it
    # does, every byte came from the file's own pages and nothing was pinned for staging.
    for path, block, limit in [(dtypes_file, "4KiB", "1MiB"), (gil_file, "8MiB", "64MiB")]:
        stats = cuda_stream_bitwise(path, method="mmap", block_size=block, memory_limit=limit)
        if stats["lend_refused"] is None:
            assert stats["lent_bytes"] == stats["total_bytes"], stats
            assert stats["pinned_bytes"] == 0, stats
        else:
            print(f"lending refused by this driver: {stats['lend_refused']}")
