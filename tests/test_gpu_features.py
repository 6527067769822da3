"""This stop's newer paths on a real GPU (`gpu`-marked: skipped without a CUDA device; the GPU kit
runs them): encrypted checkpoints loaded to a device, `parts=` to a device, and lazy tensors
(the vLLM/SGLang sliced reads) copied into device parameters. Each is compared bitwise with the
CPU result of the same file, which the rest of the suite checks against safetensors. Local files
only (the kit's machine has no test servers) and no `tink` (the keyset below was made by it)."""

from __future__ import annotations

import fastload
import pytest
import safetensors.torch
import torch
from fastload import _lazy

pytestmark = pytest.mark.gpu

# A Tink cleartext keyset (AES128_GCM_HKDF_4KB), made for this test with `tink` 1.16.1: test
# material only, used nowhere else. Small segments make many of them in a small file.
KEYSET = """{"primaryKeyId": 1919334501, "key": [{"keyData": {"typeUrl":
"type.googleapis.com/google.crypto.tink.AesGcmHkdfStreamingKey", "value":
"EgcIgCAQEBgDGhAwyDQpaduQ69iJdpLuw7eH", "keyMaterialType": "SYMMETRIC"}, "status": "ENABLED",
"keyId": 1919334501, "outputPrefixType": "RAW"}]}"""


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(30)
    return {
        "embed.weight": torch.randn(1000, 96, generator=g).to(torch.bfloat16),
        "q.weight": torch.randn(96, 96, generator=g),
        "down.weight": torch.randn(96, 384, generator=g).to(torch.float16),
        "norm.weight": torch.randn(96, generator=g),
        "ids": torch.arange(-7, 300, dtype=torch.int64),
    }


@pytest.fixture
def plain(tmp_path):
    path = tmp_path / "plain.safetensors"
    safetensors.torch.save_file(_tensors(), str(path))
    return path


def test_encrypted_file_loads_to_the_gpu_bitwise(plain, tmp_path):
    _cuda()
    enc = tmp_path / "enc.safetensors"
    fastload.save_file(_tensors(), str(enc), keyset=KEYSET)
    want = safetensors.torch.load_file(str(plain))
    got = fastload.load(str(enc), device="cuda", keyset=KEYSET, memory_limit="1MiB")
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].device.type == "cuda"
        assert torch.equal(got[name].cpu().view(torch.uint8), t.view(torch.uint8)), name
    with pytest.raises(fastload.FastloadError):
        fastload.load(str(enc), device="cuda")  # no keyset: never a tensor from ciphertext


def test_parts_to_the_gpu_equal_indexing_the_whole_tensor(plain):
    _cuda()
    want = safetensors.torch.load_file(str(plain))
    parts = {
        "embed.weight": (slice(250, 500),),
        "down.weight": (slice(None), slice(96, 192)),
        "q.weight": (3, slice(None, None, 2)),
        "ids": (slice(5, 40),),
    }
    got = fastload.load(str(plain), device="cuda", parts=parts)
    for name, index in parts.items():
        assert got[name].device.type == "cuda"
        assert torch.equal(got[name].cpu(), want[name][index]), name
    assert torch.equal(got["norm.weight"].cpu(), want["norm.weight"])


@pytest.mark.parametrize(
    "options",
    [{}, {"method": "read"}, {"method": "read", "read_ahead": True, "all_layers": True}],
    ids=["mapped", "read", "read-ahead"],
)
def test_lazy_tensors_narrowed_into_gpu_parameters(plain, options):
    # Mapped: each region a view of the file's pages, copied by the parameter's copy_; read: into
    # a buffer; read ahead: started on native threads before the consumer asks.
    _cuda()
    want = safetensors.torch.load_file(str(plain))
    stats = _lazy.Stats()
    loaded = {}
    for name, lazy in _lazy.Checkpoint(str(plain), stats, **options):
        if lazy.dim() == 2:
            # What a column- then a row-parallel weight_loader does at rank 1 of 2.
            rows = lazy.shape[0] // 2
            part = lazy.narrow(0, rows, rows)
            if name == "down.weight":
                cols = lazy.shape[1] // 2
                part = lazy.narrow(1, cols, cols)
        else:
            part = lazy
        param = torch.empty(part.shape, dtype=part.dtype, device="cuda")
        param.copy_(part)
        loaded[name] = param
    torch.cuda.synchronize()
    rows = 1000 // 2
    assert torch.equal(loaded["embed.weight"].cpu(), want["embed.weight"][rows:])
    assert torch.equal(loaded["q.weight"].cpu(), want["q.weight"][48:])
    assert torch.equal(loaded["down.weight"].cpu(), want["down.weight"][:, 192:])
    assert torch.equal(loaded["norm.weight"].cpu(), want["norm.weight"])
    assert torch.equal(loaded["ids"].cpu(), want["ids"])
