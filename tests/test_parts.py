"""``fastload.load(..., parts={name: index})``: each part bitwise equal to indexing the tensor
safetensors loads (property-tested, every dtype, the CPU and the staged path), only the planned
bytes read (a counting HTTP server sees exactly them), every store, ``names``, the cache, and
clear errors for parts that cannot be read."""

from __future__ import annotations

from unittest import mock

import fastload
import fastload._parts
import huge_indices
import pytest
import safetensors.torch
import stores
import torch
from fastload._parts import Cost, merge_runs
from fastload._safe_open import REMOTE_READ_COST, plan
from helpers import DTYPES, pattern, raw_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

REMOTE = Cost(REMOTE_READ_COST, spans=True)

# Every dtype torch and safetensors share (F4 packs two values a byte: its own case below).
PART_DTYPES = sorted(k for k in DTYPES if k != "F4")


@st.composite
def parts_of(draw, shape: tuple[int, ...]):
    """A valid part of a tensor of ``shape``: ints in range, slices with steps >= 1 and any
    bounds (torch clamps them), fewer indices than dims, maybe one ``...`` (the indices after
    it index the last dims)."""

    def one(n: int):
        if n and draw(st.integers(0, 3)) == 0:
            return draw(st.integers(-n, n - 1))
        bound = st.one_of(st.none(), st.integers(-n - 2, n + 2))
        step = st.one_of(st.none(), st.integers(1, 3))
        return slice(draw(bound), draw(bound), draw(step))

    k = draw(st.integers(0, len(shape)))
    items: list = [one(n) for n in shape[:k]]
    if draw(st.booleans()):
        j = draw(st.integers(0, len(shape) - k))
        items += [Ellipsis, *(one(n) for n in shape[len(shape) - j :])]
    if len(items) == 1 and draw(st.booleans()):
        return items[0]
    return tuple(items)


@st.composite
def checkpoints(draw):
    """A few tensors of random dtypes and shapes (some empty, a scalar)."""
    count = draw(st.integers(1, 4))
    tensors = {}
    for i in range(count):
        dtype = draw(st.sampled_from(PART_DTYPES))
        shape = tuple(draw(st.lists(st.integers(0, 7), min_size=0, max_size=4)))
        tensors[f"t{i}"] = pattern(shape, DTYPES[dtype], seed=i + 1)
    return tensors


def _same(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(_bytes(got), _bytes(want)), what


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements' bytes in C order (a copy with standard strides: a view of size-1 dims may
    keep any stride, which ``view(torch.uint8)`` refuses)."""
    return raw_bytes(torch.empty(t.shape, dtype=t.dtype).copy_(t))


@settings(
    max_examples=80,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_parts_equal_indexing_the_whole_tensor(tmp_path, data):
    tensors = data.draw(checkpoints(), label="tensors")
    path = tmp_path / "parts.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    full = safetensors.torch.load_file(str(path))
    chosen = data.draw(st.lists(st.sampled_from(sorted(full)), unique=True), label="sliced")
    parts = {n: data.draw(parts_of(tuple(full[n].shape)), label=n) for n in chosen}
    names = data.draw(st.one_of(st.none(), st.just([*chosen, *sorted(full)[:1]])), label="names")
    staged = data.draw(st.booleans(), label="staged")
    block = data.draw(st.sampled_from([None, "4KiB"]), label="block_size")
    # Runs merged into reads as any source's cost model may merge them (gaps read, then left).
    cost = data.draw(st.builds(Cost, st.sampled_from([0, 8, 64, 1 << 20]), st.booleans()))
    kw = {"names": names, "block_size": block}
    with mock.patch.object(fastload._parts, "_cost", lambda file: cost):
        if staged:  # the GPU path's pipeline, into host memory
            with fastload.Stream(path, _target="host", parts=parts, **kw) as s:
                got = dict(s)
        else:
            got = fastload.load(path, parts=parts, **kw)
    want_names = set(full) if names is None else set(names)
    assert set(got) == want_names
    for n in want_names:
        want = full[n][parts[n]] if n in parts else full[n]
        _same(got[n], want, f"{n}{list(full[n].shape)}[{parts.get(n)!r}]")


# huge_indices' fixture, bound here so that pytest finds it.
edge_files = huge_indices.edge_files


@settings(huge_indices.EDGE_SETTINGS, max_examples=300)
@given(data=st.data())
def test_parts_at_the_edges_of_int64(edge_files, data):
    """Steps and bounds of 2**62 and past int64 (``slice(0, 4, 2**62)``), negative ints and
    ``...``, of small tensors and of tensors of no element with dims of 2**62: the part the
    index names (its shape by Python's range arithmetic, its values those of the whole tensor
    indexed), on the CPU and the staged path; an int out of range or a ``None`` is a
    ConfigError(option="parts"), never another error."""
    shape = data.draw(st.sampled_from(list(edge_files)), label="shape")
    index = data.draw(huge_indices.huge_indices(shape), label="index")
    staged = data.draw(st.booleans(), label="staged")
    path, what = edge_files[shape], f"{shape}[{index!r}]"
    items = index if isinstance(index, tuple) else (index,)
    try:
        right = huge_indices.expected_shape(shape, index)
    except IndexError:
        right = None
    try:
        if staged:
            with fastload.Stream(path, _target="host", parts={"t": index}) as s:
                got = dict(s)["t"]
        else:
            got = fastload.load(path, parts={"t": index})["t"]
    except fastload.ConfigError as e:
        assert e.option == "parts", what
        assert right is None or None in items, (what, e)
        return
    assert right is not None and None not in items, what
    assert got.dtype == torch.float32 and tuple(got.shape) == right, what
    if got.numel():
        whole = safetensors.torch.load_file(str(path))["t"]
        _same(got, whole[huge_indices.safe_index(shape, index)], what)


def test_a_step_past_the_tensor_picks_one_element(tmp_path):
    """``slice(0, 4, 2**62)``: row 0 alone, as torch's indexing gives it (its step is no
    stride: as one, 2**62 rows of 3 elements would overflow int64)."""
    m = pattern((4, 3), torch.float32, seed=2)
    path = tmp_path / "m.safetensors"
    safetensors.torch.save_file({"m": m}, str(path))
    for index in [
        (slice(0, 4, 2**62),),
        (slice(None), slice(1, None, 2**62)),
        slice(3, None, 2**63),
    ]:
        got = fastload.load(path, parts={"m": index})["m"]
        _same(got, m[huge_indices.safe_index((4, 3), index)], repr(index))
    _same(fastload.load(path, parts={"m": (slice(0, 4, 2**62),)})["m"], m[0:1], "m[0:4:2**62]")


def test_f4_parts(tmp_path):
    f4 = DTYPES.get("F4")
    if f4 is None:
        pytest.skip("this torch has no float4_e2m1fn_x2")
    w = pattern((6, 8), f4, seed=3)
    path = tmp_path / "f4.safetensors"
    safetensors.torch.save_file({"w": w}, str(path))
    full = safetensors.torch.load_file(str(path))["w"]
    for index in [(slice(1, 4),), (slice(None), slice(2, 5)), (2,)]:
        _same(fastload.load(path, parts={"w": index})["w"], full[index], repr(index))


# -- what is read -----------------------------------------------------------------------------


def _served(log, path, since):
    """The (offset, len) of each ranged GET of tensor data of ``path`` after ``since``: not the
    header's read, the one from offset 0 (data starts after the header), which every load makes
    alike (its length a guess at the header's, the whole of a small file)."""
    out = []
    for method, p, rng, status in log[since:]:
        if method == "GET" and p == path:
            assert rng and status == 206, (rng, status)
            a, b = rng.removeprefix("bytes=").split("-")
            if int(a):
                out.append((int(a), int(b) - int(a) + 1))
    return out


def _covered(ranges):
    """Bytes of the union of ``(offset, len)`` ranges, as sorted disjoint intervals."""
    out: list[list[int]] = []
    for a, n in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], a + n)
        else:
            out.append([a, a + n])
    return [tuple(x) for x in out]


@pytest.fixture(scope="module")
def remote_file(tmp_path_factory):
    d = tmp_path_factory.mktemp("parts")
    tensors = {
        "w": pattern((64, 96), torch.bfloat16, seed=1),
        "b": pattern((5, 7, 6), torch.float32, seed=2),
        "e": pattern((40, 3), DTYPES["F8_E4M3"], seed=4),
        "m": pattern((9, 11), torch.bool, seed=5),
    }
    path = d / "parts.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    return path


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_http_server_sees_exactly_the_planned_bytes(range_server, remote_file, data):
    range_server.put({"parts.safetensors": remote_file})
    url = range_server.url("parts.safetensors")
    full = safetensors.torch.load_file(str(remote_file))
    chosen = data.draw(st.lists(st.sampled_from(sorted(full)), unique=True, min_size=1))
    parts = {n: data.draw(parts_of(tuple(full[n].shape)), label=n) for n in chosen}
    report = fastload.inspect(remote_file)
    start = report["files"][0]["header_bytes"]
    planned, needed = [], []
    for t in report["tensors"]:
        begin = t["data_offsets"][0]
        if t["name"] not in parts:
            planned.append((start + begin, t["data_offsets"][1] - begin))
            continue
        item = full[t["name"]].element_size()
        p = plan(tuple(t["shape"]), item, parts[t["name"]], read_cost=0)
        runs = p.ranges if p else []
        needed += [(start + begin + o, n) for o, n in runs]
        # The runs read as merge_runs groups them (a remote file: gaps under a request's cost).
        for first, count in merge_runs(runs, REMOTE):
            a, (b, n) = runs[first][0], runs[first + count - 1]
            planned.append((start + begin + a, b + n - a))
    log = range_server.behaviour.log
    since = len(log)
    with fastload.stream(url, parts=parts, block_size="4KiB") as s:
        got = dict(s)
        stats = s.stats()
    served = _served(log, "/parts.safetensors", since)
    # Every byte planned, no byte twice, no other byte; every byte a part needs among them.
    assert sum(n for _, n in served) == sum(n for _, n in planned) == stats["bytes_read"]
    assert _covered(served) == _covered(planned)
    spans = _covered(served)
    assert all(any(x <= a and a + n <= y for x, y in spans) for a, n in needed)
    assert stats["part_bytes"] + stats["whole_bytes"] == stats["bytes_read"]
    assert stats["part_tensors"] == len(parts) and stats["whole_tensors"] == 4 - len(parts)
    for n, t in full.items():
        _same(got[n], t[parts[n]] if n in parts else t, n)


@settings(max_examples=200, deadline=None)
@given(
    runs=st.lists(st.tuples(st.integers(0, 3000), st.integers(1, 3000)), max_size=40),
    cost=st.builds(Cost, st.integers(0, 4000), st.booleans()),
)
def test_merge_runs_groups_every_run_once_and_bounds_what_it_adds(runs, cost):
    at, ranges = 0, []
    for gap, n in runs:
        ranges.append((at + gap, n))
        at += gap + n
    groups = merge_runs(ranges, cost)
    assert [i for first, count in groups for i in range(first, first + count)] == list(
        range(len(ranges))
    )
    added = [
        ranges[i + 1][0] - ranges[i][0] - ranges[i][1]
        for first, count in groups
        for i in range(first, first + count - 1)
    ]
    # Only gaps under a read's cost are read, and touching runs are one read.
    assert all(g < cost.read or g == 0 for g in added)
    assert all(
        ranges[first][0] > ranges[first - 1][0] + ranges[first - 1][1] for first, _ in groups[1:]
    )
    if not cost.spans:
        assert sum(added) <= 0.1 * sum(n for _, n in ranges)


def _column_file(tmp_path, rows=1024, cols=256):
    full = pattern((rows, cols), torch.float32, seed=7)
    path = tmp_path / "cols.safetensors"
    safetensors.torch.save_file({"w": full, "b": pattern((cols,), torch.float32, seed=8)}, path)
    return path, full


@pytest.mark.parametrize(
    ("cols", "most"),
    [
        # 64 of 256 columns: a gap of 768 bytes a row, under a request's cost: a span (the rows
        # it crosses, 4x the part's bytes) in a few requests, not a request per row.
        (slice(0, 64), 4.0),
        # 250 of 256: gaps of 24 bytes, within 10% of the part: one read of ~1.02x.
        (slice(3, 253), 1.1),
    ],
)
def test_a_column_slice_over_http_takes_a_handful_of_requests(range_server, tmp_path, cols, most):
    path, full = _column_file(tmp_path)
    range_server.put({"cols.safetensors": path})
    log = range_server.behaviour.log
    since = len(log)
    with fastload.stream(
        range_server.url("cols.safetensors"), parts={"w": (slice(None), cols)}
    ) as s:
        got = dict(s)
        stats = s.stats()
    served = _served(log, "/cols.safetensors", since)
    want = full[:, cols]
    _same(got["w"], want, "w")
    _same(got["b"], safetensors.torch.load_file(str(path))["b"], "b")
    # One read of the part (the whole bias joins it or is another), cut in blocks.
    assert stats["part_runs"] == 1024 and stats["part_reads"] == 1
    assert 1 <= len(served) <= 4, served
    part = want.numel() * 4
    assert part < stats["part_bytes"] <= most * part
    assert sum(n for _, n in served) == stats["bytes_read"] == stats["part_bytes"] + 256 * 4


def test_a_local_column_slice_reads_narrow_rows_as_a_span_and_wide_rows_exactly(tmp_path):
    """A local file: 64 of 256 float32 columns (gaps of 768 bytes, under a read's cost) are one
    read of the rows they cross; 2048 of 8192 (gaps of 24 KiB) a read per row, exactly the
    part; 250 of 256 one read of ~1.02x."""
    path, full = _column_file(tmp_path)
    wide = pattern((64, 8192), torch.float32, seed=9)
    safetensors.torch.save_file({"w": wide}, tmp_path / "wide.safetensors")
    cases = [
        (path, full, slice(0, 64), 1, 4.0),
        (path, full, slice(3, 253), 1, 1.1),
        (tmp_path / "wide.safetensors", wide, slice(0, 2048), 64, 1.0),
    ]
    for file, want, cols, reads, most in cases:
        with fastload.stream(file, parts={"w": (slice(None), cols)}, names=["w"]) as s:
            got = dict(s)
            stats = s.stats()
        _same(got["w"], want[:, cols], repr(cols))
        part = want[:, cols].numel() * 4
        assert stats["part_runs"] == want.shape[0] and stats["part_reads"] == reads
        assert part <= stats["bytes_read"] == stats["part_bytes"] <= most * part


def test_spans_are_cut_at_span_max(monkeypatch, tmp_path):
    """Runs merged across gaps make reads of at most SPAN_MAX bytes (memory stays bounded)."""
    path, full = _column_file(tmp_path)
    monkeypatch.setattr(fastload._parts, "SPAN_MAX", 100 * 1024)
    with fastload.stream(path, parts={"w": (slice(None), slice(0, 64))}, names=["w"]) as s:
        got = dict(s)
        stats = s.stats()
    _same(got["w"], full[:, 0:64], "w")
    # 1 KiB rows: 100 rows a read (the last 24 rows a read of their own).
    assert stats["part_reads"] == 11


def test_stats_tell_sliced_from_whole(tmp_path):
    w = pattern((8, 8192), torch.float32, seed=1)
    path = tmp_path / "s.safetensors"
    safetensors.torch.save_file({"w": w, "b": pattern((32,), torch.float32)}, str(path))
    # Columns 0:8 of a local file: runs of 32 bytes 32 KiB apart, more than a read costs: a
    # read per row.
    with fastload.stream(path, parts={"w": (slice(None), slice(0, 8))}) as s:
        dict(s)
        stats = s.stats()
    assert stats["part_tensors"] == 1 and stats["part_bytes"] == 8 * 8 * 4
    assert stats["part_runs"] == stats["part_reads"] == 8
    assert stats["part_tensor_bytes"] == 8 * 8192 * 4
    assert stats["whole_tensors"] == 1 and stats["whole_bytes"] == 32 * 4
    assert stats["bytes_read"] == 8 * 8 * 4 + 32 * 4
    with fastload.stream(path) as s:
        dict(s)
        stats = s.stats()
    assert (stats["part_tensors"], stats["whole_tensors"]) == (0, 2)
    assert stats["whole_bytes"] == stats["total_bytes"] == 8 * 8192 * 4 + 32 * 4


def test_parts_within_a_small_memory_limit(tmp_path):
    """Parts larger than the segments and blocks: read in many blocks, within the limit."""
    w = pattern((1024, 1024), torch.float32, seed=2)  # 4 MiB
    path = tmp_path / "big.safetensors"
    safetensors.torch.save_file({"w": w, "v": pattern((3000,), torch.int64)}, str(path))
    parts = {"w": (slice(100, 900), slice(512, None)), "v": slice(1000, 2000)}
    with fastload.stream(path, parts=parts, memory_limit="1MiB", block_size="64KiB") as s:
        got = dict(s)
        stats = s.stats()
    full = safetensors.torch.load_file(str(path))
    _same(got["w"], full["w"][100:900, 512:], "w")
    _same(got["v"], full["v"][1000:2000], "v")
    # w's runs (2 KiB, 2 KiB apart) read as one span: rows 100..899 from column 512 on.
    assert stats["part_reads"] == 2
    assert stats["bytes_read"] == (799 * 1024 + 512) * 4 + 1000 * 8


# -- every store, names, the cache -------------------------------------------------------------


@pytest.mark.parametrize("backend", ["s3", "http", "hub"])
def test_parts_from_every_store(request, monkeypatch, tmp_path, sharded_dir, backend):
    store = request.getfixturevalue(f"{backend}_store")
    stores.isolate(monkeypatch, tmp_path)
    if store.via_env:
        for k, v in store.env().items():
            monkeypatch.setenv(k, v)
    full = safetensors.torch.load_file(str(sharded_dir / "model-00002-of-00003.safetensors"))
    full.update(safetensors.torch.load_file(str(sharded_dir / "model-00001-of-00003.safetensors")))
    parts = {"layers.5.weight": (slice(None), slice(3, 20)), "embed.weight": (slice(10, 30), 2)}
    names = ["layers.5.weight", "embed.weight", "layers.4.weight"]
    got = fastload.load(
        store.uri("sharded/"), parts=parts, names=names, storage_options=store.load_options()
    )
    assert set(got) == set(names)
    for n in names:
        _same(got[n], full[n][parts[n]] if n in parts else full[n], n)


def test_parts_read_a_cached_copy(range_server, remote_file, tmp_path):
    range_server.put({"cached.safetensors": remote_file})
    url = range_server.url("cached.safetensors")
    cache = tmp_path / "cache"
    fastload.load(url, cache=cache)
    fastload.cache_stats()  # the copy published
    log = range_server.behaviour.log
    since = len(log)
    got = fastload.load(url, cache=cache, parts={"w": (slice(None), slice(8, 16))})
    assert not _served(log, "/cached.safetensors", since)
    w = safetensors.torch.load_file(str(remote_file))["w"]
    _same(got["w"], w[:, 8:16], "w")


# -- errors -------------------------------------------------------------------------------------


def test_bad_parts_are_refused_before_anything_is_read(range_server, remote_file):
    range_server.put({"bad.safetensors": remote_file})
    url = range_server.url("bad.safetensors")
    log = range_server.behaviour.log
    since = len(log)
    refused = {
        "more indices than dims": ({"w": (0, 1, 2)}, "indexes 3 dims, the tensor has 2"),
        "int out of range": ({"w": (64,)}, "index 64 in [64] is out of range for dim 0 of size 64"),
        "negative int out of range": ({"b": (0, -8)}, "out of range for dim 1 of size 7"),
        "negative step": ({"w": slice(None, None, -1)}, "steps must be >= 1"),
        "zero step": ({"w": slice(None, None, 0)}, "steps must be >= 1"),
        "a list": ({"w": [0, 1]}, "is not supported"),
        "a tensor": ({"w": torch.tensor([0])}, "is not supported"),
        "a bool": ({"w": True}, "is not supported"),
        "None": ({"w": (None, 0)}, "is not supported"),
        "two ellipses": ({"w": (..., 0, ...)}, "more than one ..."),
        "a float bound": ({"w": slice(0.5, 2)}, "is not supported"),
        "not a mapping": ([("w", 0)], "expected a mapping"),
        "a key not a str": ({0: 0}, "keys must be tensor names"),
    }
    for what, (parts, message) in refused.items():
        with pytest.raises(fastload.ConfigError, match=message.replace("[", r"\[")) as info:
            fastload.load(url, parts=parts)
        assert info.value.option == "parts", what
        if isinstance(parts, dict) and "w" in parts:
            assert "tensor 'w' of shape [64, 96]" in str(info.value), what
    with pytest.raises(fastload.TensorNotFoundError) as missing:
        fastload.load(url, parts={"nope": 0, "w": 0})
    assert missing.value.names == ["nope"] and "bad.safetensors" in str(missing.value)
    with pytest.raises(fastload.ConfigError, match="tensors not in names: 'w'") as info:
        fastload.load(url, parts={"w": 0}, names=["b"])
    assert info.value.option == "parts"
    assert not _served(log, "/bad.safetensors", since)


def test_parts_with_a_process_group_and_no_group_load_alone(remote_file):
    """``process_group`` with no group initialised: the process loads on its own (with the
    warning every such load gives), its parts included. Groups: tests/test_distributed.py."""
    with pytest.warns(RuntimeWarning, match="not initialised"):
        got = fastload.load(
            remote_file, parts={"w": (slice(None), slice(8, 40))}, process_group="default"
        )
    ref = safetensors.torch.load_file(str(remote_file))
    _same(got["w"], ref["w"][:, 8:40], "w")
    for name in ("b", "e", "m"):
        _same(got[name], ref[name], name)


def test_parts_is_a_typed_load_option():
    import inspect

    for fn in (fastload.load, fastload.stream, fastload.Stream):
        p = inspect.signature(fn).parameters["parts"]
        assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default is None
    assert "parts" in fastload.Options.__annotations__


def test_threads_sharing_a_stream_of_parts(tmp_path):
    """Threads take from one stream as from a queue: each part comes out once and whole, though
    its pieces (a run per row) land in different threads' hands."""
    from concurrent.futures import ThreadPoolExecutor

    tensors = {f"w{i}": pattern((96, 64), torch.float32, seed=i) for i in range(8)}
    path = tmp_path / "threads.safetensors"
    safetensors.torch.save_file(tensors, str(path))
    parts = {n: (slice(None), slice(16, 40)) for n in tensors}
    with fastload.stream(path, parts=parts, block_size="4KiB", memory_limit="1MiB") as s:

        def drain(_):
            return list(s)

        with ThreadPoolExecutor(4) as pool:
            got = [kv for chunk in pool.map(drain, range(4)) for kv in chunk]
    assert sorted(n for n, _ in got) == sorted(tensors)
    full = safetensors.torch.load_file(str(path))
    for n, t in got:
        _same(t, full[n][:, 16:40], n)
