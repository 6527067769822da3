"""Writes the seed corpus for the `header` fuzz target into fuzz/corpus/header/.

Each seed is 8 bytes little-endian `extra` (file bytes the parser does not see) followed by the
first bytes of a file. Valid seeds come from files written by the reference writer
(`safetensors.torch.save_file`); malformed ones are those files edited by hand.

Run from the repository root with a Python that has torch and safetensors:
    .venv/bin/python fuzz/make_corpus.py
"""

from __future__ import annotations

import json
import struct
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).parent / "corpus" / "header"


def written(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "x.safetensors"
        save_file(tensors, str(path), metadata=metadata)
        return path.read_bytes()


def split(file: bytes) -> tuple[int, bytes, bytes]:
    n = struct.unpack("<Q", file[:8])[0]
    return n, file[: 8 + n], file[8 + n :]


def seed(name: str, file_bytes: bytes, extra: int = 0) -> None:
    (OUT / name).write_bytes(struct.pack("<Q", extra) + file_bytes)


def header_only(name: str, file: bytes) -> None:
    """The usual call: the parser sees the prefix and the JSON, the data stays on disk."""
    _, head, data = split(file)
    seed(name, head, extra=len(data))


def with_json(json_text: str, data_len: int) -> bytes:
    raw = json_text.encode()
    return struct.pack("<Q", len(raw)) + raw + bytes(data_len)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.iterdir():
        old.unlink()
    g = torch.Generator().manual_seed(0)

    small = written({"w": torch.randn(2, 3, generator=g), "b": torch.arange(3, dtype=torch.int64)})
    seed("valid_whole_file", small)
    header_only("valid_header_only", small)

    dtypes = [
        torch.float64,
        torch.float32,
        torch.float16,
        torch.bfloat16,
        torch.int64,
        torch.int32,
        torch.int16,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
        torch.uint16,
        torch.uint32,
        torch.uint64,
        torch.complex64,
    ]
    all_dtypes = {f"t.{str(d).split('.')[-1]}": torch.zeros(2, 2, dtype=d) for d in dtypes}
    header_only("valid_all_dtypes", written(all_dtypes))

    seed(
        "valid_scalars_and_empty",
        written(
            {
                "scalar": torch.tensor(3.5),
                "empty": torch.zeros(0),
                "empty2d": torch.zeros(3, 0, dtype=torch.int32),
                "x": torch.ones(1, dtype=torch.bfloat16),
            }
        ),
    )
    header_only(
        "valid_unicode_metadata",
        written(
            {"名前.weight": torch.ones(2), "émoji_🙂": torch.zeros(1, dtype=torch.int8)},
            metadata={"format": "pt", "note": 'ü\n"quoted"'},
        ),
    )
    header_only("valid_many_tiny", written({f"layer.{i}.b": torch.ones(1) for i in range(24)}))
    seed("valid_no_tensors", written({}))
    seed("valid_metadata_only", written({}, metadata={"format": "pt"}))
    # Sub-byte dtypes: the reference writer has no torch dtype for them; hand-written headers.
    seed(
        "valid_f4_f6",
        with_json(
            json.dumps(
                {
                    "f4": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]},
                    "f6": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [3, 6]},
                    "e8": {"dtype": "F8_E8M0", "shape": [2], "data_offsets": [6, 8]},
                }
            ),
            8,
        ),
    )

    # Malformed, starting from the small valid file.
    n, head, data = split(small)
    header = json.loads(head[8:])
    seed("bad_truncated_in_header", small[: 8 + n // 2])
    seed("bad_truncated_in_data", small[: len(small) - 3])
    seed("bad_header_len_past_end", struct.pack("<Q", len(small)) + small[8:])
    seed("bad_header_len_2_63", struct.pack("<Q", 1 << 63) + small[8:])
    seed("bad_header_len_over_limit", struct.pack("<Q", 100_000_001) + small[8:], extra=200_000_000)
    seed("bad_invalid_utf8", head[:9] + b"\xff\xfe" + head[11:] + data)
    seed("bad_not_an_object", with_json("[1, 2, 3]      ", 0))

    def edited(name: str, change, data_len: int | None = None) -> None:
        h = json.loads(json.dumps(header))
        change(h)
        seed(name, with_json(json.dumps(h), len(data) if data_len is None else data_len))

    edited("bad_unknown_dtype", lambda h: h["w"].update(dtype="F128"))
    edited("bad_shape_overflow", lambda h: h["w"].update(shape=[2**32, 2**32, 16]))
    # The writer puts "b" (I64) at [0, 24] and "w" (F32) at [24, 48].
    assert header["b"]["data_offsets"] == [0, 24] and header["w"]["data_offsets"] == [24, 48]
    edited("bad_offsets_out_of_range", lambda h: h["w"].update(data_offsets=[40, 64]))
    edited("bad_overlap", lambda h: h["w"].update(data_offsets=[16, 40]))
    edited("bad_gap", lambda h: h["w"].update(data_offsets=[28, 52]), len(data) + 4)
    edited("bad_data_longer", lambda h: None, len(data) + 8)
    edited("bad_metadata_not_strings", lambda h: h.update(__metadata__={"k": 1}))
    edited("bad_f4_odd", lambda h: h["w"].update(dtype="F4", shape=[3], data_offsets=[24, 26]))
    dup = head[8:].decode().rstrip().removesuffix("}") + ', "w": ' + json.dumps(header["w"]) + "}"
    seed("bad_duplicate_name", with_json(dup, len(data)))
    seed("bad_empty", b"")
    seed("bad_seven_bytes", b"\x02\x00\x00\x00\x00\x00\x00")


if __name__ == "__main__":
    main()
