"""Row-parallel weights read once over a tensor-parallel group (fastload._exchange): real CPU
processes on a gloo group (env:// rendezvous on 127.0.0.1), each a rank that narrows every
tensor of a checkpoint to its column block and copies it out, as vLLM's ``RowParallelLinear``
weight loader does.

Generated cases (shapes, dtypes, group sizes 2 to 4, rows fewer than ranks or not divisible by
them) check each rank's block bit for bit against ``safetensors.torch.load_file(...)``'s tensor
``.narrow(1, ...)``; the tensors the group exchanges are read once between the ranks (each its
block of rows); those it must not exchange (one row, columns not divisible by the group, 3-D,
rows wide enough to read exactly) are read by each rank alone. A rank that skips a tensor the
others exchange, or whose read fails, turns the exchange off on every rank without a hang or a
wrong value. Over HTTP, the server sends the checkpoint's tensor bytes once over the group.

Run as a script (``python test_exchange.py WORKER JOB OUT_DIR``), this file is one rank's worker.
"""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import torch

WORKER = "--fastload-exchange-worker"
GROUP_DEADLINE = 120.0

DTYPES = [
    "bfloat16",
    "float16",
    "float32",
    "float64",
    "int8",
    "uint8",
    "int32",
    "int64",
    "bool",
    "float8_e4m3fn",
]


# ---------------------------------------------------------------------------------------------
# The worker (one rank)


class _FailingReader:
    """Stands in for one tensor's native reader: storage fails."""

    def __init__(self, name: str) -> None:
        self.name = name

    def read(self, shard, ranges):
        raise OSError(f"injected failure reading {self.name}")

    def map(self, shard, offset, len):
        raise OSError(f"injected failure mapping {self.name}")


def _scenario(sc: dict, group, rank: int) -> dict:
    from fastload._exchange import ColumnExchange
    from fastload._lazy import Checkpoint
    from safetensors.torch import load_file

    world = sc["world"]
    want = load_file(sc["reference"])
    share = sc.get("share", False)
    exchange = ColumnExchange(group, rank, world, share=share) if sc["exchange"] else None
    checkpoint = Checkpoint(sc["uri"], exchange=exchange, method=sc.get("method"))
    out: dict = {"id": sc["id"], "equal": {}, "errors": {}}
    try:
        for name, lazy in checkpoint:
            if sc.get("skip") == [rank, name]:
                continue
            if sc.get("fail") == [rank, name]:
                lazy._source.reader = _FailingReader(name)
            if share and (lazy.dim() != 2 or name.startswith("whole")):
                region = lazy  # read whole by every rank: the group shares it
            else:
                width = lazy.shape[1] // world
                region = lazy.narrow(1, rank * width, width)
            got = torch.empty(region.shape, dtype=lazy.dtype)
            try:
                got.copy_(region)
            except OSError as e:
                out["errors"][name] = str(e)
                continue
            ref = want[name] if region is lazy else want[name].narrow(1, rank * width, width)
            ref = ref.contiguous().reshape(-1)  # 1-D: a scalar's bytes can be viewed too
            out["equal"][name] = got.shape == region.shape and torch.equal(
                got.reshape(-1).view(torch.uint8), ref.view(torch.uint8)
            )
        out["enabled"] = exchange.enabled if exchange else False
    finally:
        if exchange is not None:
            exchange.close()
    out["stats"] = checkpoint.stats.as_dict()
    out["bytes_read"] = checkpoint.bytes_read
    out["received"] = exchange.received_bytes if exchange else 0
    return out


def _own_files(sc: dict, group, rank: int) -> dict:
    """Each rank reads its own checkpoint (``uris[rank]``, opened from ``cwd[rank]`` where
    given): ``names`` in order, a 2-D one narrowed to the rank's column block (as a row-parallel
    weight loader does), anything else whole; each compared bitwise with ``references[rank]``.
    ``overwrite`` (a versioned S3 object): rank 0 opens it, then it is overwritten, then the
    others open it (each pinned to the version it saw)."""
    import torch.distributed as dist
    from fastload._exchange import ColumnExchange
    from fastload._lazy import Checkpoint
    from safetensors.torch import load_file

    world, here = sc["world"], os.getcwd()
    exchange = ColumnExchange(group, rank, world)
    out: dict = {"id": sc["id"], "equal": {}, "how": {}}
    try:
        if sc.get("cwd"):
            os.chdir(sc["cwd"][rank])  # the same relative URI names another file on each rank
        opts = {"method": "read", "storage_options": sc.get("storage_options")}
        checkpoint = Checkpoint(sc["uris"][rank], exchange=exchange, **opts) if rank == 0 else None
        if "overwrite" in sc:
            from servers.s3 import client, upload

            dist.barrier(group=group)
            if rank == 0:
                o = sc["overwrite"]
                upload(client(o["endpoint"]), o["bucket"], {o["key"]: Path(o["with"])})
            dist.barrier(group=group)
        if checkpoint is None:
            checkpoint = Checkpoint(sc["uris"][rank], exchange=exchange, **opts)
        lazies = dict(checkpoint)
        want = load_file(sc["references"][rank])
        for name in sc["names"]:
            lazy = lazies[name]
            width = lazy.shape[-1] // world
            region = lazy.narrow(1, rank * width, width) if lazy.dim() == 2 else lazy
            got = torch.empty(region.shape, dtype=lazy.dtype)
            got.copy_(region)
            ref = want[name] if region is lazy else want[name].narrow(1, rank * width, width)
            out["equal"][name] = got.dtype == ref.dtype and torch.equal(
                got.reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8)
            )
            out["how"][name] = lazy._source.counted
        out["enabled"] = exchange.enabled
    finally:
        exchange.close()
        os.chdir(here)
    out["stats"] = checkpoint.stats.as_dict()
    return out


def _transformers_files(sc: dict, group, rank: int) -> dict:
    """``_own_files`` through transformers' tensor-parallel path (``fastload.transformers``:
    its ``_File`` slices indexed for the rank's columns, exchanged through ``_Exchange`` over
    the default group)."""
    from fastload._regions import ReadStats
    from fastload.transformers import _Exchange, _File
    from safetensors.torch import load_file

    world = sc["world"]
    exchange, counts = _Exchange(None), ReadStats()
    file = _File(sc["uris"][rank], {}, counts, 0, exchange)
    out: dict = {"id": sc["id"], "equal": {}}
    try:
        slices = file.slices()
        want = load_file(sc["references"][rank])
        for name in sc["names"]:
            width = slices[name].get_shape()[1] // world
            got = slices[name][:, rank * width : (rank + 1) * width]
            ref = want[name][:, rank * width : (rank + 1) * width]
            out["equal"][name] = got.dtype == ref.dtype and torch.equal(
                got.reshape(-1).view(torch.uint8), ref.contiguous().reshape(-1).view(torch.uint8)
            )
    finally:
        exchange.close()
        file.close()
    out["counts"] = counts.part_counts()
    return out


_KINDS = {"load": _scenario, "own": _own_files, "transformers": _transformers_files}


def _worker(job: str, out: str) -> None:
    """One process of a group of 4; a scenario of ``world`` ranks runs on the first ``world``.
    Writes its results to ``out/rank{RANK}.json``."""
    from datetime import timedelta

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank = dist.get_rank()
    groups = {n: dist.new_group(list(range(n))) for n in range(2, dist.get_world_size())}
    groups[dist.get_world_size()] = None  # the default group
    results = [
        _KINDS[sc.get("kind", "load")](sc, groups[sc["world"]], rank)
        for sc in json.loads(Path(job).read_text())
        if rank < sc["world"]
    ]
    (Path(out) / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# Launching a group


def run_group(world: int, scenarios: list[dict], tmp: Path) -> dict:
    """Runs ``scenarios`` on ``world`` fresh processes; {scenario id: [result per rank]}."""
    from helpers import run_ranks

    job = tmp / "job.json"
    job.write_text(json.dumps(scenarios))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FASTLOAD_", "TORCH"))}
    env["OMP_NUM_THREADS"] = "1"
    argv = [sys.executable, __file__, WORKER, str(job), str(tmp)]
    run_ranks(world, argv, tmp, env, GROUP_DEADLINE, cwd=Path(__file__).parent)
    by_id: dict = {}
    for r in range(world):
        for res in json.loads((tmp / f"rank{r}.json").read_text()):
            by_id.setdefault(res["id"], []).append(res)
    return by_id


# ---------------------------------------------------------------------------------------------
# Checkpoints


def _tensor(shape: tuple[int, ...], dtype: str, rng: random.Random) -> torch.Tensor:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    raw = torch.randint(0, 256, (*shape, getattr(torch, dtype).itemsize), generator=g)
    t = raw.to(torch.uint8).view(getattr(torch, dtype)).reshape(shape)
    return (t != 0) if dtype == "bool" else t


def cases(world: int, seed: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Tensors for a group of ``world``, and the names the group must exchange: random 2-D ones
    (short rows, so each rank's block is a short run per row that a planner reads as the rows'
    span) plus those it must read each rank alone."""
    rng = random.Random(seed)
    tensors: dict[str, torch.Tensor] = {}
    exchanged: set[str] = set()
    for i in range(14):
        rows = rng.choice([rng.randint(2, 40), rng.randint(2, world + 1)])
        cols = world * rng.randint(1, 9)
        dtype = rng.choice(DTYPES)
        name = f"layers.{i}.o_proj.weight"
        tensors[name] = _tensor((rows, cols), dtype, rng)
        exchanged.add(name)
    # One row: the block is one run, read exactly by each rank.
    tensors["one_row"] = _tensor((1, world * 5), "bfloat16", rng)
    # Columns not divisible by the group.
    tensors["uneven_cols"] = _tensor((6, world * 3 + 1), "float32", rng)
    # Three dims: not a row-parallel matrix.
    tensors["three_d"] = _tensor((3, world * 2, 4), "float16", rng)
    # Rows of 24,000 bytes a rank: one read per row costs less than the span (local files).
    tensors["wide"] = _tensor((3, world * 6000), "float32", rng)
    return tensors, exchanged


def _shared_tensors(seed: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Layers of a norm (1-D), a replicated 2-D weight (``whole...``, read whole by every rank),
    a row-parallel weight (exchanged) and a scalar, for ``share``; bytes past the first 256 KiB
    each rank fetches with the header."""
    rng = random.Random(seed)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(4):
        tensors[f"layers.{i}.norm.weight"] = _tensor((256,), "bfloat16", rng)
        tensors[f"whole.{i}.kv.weight"] = _tensor((96, 512), "bfloat16", rng)
        tensors[f"layers.{i}.o_proj.weight"] = _tensor((96, 12), "float32", rng)
        tensors[f"layers.{i}.scale"] = _tensor((), "float32", rng)
    return tensors, {n for n in tensors if n.endswith("o_proj.weight")}


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return path


def _check(results: list[dict], tensors: dict, exchanged: set[str], world: int) -> None:
    assert len(results) == world
    for r, res in enumerate(results):
        assert res["errors"] == {}, (r, res["errors"])
        assert res["equal"] == dict.fromkeys(tensors, True), (r, res["equal"])
        assert res["enabled"], r
        assert res["stats"]["exchanged_tensors"] == len(exchanged), (r, res["stats"])
    nbytes = {name: t.numel() * t.element_size() for name, t in tensors.items()}
    # The exchanged tensors' bytes, read once over the group: each rank its block of rows.
    total = sum(res["stats"]["exchanged_bytes"] for res in results)
    assert total == sum(nbytes[n] for n in exchanged)
    # ... and each rank got the others' rows of its columns only.
    received = sum(res["received"] for res in results)
    assert received == sum(nbytes[n] * (world - 1) // world for n in exchanged)


def _http_tensors(seed: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Row-parallel tensors only, with two larger than the first 256 KiB each rank fetches with
    the header (the server's count leaves that read out)."""
    tensors, exchanged = cases(2, seed)
    tensors = {n: t for n, t in tensors.items() if n in exchanged}
    rng = random.Random(seed)
    for i, (shape, dtype) in enumerate([((512, 1024), "bfloat16"), ((301, 1400), "float32")]):
        name = f"big.{i}.down_proj.weight"
        tensors[name] = _tensor(shape, dtype, rng)
        exchanged.add(name)
    return tensors, exchanged


def _layer_tensors(layers: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Layers alike (one-row tensor read by each rank alone, then a row-parallel weight), so
    that the next layer's regions are predicted from the layer before's."""
    rng = random.Random(5)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        tensors[f"layers.{i}.a.weight"] = _tensor((1, 10), "bfloat16", rng)
        tensors[f"layers.{i}.o_proj.weight"] = _tensor((48, 256), "bfloat16", rng)
    return tensors, {n for n in tensors if n.endswith("o_proj.weight")}


@pytest.fixture(scope="module")
def group(tmp_path_factory):
    """One launch of 4 ranks runs every scenario (a torch import per process is the slow part):
    generated cases on groups of 2, 3 and 4; ranks out of step on 2; HTTP on 2. Returns
    ({scenario id: [result per rank]}, {scenario id: (tensors, exchanged)}, the HTTP facts)."""
    from servers.http import Behaviour, RangeServer

    tmp = tmp_path_factory.mktemp("exchange")
    scenarios, made = [], {}
    for world in (2, 3, 4):
        tensors, exchanged = cases(world, seed=world)
        path = _write(tmp / f"w{world}" / "model.safetensors", tensors)
        made[f"w{world}"] = (tensors, exchanged)
        base = {"uri": str(path), "reference": str(path), "exchange": True, "world": world}
        # Local files read (not mapped: a mapped file is not exchanged, see `mapped`).
        scenarios.append({**base, "id": f"w{world}", "method": "read"})
        if world == 2:
            scenarios.append({**base, "id": "mapped"})
            made["mapped"] = (tensors, exchanged)
    tensors, exchanged = cases(2, seed=7)
    path = _write(tmp / "desync" / "model.safetensors", tensors)
    names = list(tensors)
    base = {"uri": str(path), "reference": str(path), "exchange": True, "world": 2}
    base["method"] = "read"
    scenarios += [
        {**base, "id": "skip", "skip": [1, names[3]]},
        {**base, "id": "fail", "fail": [0, names[5]]},
        {**base, "id": "after"},
    ]
    for key in ("skip", "fail", "after"):
        made[key] = (tensors, exchanged)
    tensors, exchanged = _http_tensors(seed=11)
    path = _write(tmp / "http" / "model.safetensors", tensors)
    body = path.read_bytes()
    made["http"] = made["http_plain"] = (tensors, exchanged)
    tensors, exchanged = _layer_tensors(5)
    layers = _write(tmp / "layers" / "model.safetensors", tensors)
    made["http_layers"] = (tensors, exchanged)
    shared_tensors, exchanged = _shared_tensors(seed=13)
    shared = _write(tmp / "shared" / "model.safetensors", shared_tensors)
    made["shared"] = (shared_tensors, exchanged)
    for world in (2, 3):
        scenarios.append(
            {
                "id": f"shared{world}",
                "uri": str(shared),
                "reference": str(shared),
                "exchange": True,
                "share": True,
                "world": world,
                "method": "read",  # a mapped file is neither exchanged nor shared
            }
        )
    server = RangeServer(
        {
            "a/model.safetensors": body,
            "b/model.safetensors": body,
            "c/model.safetensors": layers.read_bytes(),
            "d/model.safetensors": shared.read_bytes(),
        },
        Behaviour(),
    )
    base = {"reference": str(path), "exchange": True, "world": 2}
    scenarios += [
        {**base, "id": "http", "uri": server.url("a/model.safetensors")},
        {**base, "id": "http_plain", "uri": server.url("b/model.safetensors"), "exchange": False},
        {
            **base,
            "id": "http_layers",
            "uri": server.url("c/model.safetensors"),
            "reference": str(layers),
        },
        {
            **base,
            "id": "http_shared",
            "uri": server.url("d/model.safetensors"),
            "reference": str(shared),
            "share": True,
        },
    ]
    try:
        results = run_group(4, scenarios, tmp)
        log = list(server.behaviour.log)
    finally:
        server.close()
    return results, made, (log, body)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_exchanged_blocks_equal_narrowed_tensors(group, world):
    """Every rank's column block of every tensor, bitwise, for generated shapes and dtypes; the
    row-parallel ones read once over the group, the others by each rank alone."""
    results, made, _ = group
    tensors, exchanged = made[f"w{world}"]
    _check(results[f"w{world}"], tensors, exchanged, world)
    for r, res in enumerate(results[f"w{world}"]):
        # Each rank read its own blocks of the others, and the exchanged ones' row blocks.
        alone = res["stats"]["sliced_bytes"] + res["stats"]["whole_bytes"]
        assert res["bytes_read"] == alone + res["stats"]["exchanged_bytes"], r
        assert res["stats"]["sliced_tensors"] + res["stats"]["whole_tensors"] == 4, res


def test_a_rank_out_of_step_turns_the_exchange_off_everywhere(group):
    """One rank skips a tensor the others exchange (then, in a second load, a rank's read
    fails): no hang, every value right, the exchange off on every rank from there on, the
    failed read's error raised on its rank only; a next load exchanges again."""
    results, made, _ = group
    tensors, exchanged = made["skip"]
    names = list(tensors)
    for scenario, (rank_out, name_out) in (("skip", (1, names[3])), ("fail", (0, names[5]))):
        for r, res in enumerate(results[scenario]):
            want = {n: True for n in names if (r, n) != (rank_out, name_out)}
            if scenario == "fail" and r == rank_out:
                assert list(res["errors"]) == [name_out], res["errors"]
                assert "injected failure" in res["errors"][name_out]
            else:
                assert res["errors"] == {}, (scenario, r, res["errors"])
            assert res["equal"] == want, (scenario, r)
            assert not res["enabled"], (scenario, r)
            # Exchanged up to the tensor where they parted, read alone after it.
            assert 0 < res["stats"]["exchanged_tensors"] < len(exchanged), (scenario, r)
    _check(results["after"], tensors, exchanged, 2)


def test_a_mapped_local_file_is_not_exchanged(group):
    """A local file mapped (the default): every rank's column blocks bitwise, each copied out
    of the mapped pages by the rank itself (the ranks of a host share the page cache), none
    exchanged; what a rank counts as read is the span of the rows it touched."""
    results, made, _ = group
    tensors, _ = made["mapped"]
    for r, res in enumerate(results["mapped"]):
        assert res["equal"] == dict.fromkeys(tensors, True), (r, res)
        stats = res["stats"]
        assert stats["exchanged_tensors"] == 0 and res["received"] == 0, (r, stats)
        assert stats["sliced_tensors"] + stats["whole_tensors"] == len(tensors), (r, stats)
        assert res["bytes_read"] == stats["read_bytes"], (r, stats)


@pytest.mark.parametrize("world", [2, 3])
def test_tensors_read_whole_are_read_once_by_the_group_and_shared(group, world):
    """``share`` (``distributed: true``): every tensor a rank reads whole (norms, scalars, a
    replicated weight) is read by one rank of the group, chosen by its name, and broadcast;
    bitwise on every rank; its bytes read once over the group; row-parallel weights exchanged
    as before."""
    results, made, _ = group
    tensors, exchanged = made["shared"]
    _check(results[f"shared{world}"], tensors, exchanged, world)
    whole = [n for n in tensors if n not in exchanged]
    nbytes = {n: t.numel() * t.element_size() for n, t in tensors.items()}
    read_whole = sum(res["stats"]["whole_bytes"] for res in results[f"shared{world}"])
    assert read_whole == sum(nbytes[n] for n in whole)
    for r, res in enumerate(results[f"shared{world}"]):
        stats = res["stats"]
        assert stats["whole_tensors"] + stats["shared_tensors"] == len(whole), (r, stats)
        assert 0 < stats["shared_tensors"] < len(whole), (r, stats)
        assert stats["sliced_tensors"] == 0, (r, stats)


def test_over_http_shared_tensors_are_fetched_once(group):
    """The same over HTTP, read ahead by the rank that reads each: the server sends every
    tensor's bytes once over the two ranks, but for the guess of a name's first 2-D tensor (the
    rank's rows, read ahead before its region is known: unused for the replicated one)."""
    results, made, _ = group
    tensors, exchanged = made["shared"]
    _check(results["http_shared"], tensors, exchanged, 2)
    weights = sum(t.numel() * t.element_size() for t in tensors.values())
    stats = [res["stats"] for res in results["http_shared"]]
    used = sum(s["read_bytes"] - s["ahead_unused_bytes"] for s in stats)
    assert used == weights, (used, weights)
    # The unused guess: the replicated weight's first layer (the rank's rows and 64 more on
    # each side, all 96 rows), used by the rank that reads it for the group, not by the other.
    unused = sum(s["ahead_unused_bytes"] for s in stats)
    assert unused == tensors["whole.0.kv.weight"].nbytes, stats


def test_over_http_the_group_reads_the_weights_once(group):
    """Over HTTP (a planner that reads the span of a row-parallel block's rows): with the
    exchange the server sends the checkpoint's tensor bytes once over two ranks; without it,
    each rank fetches nearly every row-parallel byte."""
    results, made, (log, body) = group
    tensors, exchanged = made["http"]
    _check(results["http"], tensors, exchanged, 2)
    for res in results["http_plain"]:
        assert res["equal"] == dict.fromkeys(tensors, True)
    data_start = 8 + int.from_bytes(body[:8], "little")

    def sent(prefix: str) -> int:
        n = 0
        for method, p, rng, status in log:
            if method == "GET" and p.startswith(f"/{prefix}/") and status == 206:
                a, b = (int(x) for x in rng.removeprefix("bytes=").split("-"))
                if a >= data_start:  # not the header's read
                    n += b + 1 - a
        return n

    weights = len(body) - data_start
    print(f"sent with the exchange {sent('a') / weights:.3f}x, without {sent('b') / weights:.3f}x")
    assert sent("a") <= weights, (sent("a"), weights)
    assert sent("b") > 1.5 * weights, (sent("b"), weights)


def test_the_next_layers_row_blocks_are_read_ahead(group):
    """Over HTTP (read ahead), each rank's block of rows of a row-parallel weight is the same
    every layer: from layer 1 on it is read ahead, with the layer's other tensor. Layer 0's is
    read ahead too, as the group's guess (this rank's rows), once its first tensor is read (no
    ``all_layers``: the consumer might be a pipeline stage); only that first tensor waits."""
    results, made, _ = group
    tensors, exchanged = made["http_layers"]
    _check(results["http_layers"], tensors, exchanged, 2)
    for r, res in enumerate(results["http_layers"]):
        stats = res["stats"]
        # Rows r*24..(r+1)*24 of 256 bf16 columns; columns 5r..5r+5 of the one row.
        blocks = sum(24 * 256 * 2 for n in tensors if n in exchanged)
        later = [n for n in tensors if n not in exchanged and not n.startswith("layers.0.")]
        assert stats["ahead_bytes"] == blocks + 5 * 2 * len(later), (r, stats)
        assert stats["ahead_unused_bytes"] == 0, (r, stats)
        assert stats["waited_reads"] == 1, (r, stats)


# ---------------------------------------------------------------------------------------------
# Ranks whose files differ in a tensor of one name


def _differing_pairs() -> dict[str, tuple[dict, dict]]:
    """Per case, the tensors of rank 0's file and of rank 1's: ``w`` differs (its shape, its
    dtype, its data offsets, or only its values and the file's version), ``z`` is the same
    tensor at the same place in both (but for ``version``, where the whole file differs)."""
    rng = random.Random(40)
    z = _tensor((48, 16), "float32", rng)
    w = _tensor((64, 32), "bfloat16", rng)
    return {
        # 48 of the 64 rows of rank 0's would come from rank 1's bytes.
        "shape": ({"w": w, "z": z}, {"w": _tensor((32, 64), "bfloat16", rng), "z": z}),
        "dtype": ({"w": w, "z": z}, {"w": _tensor((64, 32), "float16", rng), "z": z}),
        # Another tensor before ``w`` in rank 0's file, after it in rank 1's (save_file orders
        # tensors of a dtype by name): ``w`` at other offsets, ``z`` at the same.
        "offsets": (
            {"v": _tensor((8,), "float32", rng), "w": w.float(), "z": z},
            {"w": _tensor((64, 32), "float32", rng), "x": _tensor((8,), "float32", rng), "z": z},
        ),
        "version": (
            {"w": w, "z": z},
            {"w": _tensor((64, 32), "bfloat16", rng), "z": _tensor((48, 16), "float32", rng)},
        ),
        "identical": ({"w": w, "z": z}, {"w": w, "z": z}),
    }


@pytest.fixture(scope="module")
def differing(tmp_path_factory):
    """One launch of 2 ranks, each reading its own file, for each case of
    :func:`_differing_pairs`: through the lazy tensors (as vLLM and SGLang load) and through
    transformers' tensor-parallel slices. ``version``: one relative URI, ``model.safetensors``,
    opened from another folder on each rank (as ranks on two hosts read one path), the two files
    alike in their headers, modified at other times. Returns ({id: [result per rank]}, files)."""
    tmp = tmp_path_factory.mktemp("differing")
    scenarios, files = [], {}
    for case, pair in _differing_pairs().items():
        paths = [
            _write(tmp / case / f"rank{r}" / "model.safetensors", t) for r, t in enumerate(pair)
        ]
        if case == "version":
            for r, p in enumerate(paths):
                os.utime(p, ns=(1_700_000_000_000_000_000 + r * 10**9,) * 2)
        files[case] = paths
        base = {"world": 2, "references": [str(p) for p in paths], "names": ["w", "z"]}
        uris = [str(p) for p in paths]
        if case == "version":
            base["cwd"] = [str(p.parent) for p in paths]
            uris = ["model.safetensors"] * 2
        scenarios.append({**base, "id": case, "kind": "own", "uris": uris})
        if case in ("dtype", "shape", "identical"):
            scenarios.append({**base, "id": f"tf_{case}", "kind": "transformers", "uris": uris})
    return run_group(2, scenarios, tmp), files


def _assert_own(results: list[dict]) -> None:
    for r, res in enumerate(results):
        assert res["equal"] == {"w": True, "z": True}, (r, res)


@pytest.mark.parametrize("case", ["shape", "dtype", "offsets"])
def test_a_tensor_the_ranks_files_hold_differently_is_read_by_each_rank_itself(differing, case):
    """``w`` of one name but another shape ((64, 32) and (32, 64): as many elements), dtype
    (bfloat16 and float16) or place in the two ranks' files: not exchanged, each rank's
    columns its own file's bit for bit; the exchange goes on with ``z``, alike in both."""
    results, _ = differing
    _assert_own(results[case])
    for r, res in enumerate(results[case]):
        assert res["how"] == {"w": "sliced", "z": "exchanged"}, (r, res["how"])
        assert res["enabled"], r
        assert res["stats"]["exchanged_tensors"] == 1, (r, res["stats"])


def test_two_versions_of_one_uri_are_not_exchanged(differing):
    """One URI names another version on each rank (a relative path from another folder, as
    one path on two hosts), the headers alike: no tensor exchanged, each rank its own values."""
    results, _ = differing
    _assert_own(results["version"])
    for r, res in enumerate(results["version"]):
        assert res["how"] == {"w": "sliced", "z": "sliced"}, (r, res["how"])
        assert res["stats"]["exchanged_tensors"] == 0, (r, res["stats"])


def test_identical_files_at_two_paths_are_still_exchanged(differing):
    """Two copies of one checkpoint, one per rank (another URI each, modified at other times):
    every row-parallel tensor exchanged, as from one file."""
    results, _ = differing
    _assert_own(results["identical"])
    for r, res in enumerate(results["identical"]):
        assert res["how"] == {"w": "exchanged", "z": "exchanged"}, (r, res["how"])


@pytest.mark.parametrize("case", ["shape", "dtype", "identical"])
def test_transformers_slices_agree_on_the_tensor_before_an_exchange(differing, case):
    """transformers' tensor-parallel path (``_File`` slices, ``_Exchange``) compares the same:
    ``w`` held differently is read by each rank itself, ``z`` (alike) exchanged."""
    results, _ = differing
    _assert_own(results[f"tf_{case}"])
    exchanged = 2 if case == "identical" else 1
    for r, res in enumerate(results[f"tf_{case}"]):
        assert res["counts"].get("exchanged_tensors", 0) == exchanged, (r, res["counts"])


def test_two_versions_of_one_object_are_not_exchanged(seaweed, tmp_path):
    """A versioned S3 object overwritten after rank 0 opened it and before rank 1 did: each
    rank reads the version it is pinned to (the version id), the two alike in their headers;
    no tensor exchanged, each rank's columns its version's. Another object that both open at
    one version is exchanged."""
    from servers.s3 import upload

    pair = _differing_pairs()["version"]
    old, new = (_write(tmp_path / f"v{i}" / "model.safetensors", t) for i, t in enumerate(pair))
    bucket = "exchange-versions"
    s3 = seaweed.client()
    upload(s3, bucket, {})
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    upload(s3, bucket, {"model.safetensors": old, "same.safetensors": old})
    base = {
        "world": 2,
        "kind": "own",
        "names": ["w", "z"],
        "storage_options": seaweed.storage_options(),
    }
    uri = f"s3://{bucket}/model.safetensors"
    overwrite = {"endpoint": seaweed.endpoint, "bucket": bucket, "key": "model.safetensors"}
    scenarios = [
        {
            **base,
            "id": "versions",
            "uris": [uri, uri],
            "references": [str(old), str(new)],
            "overwrite": {**overwrite, "with": str(new)},
        },
        {
            **base,
            "id": "same",
            "uris": [f"s3://{bucket}/same.safetensors"] * 2,
            "references": [str(old)] * 2,
        },
    ]
    results = run_group(2, scenarios, tmp_path)
    _assert_own(results["versions"])
    for r, res in enumerate(results["versions"]):
        assert res["how"] == {"w": "sliced", "z": "sliced"}, (r, res["how"])
    _assert_own(results["same"])
    for r, res in enumerate(results["same"]):
        assert res["how"] == {"w": "exchanged", "z": "exchanged"}, (r, res["how"])


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == WORKER:
    _worker(sys.argv[2], sys.argv[3])
