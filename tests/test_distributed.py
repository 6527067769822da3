"""Loading across a torch.distributed group: real CPU processes with the gloo backend (env://
rendezvous on 127.0.0.1), local files and a SeaweedFS S3 server.

Every rank checks its result bit for bit against `safetensors.torch.load_file` and reports the
tensor bytes it read from storage: summed over the group they must equal the checkpoint's tensor
bytes exactly once. One launch of each group runs every scenario in turn (a torch import per
process is the slow part here), failures included: a failure must raise the same exception on
every rank and leave the group usable for the next scenario, all within the launch's deadline.

Run as a script (`python test_distributed.py WORKER JOB OUT`), this file is one rank's worker.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from helpers import gloo_threads, indexed_files, pattern, reference, run_ranks

WORKER = "--fastload-dist-worker"
# One group launch (process start, torch import, every scenario) must end within this.
GROUP_DEADLINE = 120.0


# ---------------------------------------------------------------------------------------------
# The worker (one rank)


class _FailingStream:
    """Stands in for the native stream on one rank: it opens, then storage fails."""

    real = None

    def __init__(self, *args, **kwargs):
        self._s = self.real(*args, **kwargs)

    def __iter__(self):
        return self

    def __next__(self):
        import fastload

        raise fastload.StorageError("s3://models/split.safetensors: connection reset (injected)")

    def stats(self):
        return self._s.stats()

    def close(self):
        self._s.close()


# What the scenarios marked "keep" leave alive until the group is destroyed: their errors (as
# pytest.raises or a log keeps them) and abandoned streams, closed or not (a user's attribute).
KEPT: list = []


def _run_scenario(sc: dict, rank: int, world: int) -> dict:
    import itertools
    from unittest import mock

    import fastload
    import fastload.distributed
    import torch.distributed as dist
    from helpers import assert_same_tensors, drain_by_threads

    uri = sc.get("uri_by_rank", {}).get(str(rank), sc.get("uri"))
    names = sc["names"][str(rank)] if sc.get("names") else None
    # A kept error's traceback keeps this frame: it names the default group, not the group.
    group = "default" if sc.get("api") == "stream" or sc.get("keep") else dist.group.WORLD
    opts = dict(
        process_group=group,
        names=names,
        memory_limit=sc.get("memory_limit"),
        storage_options=sc.get("storage_options"),
    )
    if sc.get("keyset"):
        opts["keyset"] = sc["keyset"]
    # parts: {rank: {name: [[start, stop], ...]}}, a slice per dim.
    parts = {
        n: tuple(slice(*b) for b in dims)
        for n, dims in sc.get("parts", {}).get(str(rank), {}).items()
    }
    if parts:
        opts["parts"] = parts
    out: dict = {"id": sc["id"], "rank": rank, "uri": uri}
    started = time.monotonic()
    patch = mock.patch.object(fastload._fastload, "Stream", _FailingStream)
    inject = sc.get("inject_rank") == rank
    _FailingStream.real = fastload._fastload.Stream
    try:
        if inject:
            patch.start()
        if sc.get("stop_after") is not None:
            # Every rank stops at the same tensor (they all want all, in one order), mid-load.
            s = fastload.stream(uri, **opts)
            got = dict(itertools.islice(s, sc["stop_after"]))
            if sc.get("close"):
                s.close()
                KEPT.append(s)
            del s  # dropped, half-way: nothing of the group may wait for the garbage collector
            out.update(ok=True, names=sorted(got))
            return out
        if sc.get("api") == "stream":
            got = {}

            def take(_thread, name, tensor):
                assert name not in got, f"{name} yielded twice"
                got[name] = tensor

            with fastload.stream(uri, **opts) as s:
                # Several threads of the rank share the stream: each tensor reaches one of them.
                raised = drain_by_threads(s, sc.get("threads", 1), take)
                stats = s.stats()
            first = next((e for e in raised if e is not None), None)
            if first is not None:
                raise first
        else:
            got = fastload.load(uri, **opts)
            stats = fastload.distributed.last_stats()
        out.update(ok=True, names=sorted(got), stats=stats)
        ref = reference(*sc["ref"])
        want = ref if names is None else {n: ref[n] for n in names}
        want = {n: t[parts[n]] if n in parts else t for n, t in want.items()}
        try:
            assert_same_tensors(got, want)
        except AssertionError as e:
            out["parity"] = str(e)
    except Exception as e:
        out.update(ok=False, error_type=type(e).__name__, error=str(e))
        if sc.get("keep"):
            KEPT.append(e)
    finally:
        if inject:
            patch.stop()
    out["seconds"] = time.monotonic() - started
    return out


def _worker(job: str, result: str) -> None:
    import gc
    from datetime import timedelta

    import torch.distributed as dist

    # No reference to the group may be left for the garbage collector to break: with it off, one
    # left in a reference cycle shows as a gloo thread outliving destroy_process_group().
    gc.disable()
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    results = [_run_scenario(sc, rank, world) for sc in json.loads(Path(job).read_text())]
    dist.barrier()
    before = gloo_threads()
    dist.destroy_process_group()
    # The group's threads end with it, though this rank keeps the failed loads' errors and the
    # abandoned streams (a group alive into interpreter exit can abort the process: a gloo
    # thread taking the GIL while the interpreter finalises, "terminate called without an
    # active exception").
    results.append({"id": "gloo-threads", "rank": rank, "threads": [before, gloo_threads()]})
    # Nor did what the rank kept sit in a reference cycle with fastload's frames (the error in a
    # local of the frame it was raised through, with the tensors and stream that frame holds).
    import types

    import fastload

    KEPT.clear()
    gc.set_debug(gc.DEBUG_SAVEALL)
    gc.collect()
    package = os.path.dirname(fastload.__file__)
    frames = [o.f_code for o in gc.garbage if type(o) is types.FrameType]
    cyclic = sorted({c.co_name for c in frames if c.co_filename.startswith(package)})
    results.append({"id": "cycles", "rank": rank, "frames": cyclic})
    (Path(result) / f"rank{rank}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------------------------------
# Launching a group


def run_group(world: int, scenarios: list[dict], tmp: Path, env: dict | None = None) -> dict:
    """Runs `scenarios` on `world` fresh processes; returns {scenario id: [result per rank]}."""

    tmp.mkdir(parents=True, exist_ok=True)
    job = tmp / "job.json"
    job.write_text(json.dumps(scenarios))
    base = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "FASTLOAD_", "TORCH"))}
    base.update(OMP_NUM_THREADS="1", AWS_EC2_METADATA_DISABLED="true")
    base.update(env or {})
    # Each rank writes its results to rank{r}.json in tmp, beside its log.
    argv = [sys.executable, __file__, WORKER, str(job), str(tmp)]
    run_ranks(world, argv, tmp, base, GROUP_DEADLINE, Path(__file__).parent)
    by_id: dict = {}
    for r in range(world):
        for res in json.loads((tmp / f"rank{r}.json").read_text()):
            by_id.setdefault(res["id"], []).append(res)
    return by_id


# ---------------------------------------------------------------------------------------------
# Checkpoints and scenarios


def tensor_bytes(uri, names=None, storage_options=None) -> int:
    """The checkpoint's tensor bytes (of `names` only, if given), from its headers."""
    import fastload

    tensors = fastload.inspect(uri, storage_options=storage_options)["tensors"]
    return sum(t["bytes"] for t in tensors if names is None or t["name"] in names)


def write_split(path: Path) -> Path:
    """One 3 MiB tensor (most of the file: every rank reads a piece of it) between small ones."""
    from safetensors.torch import save_file

    save_file(
        {
            "a.small": pattern((7,), torch.float16, seed=1),
            "b.big": torch.arange(768 * 1024, dtype=torch.int32).reshape(768, 1024),
            "c.scalar": pattern((), torch.float64, seed=2),
            "d.odd": pattern((3, 5), torch.bfloat16, seed=3),
        },
        str(path),
    )
    return path


@pytest.fixture(scope="module")
def local(tmp_path_factory, dtypes_file, sharded_dir):
    from helpers import write_many_tiny

    root = tmp_path_factory.mktemp("dist")
    split = write_split(root / "split.safetensors")
    # Fewer than the session's 20k tiny tensors: every rank compares each one with the reference.
    tiny_file = write_many_tiny(root / "tiny.safetensors", count=4000)
    corrupt = root / "corrupt.safetensors"
    corrupt.write_bytes((10**9).to_bytes(8, "little") + b'{"x": garbage')
    keyset = encrypt_folder(sharded_dir, root / "encrypted")
    return {
        "encrypted": (str(root / "encrypted"), [str(p) for p in indexed_files(sharded_dir)]),
        "keyset": keyset,
        "single": (str(dtypes_file), [str(dtypes_file)]),
        "sharded": (str(sharded_dir), [str(p) for p in indexed_files(sharded_dir)]),
        "tiny": (str(tiny_file), [str(tiny_file)]),
        "split": (str(split), [str(split)]),
        "missing": str(root / "no-such-model"),
        "corrupt": str(corrupt),
    }


def encrypt_folder(src: Path, dst: Path) -> str:
    """`src` with each .safetensors file encrypted by the `tink` package (AES128_GCM_HKDF_4KB:
    many segments per tensor), other files as they are, into `dst`; returns the keyset JSON."""
    import io

    tink = pytest.importorskip("tink")
    from tink import cleartext_keyset_handle, streaming_aead

    streaming_aead.register()
    handle = tink.new_keyset_handle(streaming_aead.streaming_aead_key_templates.AES128_GCM_HKDF_4KB)
    out = io.StringIO()
    cleartext_keyset_handle.write(tink.JsonKeysetWriter(out), handle)
    primitive = handle.primitive(streaming_aead.StreamingAead)
    dst.mkdir()
    for p in src.iterdir():
        if p.suffix != ".safetensors":
            (dst / p.name).write_bytes(p.read_bytes())
            continue
        with (dst / p.name).open("wb") as f, primitive.new_encrypting_stream(f, b"") as w:
            w.write(p.read_bytes())
    return out.getvalue()


PARITY = ["single", "sharded", "tiny", "split", "split-rounds", "stream", "threads", "encrypted"]
FAILURES = {
    "missing": "NotFoundError",
    "corrupt": "FormatError",
    "read": "StorageError",
    "bad-part": "TensorNotFoundError",
}


def local_scenarios(ck: dict, world: int) -> list[dict]:
    scenarios = [{"id": k, "uri": ck[k][0], "ref": ck[k][1]} for k in PARITY[:4]]
    # 256 KiB chunks (the minimum): the big tensor crosses rounds, in direct and packed messages.
    scenarios.append({**scenarios[3], "id": "split-rounds", "memory_limit": "1MiB"})
    scenarios.append({**scenarios[1], "id": "stream", "api": "stream"})
    # Small rounds, so that the threads take turns across many collectives.
    scenarios.append(
        {**scenarios[1], "id": "threads", "api": "stream", "threads": 4, "memory_limit": "1MiB"}
    )
    # The sharded checkpoint encrypted (keyset=): each rank decrypts only the segments of its
    # share, and together they read each plaintext byte once.
    scenarios.append({**scenarios[1], "id": "encrypted", "uri": ck["encrypted"][0],
                      "keyset": ck["keyset"], "memory_limit": "1MiB"})  # fmt: skip
    sharded_names = sorted(reference(*ck["sharded"][1]))
    # Rank r wants every world-th tensor from r on, and every rank wants "embed.weight".
    names = {str(r): sorted({*sharded_names[r::world], "embed.weight"}) for r in range(world)}
    names[str(world - 1)] = []  # one rank wants nothing at all
    scenarios.append({**scenarios[1], "id": "names", "names": names})
    last = str(world - 1)
    # parts= with the group: rank r takes its block of b.big's rows, the last rank also columns
    # 1..4 of d.odd; what each wants whole is read once over the group, parts by their ranks.
    rows = 768
    parts = {
        str(r): {"b.big": [[r * rows // world, (r + 1) * rows // world]]} for r in range(world)
    }
    parts[last]["d.odd"] = [[0, 3], [1, 4]]
    scenarios.append({**scenarios[3], "id": "parts", "parts": parts, "memory_limit": "1MiB"})
    scenarios.append({**scenarios[3], "id": "parts-stream", "parts": parts, "api": "stream"})
    scenarios += [
        {**scenarios[3], "id": "bad-part", "parts": {last: {"no.such": [[0, 1]]}}},
        {**scenarios[0], "id": "missing", "uri_by_rank": {last: ck["missing"]}},
        {**scenarios[0], "id": "corrupt", "uri_by_rank": {last: ck["corrupt"]}},
        {**scenarios[3], "id": "read", "memory_limit": "1MiB", "inject_rank": world - 1},
        # Loads stopped half-way (every rank takes the first tensor of several rounds), the
        # stream closed and kept, or just dropped.
        {**scenarios[3], "id": "abandoned", "memory_limit": "1MiB", "stop_after": 1, "close": 1},
        {**scenarios[3], "id": "dropped", "memory_limit": "1MiB", "stop_after": 1},
        {**scenarios[1], "id": "after-failures"},
    ]
    for sc in scenarios:
        if sc["id"] in FAILURES:
            sc["keep"] = True
    return scenarios


HUB_REPO = "org/dist"


def s3_scenarios(server, ck: dict) -> list[dict]:
    from servers.s3 import BUCKET, upload, upload_dir

    s3 = server.client()
    upload(s3, BUCKET, {"dist/split.safetensors": Path(ck["split"][0])})
    upload_dir(s3, BUCKET, "dist/sharded", Path(ck["sharded"][0]))
    uris = {
        "sharded": f"s3://{BUCKET}/dist/sharded/",
        "split": f"s3://{BUCKET}/dist/split.safetensors",
    }
    scenarios = [{"id": f"s3-{k}", "uri": u, "ref": ck[k][1]} for k, u in uris.items()]
    # The same with settings given as storage_options instead of the environment.
    opts = server.storage_options()
    scenarios.append({**scenarios[1], "id": "s3-split-opts", "storage_options": opts})
    return scenarios


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"{w}ranks")
def group(request, local, tmp_path_factory):
    """One launch per group size runs every scenario; the 4-rank one adds the S3 scenarios
    (when SeaweedFS is installed), with credentials reaching the ranks through their env."""
    world = request.param
    scenarios, env, server = local_scenarios(local, world), {}, None
    tmp = tmp_path_factory.mktemp("group")
    hub = None
    if world == 4:
        try:
            server = request.getfixturevalue("seaweed")
        except pytest.skip.Exception:
            server = None
        if server is not None:
            scenarios += s3_scenarios(server, local)
            env.update(server.env())
        # The sharded checkpoint on a mock Hugging Face Hub, as hf://.
        from servers.hub import MockHub

        hub = MockHub()
        folder = Path(local["sharded"][0])
        hub.add(HUB_REPO, {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
        env.update(HF_ENDPOINT=hub.base, HF_HOME=str(tmp / "hf_home"), HF_HUB_CACHE=str(tmp / "hf"))
        scenarios.append(
            {"id": "hf-sharded", "uri": f"hf://{HUB_REPO}", "ref": local["sharded"][1]}
        )
    try:
        results = run_group(world, scenarios, tmp, env=env)
    finally:
        if hub is not None:
            hub.close()
    return world, local, results, server


def check_parity(results: list[dict], total: int, world: int) -> None:
    assert len(results) == world
    for res in results:
        assert res["ok"], f"rank {res['rank']}: {res.get('error_type')}: {res.get('error')}"
        assert "parity" not in res, f"rank {res['rank']}: {res['parity']}"
    read = [res["stats"]["bytes_read"] for res in results]
    assert sum(read) == total, f"bytes read per rank {read}, checkpoint {total}"
    assert max(read) - min(read) <= 1, f"unbalanced reads {read}"


# ---------------------------------------------------------------------------------------------
# Tests: local files


@pytest.mark.parametrize("scenario", PARITY)
def test_every_rank_gets_every_tensor_read_once(group, scenario):
    world, ck, results, _ = group
    key = {
        "split-rounds": "split",
        "stream": "sharded",
        "threads": "sharded",
        "encrypted": "sharded",
    }.get(scenario, scenario)
    check_parity(results[scenario], tensor_bytes(ck[key][0]), world)
    if scenario == "split-rounds":
        assert results[scenario][0]["stats"]["rounds"] > 1


def test_names_per_rank_route_only_what_is_wanted(group):
    world, ck, results, _ = group
    uri = ck["sharded"][0]
    wanted = {r: set(res["names"]) for r, res in enumerate(results["names"])}
    union = set().union(*wanted.values())
    assert wanted[world - 1] == set()
    for res in results["names"]:
        assert res["ok"] and "parity" not in res, res
    stats = [res["stats"] for res in results["names"]]
    assert sum(s["bytes_read"] for s in stats) == tensor_bytes(uri, union)
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
    for r, s in enumerate(stats):
        assert s["bytes_received"] <= tensor_bytes(uri, wanted[r])
    assert stats[world - 1]["bytes_received"] == 0


@pytest.mark.parametrize("scenario", ["parts", "parts-stream"])
def test_parts_are_read_by_their_ranks_and_the_rest_once_by_the_group(group, scenario):
    """``parts=`` with a group: each rank gets its parts (bitwise the reference's indexed) and
    every other tensor whole; what ranks want whole is read once over the group, each part only
    by its rank, and no part travels."""
    world, ck, results, _ = group
    uri = ck["split"][0]
    res = results[scenario]
    for r in res:
        assert r["ok"] and "parity" not in r, r
        assert r["names"] == ["a.small", "b.big", "c.scalar", "d.odd"], r["names"]
    stats = [r["stats"] for r in res]
    whole = tensor_bytes(uri, {"a.small", "c.scalar", "d.odd"})
    parts = [s["part_bytes"] for s in stats]
    # b.big's rows split evenly (a block each, no gaps), and the last rank's d.odd columns.
    assert parts[:-1] == [tensor_bytes(uri, {"b.big"}) // world] * (world - 1), parts
    assert parts[-1] > tensor_bytes(uri, {"b.big"}) // world, parts
    assert sum(s["bytes_read"] for s in stats) == whole + sum(parts), stats
    assert [s["part_tensors"] for s in stats] == [1] * (world - 1) + [2], stats
    # Only the tensors wanted whole travel, to the ranks that want them.
    assert sum(s["bytes_sent"] for s in stats) == sum(s["bytes_received"] for s in stats)
    for r, s in enumerate(stats):
        mine = {"a.small", "c.scalar"} | ({"d.odd"} if r < world - 1 else set())
        assert s["bytes_received"] <= tensor_bytes(uri, mine), (r, s)


@pytest.mark.parametrize("scenario", sorted(FAILURES))
def test_a_failure_on_one_rank_raises_on_every_rank(group, scenario):
    world, _, results, _ = group
    res = results[scenario]
    assert [r["ok"] for r in res] == [False] * world, res
    assert {r["error_type"] for r in res} == {FAILURES[scenario]}, res
    assert len({r["error"] for r in res}) == 1, [r["error"] for r in res]


def test_the_group_stays_usable_after_failures(group):
    world, ck, results, _ = group
    for sc in ("abandoned", "dropped"):
        names = [r["names"] for r in results[sc]]
        assert len(names) == world and len(names[0]) == 1 and names == names[:1] * world, names
    check_parity(results["after-failures"], tensor_bytes(ck["sharded"][0]), world)


def test_no_gloo_thread_outlives_destroy_process_group(group):
    """Each rank keeps its failed loads' errors and its closed half-way stream, drops another
    half-way, and destroys the group with the garbage collector off: no gloo thread is left."""
    world, _, results, _ = group
    threads = [r["threads"] for r in results["gloo-threads"]]
    assert len(threads) == world
    assert all(before > 0 and after == 0 for before, after in threads), threads
    assert [r["frames"] for r in results["cycles"]] == [[]] * world, results["cycles"]


# ---------------------------------------------------------------------------------------------
# Tests: S3 (SeaweedFS)


@pytest.mark.parametrize("scenario", ["s3-sharded", "s3-split", "s3-split-opts"])
def test_s3_group_reads_each_byte_once(group, scenario):
    world, _, results, server = group
    if world != 4 or server is None:
        pytest.skip("S3 scenarios run in the 4-rank group, with SeaweedFS installed")
    res = results[scenario]
    uri = res[0]["uri"]
    check_parity(res, tensor_bytes(uri, storage_options=server.storage_options()), world)


def test_hub_group_reads_each_byte_once(group):
    """hf:// in a distributed load: every rank gets every tensor, each byte read once."""
    world, local, results, _ = group
    if world != 4:
        pytest.skip("the hf:// scenario runs in the 4-rank group")
    check_parity(results["hf-sharded"], tensor_bytes(local["sharded"][0]), world)


# ---------------------------------------------------------------------------------------------
# Tests: in process (no group)


def test_without_a_group_every_process_reads_alone_with_a_warning(local):
    import fastload
    import fastload.distributed
    import torch.distributed as dist
    from helpers import assert_same_tensors

    assert not dist.is_initialized()
    uri, ref = local["split"]
    with pytest.warns(RuntimeWarning, match="not initialised"):
        got = fastload.load(uri, process_group="default")
    assert_same_tensors(got, reference(*ref))
    with pytest.warns(RuntimeWarning, match="not initialised"):
        got = fastload.distributed.load(uri)
    assert fastload.distributed.last_stats()["bytes_read"] == tensor_bytes(uri)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fastload.load(uri)  # no process_group: a plain load, no warning


def test_process_group_rejects_other_strings(local):
    import fastload

    with pytest.raises(fastload.ConfigError) as info:
        fastload.load(local["split"][0], process_group="world")
    assert info.value.option == "process_group"


def test_native_parts_read_only_those_byte_ranges(local):
    import fastload
    from fastload import _fastload
    from helpers import raw_bytes

    uri, ref = local["split"]
    want = reference(*ref)
    parts = [("b.big", 4096, 1 << 20), ("a.small", 2, 14), ("b.big", 0, 4096), ("d.odd", 0, 30)]
    stream = _fastload.Stream([uri], parts=parts)
    got = {}
    for batch in stream:
        for item in batch:
            assert item.dtype == "U8"
            got[(item.name, item.begin)] = torch.from_dlpack(item.data).clone()
            assert item.shape == (got[(item.name, item.begin)].numel(),)
    assert sorted(got) == sorted((n, b) for n, b, _ in parts)
    for name, begin, end in parts:
        assert torch.equal(got[(name, begin)], raw_bytes(want[name])[begin:end]), name
    assert stream.stats().bytes_read == sum(e - b for _, b, e in parts)
    for bad in [
        dict(parts=[("b.big", 0, 10), ("b.big", 5, 20)]),  # overlapping ranges
        dict(parts=[("b.big", 0, 10)], names=["b.big"]),  # parts and names together
    ]:
        with pytest.raises(fastload.ConfigError) as info:
            _fastload.Stream([uri], **bad)
        assert info.value.option == "parts", bad
    with pytest.raises(fastload.TensorNotFoundError) as missing:
        _fastload.Stream([uri], parts=[("nope", 0, 1)])
    assert missing.value.names == ["nope"]


def test_plan_splits_bytes_evenly_and_covers_each_byte_once():
    from fastload import _fastload

    # Sizes and chunk are those of the planner's unit tests (src/ranks.rs) times 4096: a 1 MiB
    # memory limit makes 256 KiB rounds (64 bytes there).
    scale = 4096
    table = [
        ("a", "F32", (3 * scale,), 12 * scale),
        ("e", "F32", (0,), 0),
        ("big", "U8", (1000 * scale,), 1000 * scale),
        ("b", "I64", (scale,), 8 * scale),
        ("c", "U8", (5 * scale,), 5 * scale),
    ]
    total, chunk = 1025 * scale, 64 * scale
    for world in (1, 2, 3, 4, 7):
        plan = _fastload.plan_ranks(table, [None] * world, [1 << 20] * world)
        assert plan.total == total and plan.chunk == chunk
        sizes = [e - s for s, e in plan.ranges]
        assert sum(sizes) == total and max(sizes) - min(sizes) <= 1
        covered: dict[int, list] = {}
        for rank, rounds in enumerate(plan.pieces):
            assert len(rounds) == plan.rounds
            read = []
            for pieces in rounds:
                assert sum(hi - lo for _, lo, hi in pieces) <= chunk
                for i, lo, hi in pieces:
                    covered.setdefault(i, []).append((lo, hi))
                    read.append((plan.tensors[i][0], lo, hi))
            assert plan.parts(rank) == read
        for i, (_, _, _, n) in enumerate(plan.tensors):
            spans = sorted(covered.get(i, []))
            assert sum(hi - lo for lo, hi in spans) == n, plan.tensors[i]
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert plan.counts[i] == len(spans)
    # Only wanted tensors are planned; rounds follow the smallest memory limit of the group.
    plan = _fastload.plan_ranks(table, [["a"], ["c"]], [1 << 30, 1 << 20])
    assert [t[0] for t in plan.tensors] == ["a", "c"] and plan.total == 17 * scale
    assert plan.wants(0, 0) and not plan.wants(0, 1) and plan.wants(1, 1)
    assert plan.chunk == chunk


def test_checkpoint_tensors_are_checked_as_a_load_checks_them(local, tmp_path):
    import fastload
    from fastload import _fastload
    from safetensors.torch import save_file

    uri = local["split"][0]
    table = _fastload.checkpoint_tensors([uri])
    listed = fastload.inspect(uri)["tensors"]
    in_file_order = sorted(listed, key=lambda t: t["data_offsets"][0])
    assert table == [(t["name"], t["dtype"], tuple(t["shape"]), t["bytes"]) for t in in_file_order]
    assert ("b.big", "I32", (768, 1024), 768 * 1024 * 4) in table
    with pytest.raises(fastload.TensorNotFoundError) as info:
        _fastload.checkpoint_tensors([uri], names=["a.small", "nope"])
    assert info.value.names == ["nope"]
    save_file({"a.small": torch.zeros(2)}, str(tmp_path / "dup.safetensors"))
    with pytest.raises(fastload.FormatError) as dup:
        _fastload.checkpoint_tensors([uri, str(tmp_path / "dup.safetensors")])
    assert dup.value.path == str(tmp_path / "dup.safetensors")


# The seaweed fixture, bound here so that pytest finds it.
if __name__ != "__main__":
    from servers import s3 as s3_server

    seaweed = s3_server.seaweed


if __name__ == "__main__" and len(sys.argv) == 4 and sys.argv[1] == WORKER:
    _worker(sys.argv[2], sys.argv[3])
