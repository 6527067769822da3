"""Regions of a tensor as the native planner (``_fastload.plan_region``, ``src/regions.rs``)
plans them, property-tested against torch's own indexing: for any shape and basic index (ints,
slices with bounds and steps at the edges of int64, ``...``, ``None``) and any cost of a request,
the runs it reads, viewed through its size, strides and view, are exactly ``tensor[index]``; its
shape is the result's; what it refuses is what torch refuses or indexes itself; and the reads
it groups the runs into cover every run once."""

from __future__ import annotations

import huge_indices
import pytest
import torch
from fastload import _fastload
from hypothesis import given, settings
from hypothesis import strategies as st

COSTS = [0, _fastload.LOCAL_READ_COST, _fastload.REMOTE_READ_COST, _fastload.MAPPED_READ_COST]
ITEMSIZES = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _read(tensor: torch.Tensor, region) -> torch.Tensor:
    """``region`` read from ``tensor``'s bytes: its runs one after the other, viewed as it says."""
    raw = tensor.contiguous().reshape(-1).view(torch.uint8)
    got = torch.cat([raw[o : o + n] for o, n in region.runs]).view(tensor.dtype)
    out = got.as_strided(region.size, region.stride)
    return out if region.view is None else out[region.view]


@st.composite
def cases(draw):
    shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
    index = draw(huge_indices.huge_indices(shape))
    itemsize = draw(st.sampled_from(sorted(ITEMSIZES)))
    return shape, index, itemsize, draw(st.sampled_from(COSTS))


@settings(max_examples=500, deadline=None)
@given(case=cases())
def test_regions_read_exactly_what_torch_indexes(case):
    shape, index, itemsize, cost = case
    what = f"{shape}[{index!r}] itemsize {itemsize} cost {cost}"
    region = _fastload.plan_region(shape, itemsize, index, cost)
    try:
        want_shape = huge_indices.expected_shape(shape, index)
    except IndexError:
        assert region.refused is not None, what
        assert region.refused[0] in ("out_of_range", "too_many"), what
        return
    assert region.refused is None, what
    assert tuple(region.shape) == want_shape, what
    numel = 1
    for n in want_shape:
        numel *= n
    assert region.empty == (numel == 0), what
    if region.empty:
        return
    tensor = torch.arange(max(1, _prod(shape)), dtype=ITEMSIZES[itemsize])[: _prod(shape)]
    tensor = tensor.reshape(shape)
    want = tensor[huge_indices.safe_index(shape, index)]
    assert torch.equal(_read(tensor, region), want), what
    runs = region.runs
    assert all(a[0] + a[1] <= b[0] for a, b in zip(runs, runs[1:])), what
    assert region.bytes == sum(n for _, n in runs) >= numel * itemsize, what


def _prod(shape) -> int:
    out = 1
    for n in shape:
        out *= n
    return out


@pytest.mark.parametrize(
    "index, kind",
    [
        (slice(None, None, -1), "step"),
        ((slice(None), slice(0, 2, 0)), "step"),
        ([0, 1], "item"),
        (True, "item"),
        (torch.tensor(1), "item"),
        (slice(torch.tensor(0), 2), "item"),
        ((Ellipsis, 0, Ellipsis), "ellipses"),
        ((0, 0, 0), "too_many"),
    ],
)
def test_what_the_planner_refuses_torch_indexes_or_refuses_itself(index, kind):
    """Indices that are not regions are refused (the reader reads the tensor whole and lets
    torch index it, or raise): negative and zero steps (torch's ValueError), lists, tensors,
    booleans (advanced indexing), two ``...``, too many indices."""
    region = _fastload.plan_region((4, 3), 2, index, 0)
    assert region.refused is not None and region.refused[0] == kind
    tensor = torch.arange(12).reshape(4, 3)
    if kind == "step":
        with pytest.raises(ValueError):
            tensor[index]
    elif kind == "item":
        tensor[index]  # torch's advanced indexing


def test_none_is_refused_where_a_part_cannot_take_it():
    assert _fastload.plan_region((4, 3), 2, (None, 0), 0).refused is None
    assert _fastload.plan_region((4, 3), 2, (None, 0), 0, new_axes=False).refused == (
        "item",
        0,
        None,
    )


@settings(max_examples=200, deadline=None)
@given(
    rows=st.integers(1, 64),
    width=st.integers(1, 64),
    cols=st.integers(1, 64),
    cost=st.sampled_from(COSTS[:3]),
    span_max=st.sampled_from([64, 4096, 64 << 20]),
)
def test_reads_cover_every_run_once(rows, width, cols, cost, span_max):
    """A column slice of ``rows`` rows, planned a run per row and grouped into reads: each read
    spans consecutive runs, from the first's start to the last's end, every run in one."""
    cols = min(cols, width)
    merge = (cost, True, 0.1, 2.0, span_max)
    region = _fastload.plan_region((rows, width), 2, (slice(None), slice(0, cols)), 0, merge)
    runs = region.runs
    covered = 0
    for (begin, end), strips in zip(region.reads, region.strips):
        first = strips[0][0]
        count = sum(s[1] for s in strips)
        assert first == covered and begin == runs[first][0]
        assert end == runs[first + count - 1][0] + runs[first + count - 1][1]
        covered += count
    assert covered == len(runs) == region.run_count


def test_what_a_request_costs_is_the_files_source(range_server, tmp_path):
    """Each file's header says what one more request to its source costs (``read_cost``), by
    the source, not its name: a pread for a local file, a round trip over HTTP; a slice of each
    is planned by it (a column slice of narrow rows is one span over HTTP, a run per row from a
    file whose rows are wider than a pread's cost)."""
    from fastload import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "w.safetensors"
    # 64 rows of 128 KiB: half of each row is 64 KiB, more than a pread costs, less than a
    # round trip.
    save_file({"w": torch.zeros(64, 65536, dtype=torch.bfloat16)}, str(path))
    range_server.put({"w.safetensors": path})
    url = range_server.url("w.safetensors")
    assert _fastload.Reader([str(path)]).headers()[0]["read_cost"] == _fastload.LOCAL_READ_COST
    assert _fastload.Reader([url]).headers()[0]["read_cost"] == _fastload.REMOTE_READ_COST
    row = 65536 * 2
    # A file: the 64 half rows; HTTP: one span from the first to the last.
    for where, read in ((str(path), 64 * row // 2), (url, 63 * row + row // 2)):
        with safe_open(where, "pt") as f:
            assert f.get_slice("w")[:, 0:32768].shape == (64, 32768)
            assert f.bytes_read == read, where


def test_the_three_region_readers_count_one_slice_alike(tmp_path):
    """The engines' lazy tensors, a ``parts=`` load and transformers' tensor-parallel slices
    count what they read in one shape (``_regions.ReadStats``), and read of the same slice of
    the same file, they count the same: one tensor of two read as a part, its bytes, the whole
    tensor's size, the other tensor not read."""
    import fastload
    from fastload._lazy import Checkpoint
    from fastload._regions import ReadStats
    from fastload.transformers import _File
    from safetensors.torch import save_file

    w, other = torch.arange(16 * 32, dtype=torch.float32).reshape(16, 32), torch.ones(8)
    path = tmp_path / "m.safetensors"
    save_file({"w": w, "other": other}, str(path))
    rows = (slice(2, 6),)

    lazy = ReadStats()
    got = dict(Checkpoint(path, lazy))["w"][rows]
    assert torch.equal(torch.empty(4, 32).copy_(got), w[rows])

    with fastload.Stream(path, _target="host", parts={"w": rows}, names=["w"]) as s:
        assert torch.equal(dict(s)["w"], w[rows])
        assert s._parts is not None
        parts = s._parts.counts

    sliced = ReadStats()
    file = _File(str(path), {}, sliced)
    try:
        file.slices()
        assert torch.equal(file.read("w", rows), w[rows])
    finally:
        file.close()

    assert type(lazy) is type(parts) is type(sliced) is ReadStats
    want = {"sliced_tensors": 1, "sliced_bytes": 4 * 32 * 4, "sliced_tensor_bytes": w.nbytes}
    for stats in (lazy, parts, sliced):
        got_counts = stats.as_dict()
        assert {k: got_counts[k] for k in want} == want, got_counts
    # The parts= plan also says how it read the part (one run, one read).
    assert (parts.sliced_runs, parts.sliced_reads) == (1, 1)
    # Each counted the file's two tensors; names=["w"] planned only one.
    assert (lazy.tensors, sliced.tensors, parts.tensors) == (2, 2, 1)
    assert lazy.skipped_tensors == sliced.skipped_tensors == 1
    assert lazy.read_bytes == parts.read_bytes == sliced.read_bytes == 4 * 32 * 4
