"""``copy_streams``: a staged load copies its blocks to the device on several copy queues in turn
(CUDA streams; into host memory, worker threads), each ordered after the consumer's stream, each
block's buffer reused only after its own queue's fence. The CUDA engine's ordering and failures on
several streams are in test_cuda_driver.py (the engine's home); here the option's surfaces: the
staged pipeline into host memory, loads that copy nothing, the CLI (into host memory and on the
simulated driver), and ``safe_open``.
"""

from __future__ import annotations

import json
import subprocess
import sys

import cuda_sim
import fastload
import pytest
import torch
from helpers import assert_same_tensor, reference, staged_stream_bitwise
from safetensors.torch import save_file


@pytest.fixture(scope="module")
def blocks_file(tmp_path_factory):
    """About 3 MiB over many 64 KiB blocks, tensors starting and ending inside them."""
    g = torch.Generator().manual_seed(11)
    tensors = {
        "a": torch.randn(300_001, generator=g),
        "b": torch.randint(0, 255, (7,), dtype=torch.uint8, generator=g),
        "empty": torch.empty(0, 3),
        "c": torch.randn(333, 1001, generator=g).to(torch.bfloat16),
        "d": torch.randint(-(2**31), 2**31 - 1, (100_003,), dtype=torch.int32, generator=g),
    }
    path = tmp_path_factory.mktemp("streams") / "blocks.safetensors"
    save_file(tensors, str(path))
    return path


@pytest.mark.parametrize("copy_streams", [1, 2, 5, 16])
def test_a_staged_load_copies_bitwise_on_every_number_of_streams(blocks_file, copy_streams):
    kw = dict(block_size="64KiB", memory_limit="1MiB", copy_streams=copy_streams)
    stats = staged_stream_bitwise(blocks_file, _target="host", **kw)
    assert stats["target"] == "host" and stats["copy_streams"] == copy_streams, stats


def test_the_variable_sets_the_streams_and_the_argument_wins(blocks_file, monkeypatch):
    monkeypatch.setenv("FASTLOAD_COPY_STREAMS", "3")
    with fastload.Stream(blocks_file, _target="host", block_size="64KiB") as s:
        dict(s)
        assert s.stats()["copy_streams"] == 3
    with fastload.Stream(blocks_file, _target="host", block_size="64KiB", copy_streams=2) as s:
        dict(s)
        assert s.stats()["copy_streams"] == 2
    monkeypatch.setenv("FASTLOAD_COPY_STREAMS", "0")
    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(blocks_file)
    assert info.value.option == "FASTLOAD_COPY_STREAMS", info.value
    assert "0 is not in 1..=16" in str(info.value), info.value


def test_loads_that_copy_nothing_take_the_option_and_say_none(blocks_file):
    # A CPU load hands out the bytes it read (or mapped): no copy queue is involved.
    with fastload.stream(blocks_file, copy_streams=4) as s:
        got = dict(s)
        stats = s.stats()
    assert stats["copy_streams"] is None and stats["target"] is None, stats
    want = reference(blocks_file)
    for name, ref in want.items():
        assert_same_tensor(got[name], ref, name)


def test_safe_open_takes_the_option(blocks_file):
    with fastload.safe_open(blocks_file, framework="pt", copy_streams=2) as f:
        got = {k: f.get_tensor(k) for k in f.keys()}
    for name, ref in reference(blocks_file).items():
        assert_same_tensor(got[name], ref, name)
    # Checked when the file is opened, as the options the reads take are (not at the first
    # load, which a GPU get_tensor or get_tensors starts).
    for option, bad in [("copy_streams", 99), ("memory_limit", 0), ("method", "fast")]:
        with pytest.raises(fastload.ConfigError) as info:
            fastload.safe_open(blocks_file, framework="pt", **{option: bad})
        assert info.value.option == option, info.value


def _bench(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastload._cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_cli_bench_copies_on_the_streams_asked_for(blocks_file):
    base = [str(blocks_file), "--device", "host", "--block-size", "64KiB", "--repeat", "1"]
    one = _bench(*base, "--json")
    three = _bench(*base, "--copy-streams", "3", "--json")
    assert one.returncode == 0 and three.returncode == 0, (one.stderr, three.stderr)
    a, b = json.loads(one.stdout), json.loads(three.stdout)
    assert (a["copy_streams"], b["copy_streams"]) == (1, 3), (a, b)
    assert a["checksum"] == b["checksum"] and a["bytes"] == b["bytes"], (a, b)
    # On the CPU nothing is copied: no copy streams to report (as stats() says).
    cpu = _bench(str(blocks_file), "--repeat", "1", "--copy-streams", "3", "--json")
    assert cpu.returncode == 0 and json.loads(cpu.stdout)["copy_streams"] is None, cpu.stderr
    table = _bench(*base, "--copy-streams", "3")
    assert table.returncode == 0, table.stderr
    assert "device host (3 copy streams)" in table.stdout, table.stdout


@pytest.mark.parametrize(
    ("args", "env", "named"),
    [
        (["--copy-streams", "0"], {}, "--copy-streams"),
        (["--copy-streams", "17"], {}, "--copy-streams"),
        ([], {"FASTLOAD_COPY_STREAMS": "many"}, "FASTLOAD_COPY_STREAMS"),
    ],
)
def test_cli_bench_names_a_bad_number_of_streams(blocks_file, args, env, named):
    import os

    proc = _bench(str(blocks_file), "--device", "host", *args, env={**os.environ, **env})
    assert proc.returncode != 0, proc.stdout
    assert named in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "panicked" not in proc.stderr, proc.stderr


def test_cli_bench_on_the_simulated_driver_copies_on_every_stream(fake_cuda, blocks_file, tmp_path):
    # The Rust-only path (driver-allocated destinations): the three lanes of the load carry
    # copies.
    log = tmp_path / "log"
    argv = [str(blocks_file), "--device", "cuda", "--block-size", "64KiB", "--repeat", "1"]
    proc = cuda_sim.run_cli(fake_cuda, log, "bench", *argv, "--copy-streams", "3", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["copy_streams"] == 3 and report["device"] == "cuda", report
    counters = cuda_sim.log(log)
    assert counters["violations"] == 0, counters
    # The load's three streams, and the one that measured the host-to-device limit.
    assert counters["copy_streams"] == 4, counters
    assert counters["calls.cuStreamCreate"] == counters["calls.cuStreamDestroy"], counters
