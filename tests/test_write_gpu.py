"""fastload.save_file of GPU tensors on the simulated CUDA driver (tests/cuda_sim.py): each CUDA
tensor's bytes are copied out block by block with cuMemcpyDtoHAsync into page-locked buffers
(within memory_limit) while earlier blocks are written, after the work queued on torch's current
stream, with no per-tensor `.to("cpu")`; the file is the one safetensors writes for the CPU copies.

The simulator's device memory is host memory, so a "CUDA tensor" here is a torch tensor over
cuMemAlloc'd memory whose class says it is on cuda:N (and refuses `.to`/`.cpu`); torch's current
stream is a simulator stream whose queued, late copy produces the tensor's bytes. The real-GPU
check is test_write.py::test_gpu_tensors_produced_by_kernels_are_saved_bitwise."""

from __future__ import annotations

import cuda_sim
import pytest
from helpers import run_probe
from servers import s3 as s3_server
from servers.s3 import BUCKET

aws_env = s3_server.aws_env

# Late work: a producer copy of a few MiB lands well after save_file starts reading.
SLOW = {"FAKE_CUDA_LAG_US": "20000", "FAKE_CUDA_COPY_RATE": str(16 << 20)}

SAVE = """
import ctypes
sys.path.insert(0, os.path.dirname(os.path.abspath({helpers!r})))
from cuda_sim import Driver, calls
from fastload import _write
from safetensors.torch import save_file as reference_save

out, limit, devices, no_order = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
dest, part_size = sys.argv[5], int(sys.argv[6]) or None
cu = Driver()
cu.init()
contexts = [cu.context(k) for k in range(devices)]

# A CPU-only save touches nothing of the driver.
before = calls()
fastload.save_file({{"cpu": torch.arange(10)}}, out + "/cpu.safetensors")
cpu_only = {{k: v - before.get(k, 0) for k, v in calls().items() if v != before.get(k, 0)}}


class SimCuda(torch.Tensor):
    ordinal = 0

    @property
    def device(self):
        return torch.device("cuda", type(self).ordinal)

    @property
    def is_cuda(self):
        return True

    def to(self, *a, **k):
        raise AssertionError("a per-tensor .to() of a GPU tensor")

    def cpu(self, *a, **k):
        raise AssertionError("a per-tensor .cpu() of a GPU tensor")


classes = [type(f"SimCuda{{k}}", (SimCuda,), {{"ordinal": k}}) for k in range(devices)]
streams, pinned = [], 0
for k in range(devices):
    cu.bind(contexts[k])
    streams.append(cu.stream())  # torch's "current stream" on device k
    if no_order:  # the producer certainly late: its copy runs once save_file returned
        cu.hold(streams[k], 60_000)
cu.bind(None)


def on_device(cpu, k):
    # `cpu`'s bytes written into device k's memory by a late copy on its current stream.
    global pinned
    raw = cpu.reshape(-1).view(torch.uint8).numpy().tobytes()
    n = len(raw)
    cu.bind(contexts[k])
    addr = cu.alloc(max(n, 1))
    cu.write(addr, b"\\xee" * n)  # what a read before the producer finished would see
    if n:
        src = cu.pinned(n)
        pinned += (n + 4095) // 4096 * 4096
        cu.write(src, raw)
        cu.ok("cuMemcpyHtoDAsync_v2", addr, src, n, streams[k])
    cu.bind(None)
    memory = (ctypes.c_uint8 * max(n, 1)).from_address(addr)
    flat = torch.frombuffer(memory, dtype=torch.uint8)[:n]
    return flat.view(cpu.dtype).reshape(cpu.shape).as_subclass(classes[k])


g = torch.Generator().manual_seed(7)
cpu = {{
    "a.f32": torch.randn(300, 1000, generator=g),  # 1.2 MB: several blocks
    "b.bf16": torch.randn(513, 257, generator=g).to(torch.bfloat16),
    "c.cpu": torch.randn(1000, generator=g),  # stays on the CPU
    "d.i64": torch.randint(-5, 5, (7, 3), generator=g),
    "e.empty": torch.zeros(0, 4, dtype=torch.float16),
    "f.u8": torch.randint(0, 255, (600_001,), dtype=torch.uint8, generator=g),
}}
if part_size:  # a file of several upload parts
    cpu["g.big"] = torch.randn(3 * part_size // 2 // 4, generator=g)
last = devices - 1
where = {{"a.f32": 0, "b.bf16": last, "d.i64": 0, "e.empty": last, "f.u8": last, "g.big": 0}}
tensors = {{n: on_device(t, where[n]) if n in where else t for n, t in cpu.items()}}
assert tensors["a.f32"].device.type == "cuda" and type(tensors["c.cpu"]) is torch.Tensor

_write._cuda_stream = (lambda device: None) if no_order else (lambda device: streams[device.index])
before = calls()
fastload.save_file(tensors, dest, {{"k": "v"}}, memory_limit=limit, part_size=part_size)
after = calls()
for stream in streams if no_order else []:
    cu.hold(stream, 0)
reference_save(cpu, out + "/ref.safetensors", {{"k": "v"}})
dtoh = after.get("cuMemcpyDtoHAsync", 0) - before.get("cuMemcpyDtoHAsync", 0)
sync = after.get("cuMemcpyDtoH", 0) - before.get("cuMemcpyDtoH", 0)
block = fastload._fastload.FileWriter(out + "/probe.safetensors", [], memory_limit=limit)
emit(
    cpu_only=cpu_only,
    dtoh=dtoh,
    sync=sync,
    block=block.device_block_size,
    sizes={{n: t.nbytes for n, t in cpu.items() if n in where}},
    producer_pinned=pinned,
)
"""


def _save(fake_cuda, tmp_path, limit, devices=1, no_order=False, dest=None, part_size=0):
    log = tmp_path / "log"
    env = cuda_sim.env(fake_cuda, log, devices=devices, **SLOW)
    code = SAVE.format(helpers=cuda_sim.__file__)
    dest = dest or str(tmp_path / "ours.safetensors")
    args = (tmp_path, limit, devices, int(no_order), dest, part_size)
    out = run_probe(code, *args, env=env, timeout=120)
    return out, cuda_sim.log(log)


@pytest.mark.parametrize("devices", [1, 2])
def test_gpu_tensors_are_copied_out_in_page_locked_blocks(fake_cuda, tmp_path, devices):
    limit = 1 << 20
    out, counters = _save(fake_cuda, tmp_path, limit, devices)
    # The bytes safetensors writes for the CPU copies: the copies waited for the producer.
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()
    # Each GPU tensor in blocks of a quarter of memory_limit, asynchronously; never a
    # synchronous copy (torch's .to("cpu") on the simulator would be one, and the tensors refuse
    # .to/.cpu anyway).
    assert out["block"] == limit // 4
    want = sum(-(-n // out["block"]) for n in out["sizes"].values())
    assert out["dtoh"] == want, out
    assert out["sync"] == 0, out
    # Page-locked memory: the producer's buffers, plus at most memory_limit of fastload's.
    assert 0 < counters["pinned_peak"] - out["producer_pinned"] <= limit, (out, counters)
    assert counters["violations"] == 0, counters
    assert out["cpu_only"] == {}, out


def test_copies_wait_for_the_callers_stream(fake_cuda, tmp_path):
    # Without the wait on torch's current stream, the copies read the memory before the producer
    # wrote it: the check above would see the stale bytes. (Shown here with the wait taken out,
    # and the producer's stream held until save_file returned, so that no load of the machine
    # lets the producer finish first.)
    _, counters = _save(fake_cuda, tmp_path, 1 << 20, no_order=True)
    # A held stream's work runs at the hold's deadline only if something waited for it.
    assert counters["violations"] == 0, f"save_file waited for the held producer: {counters}"
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours != (tmp_path / "ref.safetensors").read_bytes()
    assert b"\xee" * 4096 in ours


def test_gpu_tensors_upload_to_s3_in_parts_within_the_limit(fake_cuda, tmp_path, seaweed, aws_env):
    # An object store holds each block until its part is uploaded, and a part being filled until
    # more blocks complete it: the page-locked budget is raised to one part and two blocks.
    aws_env(seaweed)
    client = seaweed.client()
    s3_server.ensure_bucket(client, BUCKET)
    part, limit = 5 << 20, 1 << 20
    key = "w/gpu/model.safetensors"
    out, counters = _save(fake_cuda, tmp_path, limit, dest=f"s3://{BUCKET}/{key}", part_size=part)
    body = client.get_object(Bucket=BUCKET, Key=key)["Body"].read()
    assert body == (tmp_path / "ref.safetensors").read_bytes()
    assert client.head_object(Bucket=BUCKET, Key=key, PartNumber=1)["ContentLength"] == part
    want = sum(-(-n // out["block"]) for n in out["sizes"].values())
    assert out["dtoh"] == want and out["sync"] == 0, out
    budget = max(limit, part + 2 * out["block"])
    assert 0 < counters["pinned_peak"] - out["producer_pinned"] <= budget, (out, counters)
    assert counters["violations"] == 0, counters
