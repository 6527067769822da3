"""fastload._lazy: lazy checkpoint tensors (the sliced reads of the serving-engine loaders).
Random chains of views (narrow, indexing, select, chunk, split, unsqueeze, squeeze, detach) on
a lazy tensor of every dtype come out bitwise equal to the same chain on the tensor safetensors
loads, and read exactly the bytes the planner picks for the region (of a local file, and over
HTTP, where the server's log is the count); any other op reads the region and runs on it."""

from __future__ import annotations

import itertools

import huge_indices
import pytest
import safetensors
import safetensors.torch
import torch
from fastload._exchange import ColumnExchange
from fastload._lazy import Checkpoint, LazyTensor, Stats
from fastload._safe_open import LOCAL_READ_COST, REMOTE_READ_COST, plan
from helpers import DTYPES, pattern, run_probe
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

# F4 packs two values a byte (torch's shape is not the file's): not sliced here.
LAZY_DTYPES = sorted(k for k in DTYPES if k != "F4")
_names = itertools.count()


def _bits(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1))
    return flat.view(torch.uint8) if t.numel() else flat.to(torch.uint8)


def assert_bitwise(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert type(got) is torch.Tensor, (what, type(got))
    assert (got.dtype, got.shape) == (want.dtype, want.shape), what
    assert torch.equal(_bits(got), _bits(want)), what


@st.composite
def view_op(draw, shape: tuple[int, ...]):
    """One view on a tensor of ``shape``, valid there: (name, args)."""
    ndim = len(shape)
    kinds = ["unsqueeze", "detach", "data"]
    if ndim:
        kinds += ["narrow", "getitem", "select", "chunk", "split", "squeeze", "unbind"]
    kind = draw(st.sampled_from(kinds))
    dim = draw(st.integers(-ndim, ndim - 1)) if ndim else 0
    n = shape[dim] if ndim else 0
    if kind == "narrow":
        start = draw(st.integers(0, n))
        return kind, (dim, start, draw(st.integers(0, n - start)))
    if kind in ("select", "unbind"):
        if n == 0:
            return "detach", ()
        return kind, (dim, draw(st.integers(-n, n - 1)))
    if kind == "chunk":
        if n == 0:
            return "detach", ()
        k = draw(st.integers(1, n))
        pieces = len(torch.empty(shape, device="meta").chunk(k, dim))
        return kind, (k, dim, draw(st.integers(0, pieces - 1)))
    if kind == "split":
        if n == 0:
            return "detach", ()
        if draw(st.booleans()):
            size = draw(st.integers(1, n))
            return kind, (size, dim, draw(st.integers(0, (n + size - 1) // size - 1)))
        cuts = sorted(draw(st.lists(st.integers(0, n), max_size=3)))
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        return kind, (sizes, dim, draw(st.integers(0, len(sizes) - 1)))
    if kind == "unsqueeze":
        return kind, (draw(st.integers(-ndim - 1, ndim)),)
    if kind == "squeeze":
        return kind, (dim,)
    if kind == "getitem":
        items: list = []
        for d in range(draw(st.integers(1, ndim))):
            m = shape[d]
            if m and draw(st.booleans()):
                items.append(draw(st.integers(-m, m - 1)))
            else:
                part = st.one_of(st.none(), st.integers(-m - 2, m + 2))
                items.append(slice(draw(part), draw(part), draw(st.sampled_from([None, 1, 2, 3]))))
        if draw(st.booleans()):
            items.append(Ellipsis)  # (ints drawn for the leading dims keep their meaning)
        if draw(st.integers(0, 3)) == 0:
            items.insert(draw(st.integers(0, len(items))), None)
        return kind, (tuple(items),)
    return kind, ()


def apply(t: torch.Tensor, op) -> torch.Tensor:
    kind, args = op
    if kind == "narrow":
        return t.narrow(*args)
    if kind == "getitem":
        return t[args[0]]
    if kind == "select":
        return t.select(*args)
    if kind == "unbind":
        return t.unbind(args[0])[args[1]]
    if kind == "chunk":
        return t.chunk(args[0], args[1])[args[2]]
    if kind == "split":
        return t.split(args[0], args[1])[args[2]]
    if kind == "unsqueeze":
        return t.unsqueeze(*args)
    if kind == "squeeze":
        return t.squeeze(*args)
    if kind == "data":
        return t.data
    return t.detach()


@st.composite
def chains(draw, shape: tuple[int, ...]):
    ops, current = [], torch.empty(shape, device="meta")
    for _ in range(draw(st.integers(0, 4))):
        op = draw(view_op(tuple(current.shape)))
        ops.append(op)
        current = apply(current, op)
    return ops


@st.composite
def specs(draw):
    dtype = draw(st.sampled_from(LAZY_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 7), max_size=4)))
    return dtype, shape


def _check_chain(uri, ref_path, dtype, shape, ops, cost, end) -> Checkpoint:
    """Opens ``uri`` lazily, applies ``ops`` then ``end`` (``copy`` into a tensor, or an op that
    is not a view); checks bits, and that a copy read exactly the planned bytes."""
    want_full = safetensors.safe_open(str(ref_path), "pt").get_tensor("t")
    ckpt = Checkpoint(uri)
    (name, lazy), *_ = list(ckpt)
    assert name == "t" and isinstance(lazy, LazyTensor)
    assert (lazy.shape, lazy.dtype, lazy.device.type) == (want_full.shape, DTYPES[dtype], "cpu")
    got, want = lazy, want_full
    for op in ops:
        got, want = apply(got, op), apply(want, op)
        assert isinstance(got, LazyTensor) and got.shape == want.shape, op
    assert ckpt.bytes_read == 0, "a view read something"
    what = f"{dtype}{shape} {ops} {end}"
    if end == "copy":
        out = torch.full(want.shape, 0, dtype=want.dtype) if want.dtype != torch.bool else None
        out = torch.zeros(want.shape, dtype=want.dtype) if out is None else out
        out.copy_(got)
        assert_bitwise(out, want, what)
        p = plan(tuple(lazy.shape), want.element_size(), got._index(), cost)
        planned = sum(n for _, n in p.ranges) if p else 0
        assert ckpt.bytes_read == planned, what
        whole = planned == want_full.numel() * want_full.element_size() and planned > 0
        assert ckpt.stats.whole_tensors == int(whole), (what, ckpt.stats)
        assert ckpt.stats.sliced_tensors == int(bool(planned) and not whole), (what, ckpt.stats)
    else:
        assert_bitwise(end(got), end(want), what)
    return ckpt


_ENDS = [
    "copy",
    "copy",
    lambda t: t.clone(),
    lambda t: torch.stack([t, t]),
    lambda t: t.mT if t.dim() >= 2 else t.t(),
]


@settings(
    max_examples=250,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), spec=specs())
def test_random_views_of_a_local_file_match_safetensors(tmp_path, data, spec):
    dtype, shape = spec
    path = tmp_path / f"{next(_names)}.safetensors"
    save_file({"t": pattern(shape, DTYPES[dtype], seed=5)}, str(path))
    ops = data.draw(chains(shape), label="ops")
    end = data.draw(st.sampled_from(_ENDS), label="end")
    _check_chain(path, path, dtype, shape, ops, LOCAL_READ_COST, end)


def _served(log, path, since):
    out = []
    for method, p, rng, _ in log[since:]:
        if method == "GET" and p == path:
            a, b = rng.removeprefix("bytes=").split("-")
            out.append((int(a), int(b) - int(a) + 1))
    return out


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data(), spec=specs())
def test_random_views_over_http_read_only_their_region(range_server, tmp_path, data, spec):
    dtype, shape = spec
    name = f"lazy-{next(_names)}.safetensors"
    path = tmp_path / name
    save_file({"t": pattern(shape, DTYPES[dtype], seed=7)}, str(path))
    range_server.put({name: path})
    ops = data.draw(chains(shape), label="ops")
    log = range_server.behaviour.log
    since = len(log)
    ckpt = _check_chain(range_server.url(name), path, dtype, shape, ops, REMOTE_READ_COST, "copy")
    # What the server sent for tensor data is what the reader counted (the header aside).
    served = _served(log, "/" + name, since)
    header = path.stat().st_size - pattern(shape, DTYPES[dtype]).numel() * DTYPES[dtype].itemsize
    data_gets = [(o, n) for o, n in served if o >= header]
    assert sum(n for _, n in data_gets) == ckpt.bytes_read, served


# huge_indices' fixture, bound here so that pytest finds it.
edge_files = huge_indices.edge_files


@settings(huge_indices.EDGE_SETTINGS, max_examples=300)
@given(data=st.data())
def test_indexing_at_the_edges_of_int64(edge_files, data):
    """A lazy tensor indexed with steps and bounds of 2**62 and past int64, negative ints,
    ``...`` and ``None``, of small tensors and of tensors of no element with dims of 2**62
    (which torch cannot make with contiguous strides): the region the index names, its shape
    by Python's range arithmetic, its values those of the whole tensor indexed; an int out of
    range is torch's IndexError."""
    shape = data.draw(st.sampled_from(list(edge_files)), label="shape")
    index = data.draw(huge_indices.huge_indices(shape), label="index")
    method = data.draw(st.sampled_from(["read", None]), label="method")
    path, what = edge_files[shape], f"{shape}[{index!r}]"
    lazy = dict(Checkpoint(path, method=method))["t"]
    assert tuple(lazy.shape) == shape
    try:
        right = huge_indices.expected_shape(shape, index)
    except IndexError:
        with pytest.raises(IndexError):
            lazy[index].clone()
        return
    got = lazy[index].clone()
    assert type(got) is torch.Tensor and tuple(got.shape) == right, what
    if got.numel():
        whole = safetensors.torch.load_file(str(path))["t"]
        assert_bitwise(got, whole[huge_indices.safe_index(shape, index)], what)


def test_untouched_tensors_are_never_read_and_stats_say_what_was(tmp_path):
    """A loader's view of a load: column slice, row slice, whole, never touched; the stats line
    (what the engines log) counts each."""
    tensors = {
        "col": pattern((16, 8), torch.bfloat16, seed=1),
        "row": pattern((16, 8), torch.bfloat16, seed=2),
        "norm": pattern((8,), torch.float32, seed=3),
        "other_stage": pattern((64, 8), torch.float32, seed=4),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path))
    stats = Stats()
    got = dict(Checkpoint(path, stats))
    a = torch.empty(4, 8, dtype=torch.bfloat16).copy_(got["col"].narrow(0, 4, 4))
    b = torch.empty(16, 2, dtype=torch.bfloat16).copy_(got["row"].narrow(1, 6, 2))
    c = torch.empty(8).copy_(got["norm"])
    assert_bitwise(a, tensors["col"][4:8], "col")
    assert_bitwise(b, tensors["row"][:, 6:8], "row")
    assert_bitwise(c, tensors["norm"], "norm")
    assert stats.tensors == 4 and stats.bytes == sum(t.nbytes for t in tensors.values())
    assert (stats.sliced_tensors, stats.whole_tensors, stats.skipped_tensors) == (2, 1, 1)
    columns = plan((16, 8), 2, (slice(None), slice(6, 8)), LOCAL_READ_COST)
    assert stats.sliced_bytes == 4 * 8 * 2 + sum(n for _, n in columns.ranges) < 2 * 16 * 8 * 2
    assert stats.whole_bytes == 32 and stats.fallbacks == {}
    line = stats.line()
    assert f"read {stats.read_bytes} of {stats.bytes} checkpoint bytes" in line
    assert "1 tensors not read" in line and "other ops" not in line
    # An op that is not a view reads (the region only) and says which op it was.
    doubled = got["other_stage"][:2] * 2
    assert_bitwise(doubled, tensors["other_stage"][:2] * 2, "doubled")
    assert stats.fallbacks == {"mul": 1} and "mul x1" in stats.line()


def test_a_tensor_read_whole_is_read_once(tmp_path):
    w = pattern((32, 4), torch.float16, seed=3)
    path = tmp_path / "w.safetensors"
    save_file({"w": w}, str(path))
    ckpt = Checkpoint(path)
    lazy = dict(ckpt)["w"]
    assert_bitwise(lazy.t(), w.t(), "t")  # a fallback: the whole tensor
    assert_bitwise(lazy.clone(), w, "clone")
    # Once read whole, its regions come from what was read.
    assert_bitwise(torch.empty(2, 4, dtype=torch.float16).copy_(lazy[3:5]), w[3:5], "rows")
    assert ckpt.bytes_read == w.nbytes and ckpt.stats.whole_tensors == 1


def test_in_place_ops_act_on_the_region_read(tmp_path):
    w = pattern((6, 4), torch.float32, seed=2)
    path = tmp_path / "w.safetensors"
    save_file({"w": w}, str(path))
    before = path.read_bytes()
    lazy = dict(Checkpoint(path))["w"][1:3]
    lazy.mul_(2)
    assert_bitwise(torch.empty(2, 4).copy_(lazy), w[1:3] * 2, "mul_")
    # A local file is mapped privately: the file itself is never written.
    assert path.read_bytes() == before


@pytest.mark.parametrize("method", ["auto", "read"])
def test_copies_into_device_memory_go_in_page_locked_chunks(tmp_path, monkeypatch, method):
    """A region copied into device memory goes through page-locked chunks (``_staged_copy``;
    its GPU run is in tests/test_gpu_features.py): here on the host, with the host counted as a
    device and small chunks, so every case takes several chunks. Rows, columns, a converted
    dtype, a strided destination and 1-D all land bitwise; shapes that broadcast and rows
    larger than a chunk are left to torch's copy."""
    import fastload._lazy as lazy_mod

    monkeypatch.setattr(lazy_mod, "STAGED_DEVICES", ("cpu",))
    monkeypatch.setattr(lazy_mod, "STAGE_CHUNK", 96)
    staged = []
    real = lazy_mod._staged_copy
    monkeypatch.setattr(
        lazy_mod, "_staged_copy", lambda d, s: staged.append(tuple(s.shape)) or real(d, s)
    )
    w = pattern((37, 10), torch.bfloat16, seed=5)
    v = pattern((301,), torch.float32, seed=6)
    wide = pattern((3, 64), torch.float32, seed=7)
    path = tmp_path / "w.safetensors"
    save_file({"w": w, "v": v, "wide": wide}, str(path))
    got = dict(Checkpoint(path, method=method))
    rows = torch.empty(20, 10, dtype=torch.bfloat16).copy_(got["w"].narrow(0, 11, 20))
    assert_bitwise(rows, w[11:31], "rows")
    cols = torch.empty(37, 5, dtype=torch.bfloat16).copy_(got["w"].narrow(1, 5, 5))
    assert_bitwise(cols, w[:, 5:], "columns")
    conv = torch.empty(37, 10, dtype=torch.float32).copy_(got["w"])
    assert_bitwise(conv, w.float(), "dtype converted")
    into = torch.zeros(37, 20, dtype=torch.bfloat16)
    into[:, ::2].copy_(got["w"])
    assert_bitwise(into[:, ::2], w, "strided destination")
    assert_bitwise(torch.empty(301).copy_(got["v"]), v, "1-D")
    assert staged == [(20, 10), (37, 5), (37, 10), (37, 10), (301,)]
    # Rows of 256 bytes (over the 96-byte chunk) and a broadcast: torch's copy, same values.
    assert_bitwise(torch.empty(3, 64).copy_(got["wide"]), wide, "wide rows")
    assert_bitwise(torch.empty(2, 301).copy_(dict(Checkpoint(path))["v"]), v.expand(2, 301), "bc")


def test_an_engine_load_gives_back_the_page_locked_chunks(monkeypatch):
    """After a load that staged copies into GPU memory, the engines' ``released`` empties
    torch's page-locked cache (chunks still in a copy stay: torch keeps those); without one it
    leaves torch's cache alone."""
    import logging

    import fastload._lazy as lazy_mod
    from fastload import _integration

    emptied = []
    monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: emptied.append(1), raising=False)
    monkeypatch.setattr(lazy_mod, "_staged_pinned", True)
    with _integration.released(logging.getLogger("test")):
        pass
    assert emptied == [1]
    with _integration.released(logging.getLogger("test")):
        pass
    assert emptied == [1]


def _mapped_files() -> list[tuple[int, int, str]]:
    """This process's file mappings: (start, end, path)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].startswith("/"):
                a, b = (int(x, 16) for x in parts[0].split("-"))
                out.append((a, b, parts[5].strip()))
    return out


def test_local_regions_are_views_of_the_mapped_file(tmp_path):
    """A local file's regions are not copied out: rows are a view of a mapping of the file
    (the weight loader's copy_ is the only copy), columns a strided view of their span's
    mapping, counted as the span's bytes; values bitwise."""
    w = pattern((512, 256), torch.bfloat16, seed=7)
    path = tmp_path / "m.safetensors"
    save_file({"w": w, "v": pattern((512, 256), torch.bfloat16, seed=8)}, str(path))
    stats = Stats()
    got = dict(Checkpoint(path, stats))
    rows = got["w"][100:300].materialize()
    cols = got["v"][:, 64:128].materialize()
    assert_bitwise(rows, w[100:300], "rows")
    assert_bitwise(cols, dict(safetensors.torch.load_file(path))["v"][:, 64:128], "cols")
    maps = _mapped_files()
    for t in (rows, cols):
        assert any(a <= t.data_ptr() < b and p == str(path) for a, b, p in maps), t.data_ptr()
    assert not cols.is_contiguous()
    span = (511 * 256 + 64) * 2
    assert stats.sliced_bytes == 200 * 256 * 2 + span, stats


def test_reads_started_later_give_what_read_gives(range_server, tmp_path):
    """``Reader.read_later``: reads started at once (read-ahead's), each waited for once: the
    bytes ``read`` gives, counted as read; a range outside the file refused when started, a
    read the server fails raised by ``wait``, a second wait refused."""
    from fastload import _fastload
    from fastload._errors import ConfigError, FastloadError

    path = tmp_path / "later.safetensors"
    save_file({"w": pattern((256, 64), torch.float32, seed=4)}, str(path))
    body = path.read_bytes()
    range_server.put({"later.safetensors": path})
    reader = _fastload.Reader([range_server.url("later.safetensors")])
    before = reader.bytes_read
    ranges = [[(100, 4000)], [(8, 16), (5000, 3000), (60000, 1)], [(len(body) - 10, 10)]]
    pending = [reader.read_later(0, r) for r in ranges]
    for r, p in reversed(list(zip(ranges, pending))):  # waited in any order
        want = b"".join(body[o : o + n] for o, n in r)
        assert bytes(torch.from_dlpack(p.wait()).numpy()) == want
        with pytest.raises(FastloadError, match="twice"):
            p.wait()
    assert reader.bytes_read - before == sum(n for r in ranges for _, n in r)
    with pytest.raises(ConfigError, match="outside the file"):
        reader.read_later(0, [(len(body) - 4, 8)])
    range_server.behaviour.fail_first = 100
    range_server.behaviour.fail_status = 404
    try:
        failing = reader.read_later(0, [(0, 8)])
        with pytest.raises(FastloadError):
            failing.wait()
    finally:
        range_server.behaviour.fail_first = 0
        range_server.behaviour.fail_status = 503


def test_a_mapping_outside_the_file_is_refused(tmp_path):
    """``Reader.map`` checks the range against the file before mapping it (pages past a file's
    end would fault): an error naming the file, nothing mapped."""
    from fastload import _fastload
    from fastload._errors import ConfigError

    path = tmp_path / "m.safetensors"
    save_file({"w": pattern((4, 4), torch.float32, seed=1)}, str(path))
    reader = _fastload.Reader([str(path)])
    size = path.stat().st_size
    assert torch.from_dlpack(reader.map(0, size - 8, 8)).numel() == 8
    for offset, n in ((size - 4, 8), (size + 1, 0), (2**64 - 1, 2)):
        with pytest.raises(ConfigError, match=r"m\.safetensors"):
            reader.map(0, offset, n)
    with pytest.raises(ConfigError, match="no file 1"):
        reader.map(1, 0, 1)


def test_a_local_file_cut_short_while_mapped_raises_and_the_process_lives(tmp_path):
    """The file truncated after the checkpoint opened it: reading a region, past the new end or
    before it, is an error naming the file (the mapping's pages are faulted in and the file
    checked before use), never a bus error."""
    w = pattern((1024, 256), torch.float32, seed=9)
    path = tmp_path / "cut.safetensors"
    save_file({"a": w, "b": w + 1}, str(path))
    out = run_probe(
        """
        import os, sys, torch
        from fastload._lazy import Checkpoint
        path = sys.argv[1]
        got = dict(Checkpoint(path))
        os.truncate(path, os.path.getsize(path) // 2)
        errors = []
        for name, rows in (("b", slice(-4, None)), ("a", slice(0, 4))):
            try:
                torch.empty(4, 256).copy_(got[name][rows])
                errors.append(None)
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")
        emit(errors=errors)
        """,
        path,
    )
    for error in out["errors"]:
        assert error is not None, out
        assert "cut.safetensors" in error and "truncated" in error, out


def test_views_torch_refuses_raise_torchs_errors(tmp_path):
    w = pattern((6, 4), torch.float32, seed=2)
    path = tmp_path / "w.safetensors"
    save_file({"w": w}, str(path))
    lazy = dict(Checkpoint(path))["w"]
    for fn in (
        lambda t: t.narrow(0, 5, 3),
        lambda t: t.select(1, 4),
        lambda t: t[7],
        lambda t: t.split([2, 2], 0),
    ):
        with pytest.raises((IndexError, RuntimeError)) as want:
            fn(w)
        with pytest.raises(type(want.value)) as got:
            fn(lazy)
        assert str(got.value) == str(want.value)


def test_a_checkpoint_folder_with_an_index_yields_every_tensor_in_file_order(tmp_path):
    from hf_models import write_llama

    folder = write_llama(tmp_path / "llama", max_shard_size="20KB")
    ref = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safetensors.safe_open(str(f), "pt") as s:
            ref.update({k: s.get_tensor(k) for k in s.offset_keys()})
    got = list(Checkpoint(folder))
    assert sorted(n for n, _ in got) == sorted(ref)
    for name, lazy in got:
        assert_bitwise(torch.empty_like(ref[name]).copy_(lazy), ref[name], name)


def test_a_hub_repo_streams_lazily_reading_only_what_is_copied(tmp_path, monkeypatch):
    """``hf://ORG/REPO``, as the vLLM loader passes a repo id: every tensor of every shard, and
    a row slice of one reads those rows' bytes only."""
    from hf_models import use_hub, write_llama
    from servers.hub import MockHub

    folder = write_llama(tmp_path / "llama", max_shard_size="20KB")
    hub = MockHub()
    try:
        hub.add("org/llama", {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
        use_hub(hub, monkeypatch, tmp_path)
        ckpt = Checkpoint("hf://org/llama")
        got = dict(ckpt)
        ref = {}
        for f in sorted(folder.glob("*.safetensors")):
            with safetensors.safe_open(str(f), "pt") as s:
                ref.update({k: s.get_tensor(k) for k in s.keys()})
        assert sorted(got) == sorted(ref) and ckpt.bytes_read == 0
        name = "model.layers.0.mlp.down_proj.weight"
        rows = torch.empty(16, 64, dtype=torch.bfloat16).copy_(got[name][16:])
        assert_bitwise(rows, ref[name][16:], name)
        assert ckpt.bytes_read == ref[name][16:].nbytes
    finally:
        hub.close()


def test_every_other_use_reads_and_gives_the_values(tmp_path):
    """Scalars, lists, numpy, comparisons, dtype views, iteration: what a weight loader may do
    besides narrowing, each on the values read."""
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    path = tmp_path / "w.safetensors"
    save_file({"s": torch.tensor(3.5), "w": w}, str(path))
    got = dict(Checkpoint(path))
    s, lazy = got["s"], got["w"]
    assert s.item() == 3.5 and float(s) == 3.5 and bool(s)
    assert lazy.tolist() == w.tolist() and lazy[1:].tolist() == w[1:].tolist()
    assert (lazy[:, 2:].numpy() == w[:, 2:].numpy()).all()
    assert torch.equal(lazy, w) and int((lazy == 5).sum()) == 1
    assert torch.equal(lazy.view(torch.int32), w.view(torch.int32))
    assert [r.tolist() for r in lazy] == w.tolist()
    assert torch.equal(s.reshape(1), torch.tensor([3.5]))
    # Already on the CPU and contiguous: still lazy, nothing read.
    fresh = dict(Checkpoint(path))["w"]
    assert all(isinstance(t, LazyTensor) for t in (fresh.cpu(), fresh.contiguous()))


def _layers_file(tmp_path, layers: int):
    """A llama-like file: per layer a row-sliced, a column-sliced and a whole tensor, all bf16
    (safetensors orders a file by alignment, then name: layer by layer here)."""
    tensors = {}
    for i in range(layers):
        tensors[f"model.layers.{i}.mlp.down.weight"] = pattern((64, 96), torch.bfloat16, seed=i)
        tensors[f"model.layers.{i}.norm.weight"] = pattern((96,), torch.bfloat16, seed=50 + i)
        tensors[f"model.layers.{i}.q.weight"] = pattern((96, 64), torch.bfloat16, seed=90 + i)
    path = tmp_path / "layers.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def _stage(ckpt, tensors, last_layer: int) -> dict[str, int]:
    """A pipeline stage's weight loaders: layers up to ``last_layer`` narrowed and copied, each
    as it is handed out, the rest passed by; checks the bits. The bytes each region needs."""
    need = {}
    for name, lazy in ckpt:
        if int(name.split(".")[2]) > last_layer:
            continue
        if name.endswith("down.weight"):
            region = lazy.narrow(1, 48, 48)  # columns: a run per row, or one span remote
            want = tensors[name][:, 48:]
        elif name.endswith("q.weight"):
            region, want = lazy.narrow(0, 0, 48), tensors[name][:48]
        else:
            region, want = lazy, tensors[name]
        got = torch.empty(want.shape, dtype=want.dtype).copy_(region)
        assert_bitwise(got, want, name)
        p = plan(tuple(lazy.shape), want.element_size(), region._index(), REMOTE_READ_COST)
        need[name] = sum(n for _, n in p.ranges)
    return need


def test_read_ahead_reads_the_next_layers_regions_before_they_are_asked_for(range_server, tmp_path):
    """Over the network a layer's regions are read ahead (as the layer before's were read) once
    the consumer reads some of them, the next layer's first tensor once it reads some of the
    layer before, small 1-D tensors (norms) whole once it reads anything: only layer 0's other
    tensors are read when asked. A stage that stops at layer 3 of 6 reads of the layers after it
    only layer 4's first tensor and the norms in the window (counted as unused); every byte the
    server sent is counted."""
    path, tensors = _layers_file(tmp_path, 6)
    norm = "model.layers.0.norm.weight"
    range_server.put({"layers.safetensors": path})
    url = range_server.url("layers.safetensors")
    log = range_server.behaviour.log
    for read_ahead in (False, True):
        since = len(log)
        stats = Stats()
        ckpt = Checkpoint(url, stats, read_ahead=read_ahead)
        need = _stage(ckpt, tensors, last_layer=3)
        assert stats.sliced_bytes + stats.whole_bytes == sum(need.values())
        header = path.stat().st_size - sum(t.nbytes for t in tensors.values())
        served = [(o, n) for o, n in _served(log, "/layers.safetensors", since) if o >= header]
        assert sum(n for _, n in served) == ckpt.bytes_read == stats.read_bytes
        assert stats.read_bytes == sum(need.values()) + stats.ahead_unused_bytes
        # Past the stage: layer 4's down columns, and layers 4 and 5's norms, at most.
        waste = need["model.layers.3.mlp.down.weight"] + 2 * tensors[norm].nbytes
        assert stats.ahead_unused_bytes <= (waste if read_ahead else 0)
        # Every region but layer 0's down and q (no layer before them to go by) read ahead.
        first = need["model.layers.0.mlp.down.weight"] + need["model.layers.0.q.weight"]
        assert stats.ahead_bytes == (sum(need.values()) - first if read_ahead else 0)
        assert stats.waited_reads == (2 if read_ahead else len(need))


@pytest.mark.parametrize("method", ["auto", "read"])
def test_local_files_read_not_mapped_are_read_ahead_by_default(tmp_path, method):
    """A local file that is read (``method="read"``; encrypted files alike) waits on a read per
    region as a remote one does, and is read ahead by default; a mapped one is not (its regions
    are views of the page cache, nothing to wait for)."""
    path, tensors = _layers_file(tmp_path, 4)
    stats = Stats()
    need = _stage(Checkpoint(path, stats, method=method), tensors, last_layer=3)
    assert stats.sliced_bytes + stats.whole_bytes >= sum(need.values())
    if method == "read":
        assert stats.ahead_bytes > 0 and stats.waited_reads < len(need)
    else:
        assert stats.ahead_bytes == 0 and stats.waited_reads == len(need)


def test_a_region_other_than_the_one_read_ahead_is_read_as_asked(range_server, tmp_path):
    """The consumer asks layers 1 and 2 for other rows than layer 0's: what was read ahead for
    layer 1 is left unused and the rows asked for are read, layer 2's are read ahead as layer
    1's; names passed by unread are not read ahead."""
    path, tensors = _layers_file(tmp_path, 3)
    range_server.put({"layers2.safetensors": path})
    stats = Stats()
    for name, lazy in Checkpoint(range_server.url("layers2.safetensors"), stats, read_ahead=True):
        layer = int(name.split(".")[2])
        if name.endswith("norm.weight"):  # the layer's first read: the rest is read ahead
            assert_bitwise(torch.empty(96, dtype=torch.bfloat16).copy_(lazy), tensors[name], name)
        if name.endswith("q.weight"):
            rows = slice(0, 48) if layer == 0 else slice(48, 96)
            got = torch.empty(48, 64, dtype=torch.bfloat16).copy_(lazy[rows])
            assert_bitwise(got, tensors[name][rows], name)
    # Layer 1's rows 0:48 (read ahead, unused) and layer 2's (read ahead as 48:96, used); the
    # norms, each its layer's first read, and the down projections, never read, are not.
    assert stats.ahead_bytes == 48 * 64 * 2
    assert stats.ahead_unused_bytes <= 48 * 64 * 2
    assert stats.sliced_tensors == 3 and stats.whole_tensors == 3
    assert stats.read_bytes == 3 * (48 * 64 + 96) * 2 + stats.ahead_unused_bytes


class _GuessOnly(ColumnExchange):
    """A tensor-parallel rank's exchange that never exchanges (no group): what the read-ahead
    guesses from it (this rank's rows) is all that is tested."""

    def wants(self, source, index):
        return False


def test_reads_ahead_in_vain_are_counted_and_freed_as_they_pile_up(
    range_server, tmp_path, monkeypatch
):
    """A consumer that asks each layer for other rows than the layer before: predictions made
    from the layer before are read in vain. With a small limit such reads are waited for and
    counted as they pile up (their buffers freed), not held to the end; the values are right
    and what the server sent is what the stats count."""
    from fastload import _readahead

    window, _, all_layers = _readahead.ReadAhead.__init__.__defaults__
    monkeypatch.setattr(_readahead.ReadAhead.__init__, "__defaults__", (window, 16384, all_layers))
    counted = []  # the reads in vain counted at each count: before close, and at close
    count = _readahead.ReadAhead._count_unused

    def counting(self):
        counted.append(len(self.unused))
        count(self)

    monkeypatch.setattr(_readahead.ReadAhead, "_count_unused", counting)
    path, tensors = _layers_file(tmp_path, 6)
    range_server.put({"vain.safetensors": path})
    log = range_server.behaviour.log
    since = len(log)
    stats = Stats()
    ckpt = Checkpoint(range_server.url("vain.safetensors"), stats, all_layers=True)
    for name, lazy in ckpt:
        if name.endswith("q.weight"):
            layer = int(name.split(".")[2])
            rows = slice(0, 48) if layer % 2 else slice(48, 96)
            got = torch.empty(48, 64, dtype=torch.bfloat16).copy_(lazy[rows])
            assert_bitwise(got, tensors[name][rows], name)
    assert stats.ahead_unused_bytes >= 48 * 64 * 2 and stats.ahead_bytes > 0, stats
    # Counted (and freed) during the load, not all at its end.
    assert len(counted) >= 2 and counted[0] > 0, counted
    header = path.stat().st_size - sum(t.nbytes for t in tensors.values())
    served = [(o, n) for o, n in _served(log, "/vain.safetensors", since) if o >= header]
    assert sum(n for _, n in served) == ckpt.bytes_read == stats.read_bytes


def test_first_layer_is_read_ahead_as_the_ranks_rows(range_server, tmp_path):
    """Under a tensor-parallel group, tensors no region of which is known yet (layer 0's, the
    embeddings) are read ahead as this rank's block of rows: with ``all_layers`` before the
    consumer asks for anything, so a consumer that narrows each to its rows waits for none of
    them but the first; a region outside the guess (a whole 2-D tensor) is read as asked, the
    guess unused."""
    tensors = {"model.embed.weight": pattern((40, 16), torch.bfloat16, seed=1)}
    for i in range(3):
        tensors[f"model.layers.{i}.q.weight"] = pattern((32, 16), torch.bfloat16, seed=10 + i)
        tensors[f"model.layers.{i}.kv.weight"] = pattern((8, 16), torch.bfloat16, seed=20 + i)
    save_file(tensors, str(tmp_path / "g.safetensors"))
    range_server.put({"g.safetensors": tmp_path / "g.safetensors"})
    for rank in (0, 1):
        stats = Stats()
        exchange = _GuessOnly(None, rank, 2)
        ckpt = Checkpoint(range_server.url("g.safetensors"), stats, exchange, all_layers=True)
        for name, lazy in ckpt:
            n = lazy.shape[0]
            # kv: replicated (read whole); the rest: this rank's half of the rows.
            rows = slice(0, n) if ".kv." in name else slice(rank * n // 2, (rank + 1) * n // 2)
            got = torch.empty(tensors[name][rows].shape, dtype=torch.bfloat16).copy_(lazy[rows])
            assert_bitwise(got, tensors[name][rows], name)
        # Only the embeddings (the first tensor: read as it is handed out, while the rest is
        # read ahead) and layer 0's kv (its guess: half its rows, unused) waited.
        assert stats.waited_reads == 2, stats
        assert stats.ahead_unused_bytes == 4 * 16 * 2, stats
        need = sum(t.nbytes for n, t in tensors.items() if ".kv." in n)
        need += sum(t.nbytes // 2 for n, t in tensors.items() if ".kv." not in n)
        assert stats.read_bytes == need + stats.ahead_unused_bytes, stats


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=st.data())
def test_read_ahead_any_regions_any_skips_match_safetensors(range_server, tmp_path, data):
    """Layers of one tensor each read with a drawn region (often the one before's, sometimes
    another, sometimes this rank's rows, sometimes not at all), with and without a
    tensor-parallel rank to guess from: every region read with read-ahead on is bitwise the
    tensor's, and what the server sent for the tensors is what the stats count."""
    layers = data.draw(st.integers(2, 6), label="layers")
    tensors = {
        f"model.layers.{i}.w": pattern((12, 10), torch.bfloat16, seed=i) for i in range(layers)
    }
    name = f"ahead-{next(_names)}.safetensors"
    save_file(tensors, str(tmp_path / name))
    range_server.put({name: tmp_path / name})
    log = range_server.behaviour.log
    since = len(log)
    stats = Stats()
    rank_world = data.draw(st.sampled_from([None, (0, 2), (1, 2), (2, 3), (3, 5)]), label="rank")
    exchange = _GuessOnly(None, *rank_world) if rank_world else None
    all_layers = data.draw(st.booleans(), label="all_layers")
    ckpt = Checkpoint(
        range_server.url(name), stats, exchange, read_ahead=True, all_layers=all_layers
    )
    index = (slice(2, 9), slice(3, 7))
    for tname, lazy in ckpt:
        what = data.draw(st.sampled_from(["same", "same", "other", "mine", "skip"]), label=tname)
        if what == "skip":
            continue
        if what == "other":
            a = data.draw(st.integers(0, 11), label="a")
            index = (slice(a, 12), slice(0, data.draw(st.integers(1, 10), label="b")))
        if what == "mine":
            r, w = rank_world or (0, 2)
            cols = data.draw(st.integers(1, 10), label="c")
            index = (slice(12 * r // w, max(12 * (r + 1) // w, 12 * r // w + 1)), slice(0, cols))
        got = torch.empty(tensors[tname][index].shape, dtype=torch.bfloat16).copy_(lazy[index])
        assert_bitwise(got, tensors[tname][index], f"{tname}{index}")
    header = (tmp_path / name).stat().st_size - sum(t.nbytes for t in tensors.values())
    served = [(o, n) for o, n in _served(log, "/" + name, since) if o >= header]
    assert sum(n for _, n in served) == ckpt.bytes_read == stats.read_bytes
