"""Malformed files: a clean `fastload.FormatError` naming the file and the problem, never a crash,
a hang or a MemoryError.

Every malformed file starts as a file written by the reference writer
(`safetensors.torch.save_file`) and is then cut short or has its header edited. The header
parser itself is unit-tested and fuzzed in Rust (`src/format.rs`, `fuzz/`); these tests check
that its verdicts reach Python intact, through every public entry point.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import fastload
import pytest
import torch
from safetensors.torch import load_file, save_file

# The reference writer puts "b" (I64, 24 bytes) at [0, 24] and "w" (F32, 24 bytes) at [24, 48].
DATA_LEN = 48


def write_reference(path: Path) -> Path:
    save_file(
        {
            "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "b": torch.arange(3, dtype=torch.int64),
        },
        str(path),
        metadata={"format": "pt"},
    )
    return path


def split(raw: bytes) -> tuple[int, dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return n, json.loads(raw[8 : 8 + n]), raw[8 + n :]


def assemble(header: bytes | str | dict, data: bytes, n: int | None = None) -> bytes:
    """A file from a header (padded to 8 bytes with spaces, as the writer does) and data."""
    if isinstance(header, dict):
        header = json.dumps(header, separators=(",", ":"))
    if isinstance(header, str):
        header = header.encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header) if n is None else n) + header + data


def edited(raw: bytes, change, extra_data: bytes = b"") -> bytes:
    _, header, data = split(raw)
    change(header)
    return assemble(header, data + extra_data)


def _set(name: str, **fields):
    return lambda h: h[name].update(fields)


def _truncated_in_header(raw: bytes) -> bytes:
    n, _, _ = split(raw)
    return raw[: 8 + n // 2]


def _invalid_utf8(raw: bytes) -> bytes:
    n, _, data = split(raw)
    text = raw[8 : 8 + n]
    at = text.index(b'"w"') + 1
    return raw[:8] + text[:at] + b"\xff" + text[at + 1 :] + data


def _invalid_json(raw: bytes) -> bytes:
    n, _, data = split(raw)
    return assemble(raw[8 : 8 + n].rstrip()[:-1] + b",}", data)


def _duplicate_name(raw: bytes) -> bytes:
    _, header, data = split(raw)
    text = json.dumps(header, separators=(",", ":"))
    return assemble(text[:-1] + ',"w":' + json.dumps(header["w"]) + "}", data)


# name -> (make malformed bytes from the reference file's bytes, words the message must contain;
# each entry in the tuple is a set of alternatives, one of which must appear, case-insensitively)
CASES = {
    "empty_file": (lambda raw: b"", ({"0 bytes", "too small", "empty"},)),
    "seven_bytes": (lambda raw: raw[:7], ({"7 bytes", "too small"},)),
    "truncated_in_header": (_truncated_in_header, ({"past the end", "truncated"},)),
    "truncated_in_data": (
        lambda raw: raw[:-3],
        ({"past the end", "cover", "truncated"}, {"45"}),
    ),
    "header_len_past_end": (
        lambda raw: struct.pack("<Q", len(raw)) + raw[8:],
        ({"past the end"}, {"header length"}),
    ),
    "header_len_2_63": (
        lambda raw: struct.pack("<Q", 2**63) + raw[8:],
        ({"limit", "too large"}, {str(2**63)}),
    ),
    "header_len_100mb_plus_1": (
        lambda raw: struct.pack("<Q", 100_000_001) + raw[8:],
        ({"limit", "too large", "past the end"}, {"100000001"}),
    ),
    "header_len_1": (lambda raw: struct.pack("<Q", 1) + raw[8:], ({"too small"},)),
    "invalid_json": (_invalid_json, ({"json"},)),
    "invalid_utf8": (_invalid_utf8, ({"utf-8", "utf8"},)),
    "not_an_object": (lambda raw: assemble("[1, 2, 3]", b""), ({"'{'", "object"},)),
    "unknown_dtype": (
        lambda raw: edited(raw, _set("w", dtype="F128")),
        ({"dtype"}, {"F128"}, {'"w"'}),
    ),
    "overflowing_shape": (
        lambda raw: edited(raw, _set("w", shape=[2**32, 2**32, 16])),
        ({"overflow"}, {'"w"'}),
    ),
    "dimension_above_2_63_in_an_empty_shape": (
        lambda raw: assemble(
            {"z": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, b""
        ),
        ({"2^63"}, {'"z"'}),
    ),
    "shape_disagrees_with_offsets": (
        lambda raw: edited(raw, _set("w", shape=[2, 2])),
        ({"needs 16 bytes", "shape"}, {'"w"'}),
    ),
    "offsets_out_of_range": (
        lambda raw: edited(raw, _set("w", data_offsets=[40, 64])),
        ({"past the end", "out of range", "out of bounds"}, {'"w"'}),
    ),
    "offsets_backwards": (
        lambda raw: edited(raw, _set("w", shape=[0], data_offsets=[24, 0])),
        ({"backwards"}, {'"w"'}),
    ),
    "overlapping_tensors": (
        lambda raw: edited(raw, _set("w", data_offsets=[16, 40])),
        ({"overlap"}, {'"w"'}),
    ),
    "gapped_tensors": (
        lambda raw: edited(raw, _set("w", data_offsets=[28, 52]), extra_data=bytes(4)),
        ({"gap"}, {'"w"'}),
    ),
    "data_longer_than_tensors": (
        lambda raw: raw + bytes(8),
        ({"cover"}, {"56"}),
    ),
    "duplicate_names": (_duplicate_name, ({"duplicate"}, {'"w"'})),
    "metadata_not_strings": (
        lambda raw: edited(raw, lambda h: h.update(__metadata__={"step": 3})),
        ({"__metadata__"},),
    ),
    "f4_odd_element_count": (
        lambda raw: assemble(
            {"q": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)
        ),
        ({"whole bytes"}, {'"q"'}),
    ),
}


def _load(path):
    return fastload.load(path)


def _stream(path):
    return list(fastload.stream(path))


def _inspect(path):
    return fastload.inspect(path)


READERS = {"load": _load, "stream": _stream, "inspect": _inspect}


def check_message(err: BaseException, path, alternatives) -> None:
    msg = str(err)
    assert os.fspath(path) in msg, f"message does not name {path}: {msg}"
    for words in alternatives:
        assert any(w.lower() in msg.lower() for w in words), f"expected one of {words}: {msg}"


@pytest.fixture(scope="module")
def reference_bytes(tmp_path_factory) -> bytes:
    path = write_reference(tmp_path_factory.mktemp("ref") / "ref.safetensors")
    raw = path.read_bytes()
    _, header, data = split(raw)
    assert header["b"]["data_offsets"] == [0, 24] and header["w"]["data_offsets"] == [24, 48]
    assert len(data) == DATA_LEN
    return raw


@pytest.fixture(scope="module")
def malformed_dir(tmp_path_factory, reference_bytes) -> Path:
    d = tmp_path_factory.mktemp("malformed")
    for name, (make, _) in CASES.items():
        (d / f"{name}.safetensors").write_bytes(make(reference_bytes))
    return d


def test_reference_file_loads(tmp_path):
    """The starting point is valid: only the edits make the files malformed."""
    path = write_reference(tmp_path / "ok.safetensors")
    got = fastload.load(path)
    want = load_file(str(path))
    assert sorted(got) == sorted(want)
    for k in want:
        assert torch.equal(got[k], want[k])


@pytest.mark.parametrize("reader", sorted(READERS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_raises_format_error(malformed_dir, case, reader):
    path = malformed_dir / f"{case}.safetensors"
    with pytest.raises(fastload.FormatError) as info:
        READERS[reader](path)
    err = info.value
    assert isinstance(err, fastload.FastloadError)
    assert isinstance(err, ValueError)
    check_message(err, path, CASES[case][1])


@pytest.mark.parametrize("case", ["invalid_json", "overlapping_tensors", "truncated_in_data"])
def test_malformed_file_as_str_and_in_a_list(malformed_dir, case):
    path = malformed_dir / f"{case}.safetensors"
    for uri in (str(path), [path]):
        with pytest.raises(fastload.FormatError) as info:
            fastload.load(uri)
        check_message(info.value, path, CASES[case][1])


def test_header_len_over_limit_in_a_big_sparse_file(tmp_path, reference_bytes):
    """The file is big enough to hold a 100 MB + 1 header: only the cap can reject it, and it must
    do so before reading or allocating the header."""
    path = tmp_path / "big_header.safetensors"
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 100_000_001) + reference_bytes[8:])
        f.truncate(200_000_000)  # sparse: no disk used
    for reader in (_load, _stream):
        with pytest.raises(fastload.FormatError) as info:
            reader(path)
        check_message(info.value, path, ({"limit", "too large"}, {"100000001"}))


def test_missing_path_raises_file_not_found(tmp_path):
    path = tmp_path / "nope.safetensors"
    for reader in (_load, _stream):
        with pytest.raises(FileNotFoundError) as info:
            reader(path)
        assert isinstance(info.value, fastload.FastloadError)
        assert str(path) in str(info.value)
    with pytest.raises(FileNotFoundError):
        fastload.load(tmp_path / "no_such_dir")


def test_directory_without_safetensors_files(tmp_path):
    d = tmp_path / "empty_ckpt"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "model.bin").write_bytes(b"\0" * 16)
    for reader in (_load, _stream):
        with pytest.raises(fastload.FastloadError) as info:
            reader(d)
        # Nothing to load is reported like a missing file (or as a malformed checkpoint).
        assert isinstance(info.value, (FileNotFoundError, ValueError)), type(info.value)
        assert str(d) in str(info.value)


def _write_shards(d: Path, n: int = 3, index: bool = True) -> list[Path]:
    d.mkdir()
    weight_map = {}
    paths = []
    for s in range(n):
        fname = f"model-{s + 1:05d}-of-{n:05d}.safetensors"
        tensors = {
            f"layers.{s}.{k}.weight": torch.full((4, 5), float(s * 10 + k)) for k in range(3)
        }
        save_file(tensors, str(d / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
        paths.append(d / fname)
    if index:
        idx = {"metadata": {"total_size": 0}, "weight_map": weight_map}
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return paths


@pytest.mark.parametrize("index", [True, False], ids=["indexed", "plain_dir"])
@pytest.mark.parametrize(
    "corruption", ["overlapping_tensors", "truncated_in_data", "invalid_json", "header_len_2_63"]
)
def test_corrupt_shard_is_named(tmp_path, index, corruption):
    d = tmp_path / "ckpt"
    shards = _write_shards(d, index=index)
    assert len(fastload.load(d)) == 9
    bad = shards[1]
    make, words = CASES[corruption]
    raw = bad.read_bytes()
    if corruption == "overlapping_tensors":
        # These shards have other names and offsets than the reference file.
        raw = edited(raw, lambda h: h["layers.1.1.weight"].update(data_offsets=[0, 80]))
        words = ({"overlap"},)
    elif corruption == "truncated_in_data":
        raw = raw[:-3]
        words = ({"past the end", "cover", "truncated"},)
    else:
        raw = make(raw)
    bad.write_bytes(raw)
    for reader in (_load, _stream):
        with pytest.raises(fastload.FormatError) as info:
            reader(d)
        check_message(info.value, bad, words)
        for good in (shards[0], shards[2]):
            assert os.fspath(good) not in str(info.value)


def _index(d: Path, shards: list[Path]) -> Path:
    """A `model.safetensors.index.json` in `d` naming exactly `shards` (every tensor of each)."""
    weight_map = {name: p.name for p in shards for name in load_file(str(p))}
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.parametrize("missing", [[2, 3], [2], [1]], ids=["1_of_3", "2_missing", "1_missing"])
def test_a_folder_missing_shards_loads_nothing_and_names_them(tmp_path, missing):
    """A save that stopped part-way leaves `model-00001-of-00003.safetensors` without the others
    (and no index): the folder is refused, not loaded as a smaller model."""
    d = tmp_path / "ckpt"
    shards = _write_shards(d, index=False)
    for k in missing:
        shards[k - 1].unlink()
    for reader in READERS.values():
        with pytest.raises(fastload.FormatError) as info:
            reader(d)
        check_message(info.value, d, ({"incomplete"},))
        for k in missing:
            assert f"model-{k:05d}-of-00003.safetensors" in str(info.value), info.value
        assert "all 3 files" in str(info.value), info.value
    # One shard asked for by name is a choice, not a folder's listing: it loads.
    present = next(p for p in shards if p.exists())
    assert fastload.load(present).keys() == load_file(str(present)).keys()


def test_an_index_naming_part_of_a_shard_set_is_refused(tmp_path):
    """An index is what decides the files, but one naming 2 of 3 shards would load a smaller
    model: refused naming the index and the shard it leaves out."""
    d = tmp_path / "ckpt"
    shards = _write_shards(d, index=False)
    index = _index(d, shards[:2])
    for uri in (d, index):
        for reader in READERS.values():
            with pytest.raises(fastload.FormatError) as info:
                reader(uri)
            check_message(info.value, index, ({"model-00003-of-00003.safetensors"},))


def test_two_checkpoints_in_one_folder_are_refused_unless_an_index_decides(tmp_path):
    """An older save's files beside a newer one's (`model.safetensors` beside a shard set, or
    sets of different sizes) are refused saying which to remove; an index settles which set is
    the checkpoint."""
    d = tmp_path / "ckpt"
    shards = _write_shards(d, n=2, index=False)
    single = d / "model.safetensors"
    save_file({"old.weight": torch.ones(3)}, str(single), metadata={"format": "pt"})
    for reader in READERS.values():
        with pytest.raises(fastload.FormatError) as info:
            reader(d)
        check_message(
            info.value,
            d,
            ({"remove model.safetensors or the model-0000K-of-00002.safetensors files"},),
        )
    single.unlink()
    older = tmp_path / "older"
    for p in _write_shards(older, n=3, index=False):
        p.rename(d / p.name)
    with pytest.raises(fastload.FormatError) as info:
        fastload.load(d)
    check_message(
        info.value,
        d,
        ({"model-0000K-of-00002.safetensors (2 files) and model-0000K-of-00003.safetensors"},),
    )
    # An index naming one whole set: exactly that set loads, whatever else the folder holds.
    _index(d, shards)
    want: dict[str, torch.Tensor] = {}
    for p in shards:
        want.update(load_file(str(p)))
    got = fastload.load(d)
    assert got.keys() == want.keys()
    assert all(got[k].equal(want[k]) for k in want)


@pytest.mark.parametrize(
    "index_text, words",
    [
        ('{"weight_map": {', ({"json"},)),
        ('{"metadata": {}}', ({"weight_map"},)),
        ('{"weight_map": {"a": 3}}', ({"weight_map", "file name"},)),
    ],
    ids=["invalid_json", "no_weight_map", "not_a_file_name"],
)
def test_malformed_index_is_named(tmp_path, index_text, words):
    d = tmp_path / "ckpt"
    _write_shards(d)
    index = d / "model.safetensors.index.json"
    index.write_text(index_text)
    for reader in (_load, _stream):
        with pytest.raises(fastload.FormatError) as info:
            reader(d)
        check_message(info.value, index, words)


def test_index_naming_a_missing_shard(tmp_path):
    d = tmp_path / "ckpt"
    shards = _write_shards(d)
    shards[2].unlink()
    for reader in (_load, _stream):
        with pytest.raises(FileNotFoundError) as info:
            reader(d)
        assert isinstance(info.value, fastload.FastloadError)
        assert os.fspath(shards[2]) in str(info.value)


def test_loader_still_works_after_errors(malformed_dir, tmp_path):
    """A failed load leaves no broken state behind (runtime, buffers, thread pools)."""
    ok = write_reference(tmp_path / "ok.safetensors")
    for case in sorted(CASES):
        with pytest.raises(fastload.FormatError):
            fastload.load(malformed_dir / f"{case}.safetensors")
        assert sorted(fastload.load(ok)) == ["b", "w"]


def test_file_truncated_after_a_good_header_in_a_big_file(tmp_path):
    """Truncation deep in the data of a larger file is caught from the header and the file size,
    before any tensor is handed out."""
    path = tmp_path / "big.safetensors"
    save_file({f"t{i}": torch.full((1024, 256), float(i)) for i in range(8)}, str(path))
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) - 4096)
    got = []
    with pytest.raises(fastload.FormatError) as info:
        for name, _ in fastload.stream(path):
            got.append(name)
    assert got == []
    check_message(info.value, path, ({"past the end", "cover", "truncated"},))


# --- The same in fresh interpreters: a crash (abort, segfault) or a hang fails these, where it
# would take the whole pytest process down in-process. ---

_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    import fastload
    results = {}
    for path in sys.argv[1:]:
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        for how in ("load", "stream"):
            try:
                if how == "load":
                    fastload.load(path)
                else:
                    list(fastload.stream(path))
                outcome = "ok"
            except fastload.FormatError as e:
                outcome = "FormatError: " + str(e)
            except BaseException as e:
                outcome = type(e).__name__ + ": " + str(e)
            results[path + " " + how] = outcome
        grew_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
        results[path + " grew_kib"] = grew_kib
    print(json.dumps(results))
    """
)


def run_probe(paths, timeout=120):
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE, *map(os.fspath, paths)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"rc={proc.returncode}\nstderr:\n{proc.stderr[-4000:]}"
    assert "panicked" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "case", ["header_len_2_63", "header_len_100mb_plus_1", "truncated_in_header", "invalid_utf8"]
)
def test_malformed_in_subprocess(malformed_dir, case):
    path = os.fspath(malformed_dir / f"{case}.safetensors")
    results = run_probe([path])
    for how in ("load", "stream"):
        outcome = results[f"{path} {how}"]
        assert outcome.startswith("FormatError: "), outcome
        assert path in outcome
    # Rejecting a header must not allocate anything near its claimed length.
    assert results[f"{path} grew_kib"] < 64 * 1024, results


def test_every_malformed_case_in_one_subprocess(malformed_dir):
    paths = [os.fspath(malformed_dir / f"{case}.safetensors") for case in sorted(CASES)]
    results = run_probe(paths, timeout=300)
    bad = {
        k: v
        for k, v in results.items()
        if not k.endswith("grew_kib") and not v.startswith("FormatError: ")
    }
    assert not bad, bad


@pytest.mark.parametrize("dtype", ["F6_E2M3", "F6_E3M2"])
def test_f6_tensors_are_refused_naming_file_and_dtype(tmp_path, dtype):
    """torch has no 6-bit dtypes: CPU loads refuse them as staged loads do, never hand out bytes
    of the wrong shape; the headers stay readable."""
    path = tmp_path / "f6.safetensors"
    header = {
        "ok": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
        "q": {"dtype": dtype, "shape": [4], "data_offsets": [2, 5]},  # 4 x 6 bits = 3 bytes
    }
    path.write_bytes(assemble(header, bytes(5)))
    readers = {
        "load": _load,
        "stream": _stream,
        "staged": lambda p: list(fastload.Stream(p, _target="host")),
    }
    for reader in readers.values():
        with pytest.raises(fastload.FormatError) as info:
            reader(path)
        assert info.value.path == str(path)
        check_message(info.value, path, ({dtype}, {"'q'"}, {"not supported"}))
    q = {"name": "q", "dtype": dtype, "shape": [4], "bytes": 3, "file": str(path)}
    assert {**q, "data_offsets": [2, 5]} in fastload.inspect(path)["tensors"]
    assert fastload.load(path, names=["ok"])["ok"].tolist() == [0, 0]
