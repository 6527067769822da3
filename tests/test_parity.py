"""fastload.load returns exactly what safetensors.torch.load_file returns, bit for bit."""

from __future__ import annotations

import gc
import json
import shutil
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import fastload
import pytest
import torch
from helpers import (
    DTYPES,
    UNICODE_NAMES,
    MiB,
    assert_same_tensor,
    assert_same_tensors,
    indexed_files,
    pattern,
    raw_bytes,
    reference,
)
from safetensors.torch import save_file

# ---------------------------------------------------------------------------------------------
# Formats and layouts


def test_fixture_covers_every_dtype(dtypes_file):
    # Guards the fixture itself: the parity test below is only as good as what it covers.
    assert {t.dtype for t in reference(dtypes_file).values()} == set(DTYPES.values())
    assert len(DTYPES) == 20


def test_all_dtypes_shapes_and_unicode_names(dtypes_file):
    want = reference(dtypes_file)
    got = fastload.load(dtypes_file)
    assert_same_tensors(got, want)
    for name in UNICODE_NAMES:
        assert name in got
    assert got["F32.scalar"].shape == ()
    assert got["F64.3x0x2"].shape == (3, 0, 2)


def test_all_dtypes_with_small_blocks_and_one_reader(dtypes_file):
    got = fastload.load(dtypes_file, concurrency=1, block_size="64KiB", memory_limit="1MiB")
    assert_same_tensors(got, reference(dtypes_file))


def test_many_tiny_tensors(tiny_file):
    want = reference(tiny_file)
    assert len(want) > 20_000
    assert_same_tensors(fastload.load(tiny_file), want)


def test_sharded_directory_follows_index(sharded_dir):
    want = reference(*indexed_files(sharded_dir))
    got = fastload.load(sharded_dir)
    assert "stray.only" not in got, "read a .safetensors file the index does not name"
    # layers.0.weight also exists (with other bytes) in the stray file.
    assert_same_tensors(got, want)


def test_directory_without_index_loads_every_safetensors_file(sharded_dir, tmp_path):
    for f in indexed_files(sharded_dir):
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "README.md").write_text("not a checkpoint")
    (tmp_path / "notes.safetensors.bak").write_bytes(b"garbage")
    want = reference(*indexed_files(sharded_dir))
    assert_same_tensors(fastload.load(tmp_path), want)
    assert_same_tensors(fastload.load(str(tmp_path)), want)


def test_list_of_files_str_and_path(sharded_dir):
    files = indexed_files(sharded_dir)
    got = fastload.load([str(files[0]), files[1], files[2]])
    assert_same_tensors(got, reference(*files))


def test_custom_pathlike(dtypes_file):
    class P:
        def __fspath__(self):
            return str(dtypes_file)

    assert_same_tensors(fastload.load(P()), reference(dtypes_file))


def test_file_urls(dtypes_file, sharded_dir):
    assert dtypes_file.as_uri().startswith("file:///")
    assert_same_tensors(fastload.load(dtypes_file.as_uri()), reference(dtypes_file))
    assert_same_tensors(fastload.load(sharded_dir.as_uri()), reference(*indexed_files(sharded_dir)))


def test_file_url_is_percent_decoded(dtypes_file, tmp_path):
    target = tmp_path / "a dir ü" / "my model.safetensors"
    target.parent.mkdir()
    shutil.copy(dtypes_file, target)
    uri = target.as_uri()
    assert "%20" in uri
    assert_same_tensors(fastload.load(uri), reference(dtypes_file))


def test_path_with_spaces_and_unicode(dtypes_file, tmp_path):
    target = tmp_path / "a dir ü" / "my model ✓.safetensors"
    target.parent.mkdir()
    shutil.copy(dtypes_file, target)
    assert_same_tensors(fastload.load(target), reference(dtypes_file))
    assert_same_tensors(fastload.load(target.parent), reference(dtypes_file))


def test_symlinked_shards_like_the_hub_cache(sharded_dir, tmp_path):
    # huggingface_hub snapshots are directories of symlinks into a blobs/ folder.
    blobs, snapshot = tmp_path / "blobs", tmp_path / "snapshots" / "abc123"
    blobs.mkdir()
    snapshot.mkdir(parents=True)
    for k, f in enumerate(
        [*indexed_files(sharded_dir), sharded_dir / "model.safetensors.index.json"]
    ):
        shutil.copy(f, blobs / f"blob{k}")
        (snapshot / f.name).symlink_to(blobs / f"blob{k}")
    want = reference(*indexed_files(sharded_dir))
    assert_same_tensors(fastload.load(snapshot), want)
    linked_dir = tmp_path / "linked"
    linked_dir.symlink_to(snapshot)
    assert_same_tensors(fastload.load(linked_dir), want)


def test_many_files(tmp_path):
    for k in range(300):
        save_file(
            {f"t{k}": pattern((k % 7 + 1, 3), torch.float16, seed=k)},
            str(tmp_path / f"{k}.safetensors"),
        )
    want = reference(*sorted(tmp_path.glob("*.safetensors")))
    assert len(want) == 300
    assert_same_tensors(fastload.load(tmp_path, concurrency=4), want)


def test_tensors_larger_than_block_size_and_memory_limit(tmp_path):
    path = tmp_path / "large.safetensors"
    tensors = {
        "odd": pattern((4 * MiB + 13,), torch.uint8, seed=1),
        "f32": pattern((1024, 1024), torch.float32, seed=2),  # 4 MiB
        "small": pattern((5,), torch.float16, seed=3),
    }
    save_file(tensors, str(path))
    got = fastload.load(path, block_size="64KiB", memory_limit="1MiB")
    assert_same_tensors(got, reference(path))


def test_unaligned_offsets_and_unsorted_layout(tmp_path):
    """A valid file the reference writer never produces: tensors start at odd offsets."""
    parts = [
        ("a_u8", "U8", (3,), pattern((3,), torch.uint8, seed=1)),
        ("b_f32", "F32", (5, 3), pattern((5, 3), torch.float32, seed=2)),
        ("c_bool", "BOOL", (1,), pattern((1,), torch.bool, seed=3)),
        ("d_f64", "F64", (7,), pattern((7,), torch.float64, seed=4)),
        ("e_bf16", "BF16", (9,), pattern((9,), torch.bfloat16, seed=5)),
    ]
    header, data, offset = {}, b"", 0
    for name, dname, shape, t in reversed(parts):  # data order differs from name order
        blob = bytes(raw_bytes(t).tolist())
        header[name] = {
            "dtype": dname,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        data += blob
        offset += len(blob)
    head = json.dumps(header).encode()
    path = tmp_path / "unaligned.safetensors"
    path.write_bytes(struct.pack("<Q", len(head)) + head + data)
    want = reference(path)
    assert_same_tensors(want, {name: t for name, _, _, t in parts})  # the file is what we meant
    assert_same_tensors(fastload.load(path), want)


# ---------------------------------------------------------------------------------------------
# names=


@pytest.mark.parametrize("kind", [list, tuple, set, iter, lambda xs: (x for x in xs)])
def test_names_selects_exactly_those(dtypes_file, kind):
    want = reference(dtypes_file)
    chosen = ["F32.17x13", "BF16.scalar", UNICODE_NAMES[0], "U8.3x0x2"]
    got = fastload.load(dtypes_file, names=kind(chosen))
    assert_same_tensors(got, {n: want[n] for n in chosen})


def test_names_empty_loads_nothing(dtypes_file):
    assert fastload.load(dtypes_file, names=[]) == {}


def test_names_duplicates_are_harmless(dtypes_file):
    got = fastload.load(dtypes_file, names=["I8.7", "I8.7"])
    assert_same_tensors(got, {"I8.7": reference(dtypes_file)["I8.7"]})


def test_names_across_shards(sharded_dir):
    want = reference(*indexed_files(sharded_dir))
    chosen = ["embed.weight", "layers.11.weight", "layers.5.weight"]
    assert_same_tensors(fastload.load(sharded_dir, names=chosen), {n: want[n] for n in chosen})


def test_missing_name_raises_key_error_naming_it(dtypes_file):
    with pytest.raises(KeyError) as info:
        fastload.load(dtypes_file, names=["F32.7", "no_such_tensor"])
    assert isinstance(info.value, fastload.TensorNotFoundError)
    assert info.value.names == ["no_such_tensor"]
    assert "no_such_tensor" in str(info.value)  # the message names it too


def test_missing_names_come_back_as_given(dtypes_file):
    odd = ['quote"d', "back\\slash", "new\nline", "ünï", "tab\t", "nul\x00", "zw\u200b"]
    with pytest.raises(fastload.TensorNotFoundError) as info:
        fastload.load(dtypes_file, names=["F32.7", *odd])
    assert info.value.names == sorted(odd)
    assert info.value.uri == str(dtypes_file)


def test_name_only_in_stray_file_is_missing(sharded_dir):
    with pytest.raises(KeyError) as info:
        fastload.load(sharded_dir, names=["stray.only"])
    assert info.value.names == ["stray.only"]


# ---------------------------------------------------------------------------------------------
# What the returned tensors are


def test_tensors_are_writable_and_independent(dtypes_file):
    before = dtypes_file.read_bytes()
    got = fastload.load(dtypes_file)
    want = reference(dtypes_file)
    target = got["F32.17x13"]
    assert target.numpy().flags.writeable
    target.fill_(12345.0)
    got["U8.17x13"].zero_()
    assert (target == 12345.0).all()
    assert (got["U8.17x13"] == 0).all()
    for name, t in got.items():
        if name not in ("F32.17x13", "U8.17x13"):
            assert_same_tensor(t, want[name], name)
    # Writes stay in memory: the file and a fresh load are untouched.
    assert dtypes_file.read_bytes() == before
    assert_same_tensors(fastload.load(dtypes_file), want)


def test_tensor_memory_does_not_overlap(dtypes_file):
    spans = sorted(
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), n)
        for n, t in fastload.load(dtypes_file).items()
        if t.numel()
    )
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        assert end <= start, f"{a} and {b} share memory"


def test_tensors_outlive_the_dict_and_later_loads(dtypes_file, tmp_path):
    want = reference(dtypes_file)
    kept = fastload.load(dtypes_file)["F64.17x13"]
    gc.collect()
    # Same layout, other bytes: a loader that recycles its buffers under live tensors shows here.
    other = tmp_path / "other.safetensors"
    save_file({k: pattern(v.shape, v.dtype, seed=500) for k, v in want.items()}, str(other))
    for _ in range(3):
        fastload.load(other)
    junk = [torch.full((1 << 16,), 0xAB, dtype=torch.uint8) for _ in range(64)]
    assert_same_tensor(kept, want["F64.17x13"])
    del junk


def test_plain_results(dtypes_file):
    got = fastload.load(dtypes_file, device="cpu")
    t = got["F32.3x5"]
    assert type(got) is dict
    assert all(type(k) is str for k in got)
    assert t.device == torch.device("cpu")
    assert not t.requires_grad
    # Ordinary torch ops work and give the reference's answers.
    ref = reference(dtypes_file)["F32.3x5"]
    assert torch.equal(raw_bytes(t.clone()), raw_bytes(ref))
    assert torch.equal(raw_bytes(t.t().contiguous()), raw_bytes(ref.t().contiguous()))


# ---------------------------------------------------------------------------------------------
# Threads


def test_concurrent_loads_of_the_same_files(dtypes_file, tiny_file, sharded_dir):
    sources = [dtypes_file, tiny_file, sharded_dir]
    want = {str(s): reference(*(indexed_files(s) if s.is_dir() else [s])) for s in sources}
    workers = 4
    barrier = threading.Barrier(workers)

    def work(i):
        barrier.wait()
        out = []
        for k in range(len(sources)):
            src = sources[(i + k) % len(sources)]
            out.append((str(src), fastload.load(src, block_size="64KiB")))
        return out

    with ThreadPoolExecutor(workers) as pool:
        results = [
            r for fut in [pool.submit(work, i) for i in range(workers)] for r in fut.result()
        ]
    assert len(results) == workers * len(sources)
    for src, got in results:
        assert_same_tensors(got, want[src])


def test_relative_path(dtypes_file, monkeypatch):
    monkeypatch.chdir(dtypes_file.parent)
    assert_same_tensors(fastload.load(dtypes_file.name), reference(dtypes_file))


def test_torch_knows_every_dtype_of_the_native_module():
    from fastload import _fastload, _torch

    assert set(_torch._TORCH_NAMES) == set(_fastload.DTYPES)
    # The same dtypes, and the same torch dtype for each, as the tests' own table (helpers.py).
    assert _torch.DTYPES == DTYPES
    # What DLPack carries natively, torch has natively (torch.from_dlpack builds it).
    assert set(_fastload.DLPACK_DTYPES) <= set(_torch.DTYPES)
