"""Driver-allocated destinations (issue 13): `_fastload.Stream(uris, target=...)` without
`allocate` copies into memory fastload allocates itself, one allocation per tensor (the CUDA
driver's `cuMemAlloc`, or host buffers for "host"), and each item's `data` is a `dltensor` capsule
that owns it. On the simulated driver device memory is host memory, so the bytes are read back
through the capsule and compared bitwise with the reference writer's."""

from __future__ import annotations

import cuda_sim
import fastload
import pytest
import torch
from fastload import _fastload
from helpers import raw_bytes, reference, run_probe
from test_runahead import DLPACK

PARITY = (
    DLPACK
    + """
from fastload import _fastload
from safetensors.torch import load_file
path, target = sys.argv[1], sys.argv[2]
want = load_file(path)
got, devices = {}, set()
for batch in _fastload.Stream([path], target=target, block_size="4KiB", memory_limit="1MiB"):
    for item in batch:
        device, data = dl(item.data)
        devices.add(device)
        got[item.name] = data
bad = [n for n, t in want.items()
       if got.get(n) != t.reshape(-1).view(torch.uint8).numpy().tobytes()]
del batch, item
gc.collect()
emit(bad=bad, n=len(got), devices=sorted(devices))
"""
)


@pytest.mark.parametrize("devices, target, device_id", [(1, "cuda:0", 0), (2, "cuda:1", 1)])
def test_driver_allocated_parity(fake_cuda, dtypes_file, tmp_path, devices, target, device_id):
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, devices=devices)
    out = run_probe(PARITY, dtypes_file, target, env=env)
    assert out["bad"] == [] and out["n"] == len(reference(dtypes_file)), out
    assert out["devices"] == [[2, device_id]], out  # kDLCUDA on that device
    counters = cuda_sim.log(log)
    # Every tensor's memory was freed when its capsule died, in its own context.
    assert counters["device_peak"] > 0 and counters["device_now"] == 0, counters
    assert counters["violations"] == 0, counters


def test_host_target_without_allocate_is_a_cpu_capsule(dtypes_file):
    want = reference(dtypes_file)
    got = {}
    for batch in _fastload.Stream([str(dtypes_file)], target="host", block_size="4KiB"):
        for item in batch:
            got[item.name] = torch.from_dlpack(item.data)
    assert sorted(got) == sorted(want)
    for name, ref in want.items():
        assert torch.equal(raw_bytes(got[name]), raw_bytes(ref)), name


def test_allocate_without_a_target_is_a_config_error(dtypes_file):
    with pytest.raises(fastload.ConfigError) as info:
        _fastload.Stream([str(dtypes_file)], allocate=lambda sizes: (None, []))
    assert info.value.option == "allocate"
