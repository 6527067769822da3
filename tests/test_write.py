"""fastload.save_file and fastload.save: the bytes safetensors writes, to local paths and a real
S3 server (SeaweedFS; moto for ListMultipartUploads where SeaweedFS differs), and never a
half-written result: disk full, 500s, refused credentials, existing destinations, kill -9."""

from __future__ import annotations

import json
import mmap
import os
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import fastload
import pytest
import torch
from helpers import assert_same_tensors, cached_bytes, mounted_tmpfs, pattern, raw_bytes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from servers import s3 as s3_server
from servers.s3 import BUCKET, SECRET_KEY, Fault

aws_env = s3_server.aws_env
seaweed_fault_proxy = s3_server.seaweed_fault_proxy
HERE = Path(__file__).resolve().parent
PYTHON = os.path.join(os.path.dirname(fastload.__file__), "..")


def all_dtypes() -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    names = [
        "float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8", "uint8",
        "bool", "float8_e4m3fn", "float8_e5m2", "complex64", "uint64", "uint32", "uint16",
        "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu", "float4_e2m1fn_x2",
    ]  # fmt: skip
    for i, name in enumerate(names):
        dtype = getattr(torch, name, None)
        if dtype is None:
            continue
        raw = pattern((3, 5), torch.uint8, seed=i)
        size = torch.empty((), dtype=dtype).element_size()
        out[f"t.{name}"] = (
            raw.view(-1)[: 15 - 15 % size].view(dtype)
            if size == 1
            else (pattern((3, 5), torch.float32, seed=i).to(dtype))
        )
    out["scalar"] = torch.tensor(3.25, dtype=torch.float64)
    out["int scalar"] = torch.tensor(7)
    out["empty"] = torch.zeros((0, 4), dtype=torch.bfloat16)
    out["empty.u8"] = torch.zeros((2, 0), dtype=torch.uint8)
    out['ünï ✓ "quoted"\n'] = torch.arange(5, dtype=torch.int16)
    out["z.last"] = torch.ones(1, dtype=torch.bool)
    return out


@pytest.mark.parametrize(
    "metadata", [None, {"format": "pt"}, {"ünï": '✓ "q"\n'}], ids=["none", "pt", "unicode"]
)
def test_save_file_writes_the_bytes_safetensors_writes(tmp_path, metadata):
    tensors = all_dtypes()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata=metadata)
    fastload.save_file(tensors, tmp_path / "ours.safetensors", metadata=metadata)
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "ours.safetensors").read_bytes() == ref
    assert sorted(os.listdir(tmp_path)) == ["ours.safetensors", "ref.safetensors"]


def direct_writes_skip_the_page_cache(folder: Path) -> bool:
    """Whether a direct write (O_DIRECT) to `folder` leaves its pages out of the page cache (not
    so on a tmpfs, which is the page cache, or where O_DIRECT is refused)."""
    probe = folder / "probe"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT)
    except OSError:
        return False
    try:
        os.write(fd, mmap.mmap(-1, 1 << 20))  # page-aligned, as direct I/O wants
        os.fsync(fd)
    except OSError:
        return False
    finally:
        os.close(fd)
    cached = cached_bytes(probe)
    probe.unlink()
    return cached == 0


def test_a_large_local_file_goes_around_the_page_cache_as_safetensors_bytes(tmp_path):
    """A file of several write buffers is written directly (O_DIRECT, from reused buffers; its
    unaligned end through the page cache): the bytes are safetensors' own, and no copy of them is
    left in the page cache (buffered writes there cost a first touch of fresh pages per byte, the
    bulk of a slow local save_file)."""
    if not direct_writes_skip_the_page_cache(tmp_path):
        pytest.skip("direct writes to this filesystem stay in the page cache (or are refused)")
    # Odd sizes: tensors straddle the 8 MiB buffers and the file's end is not block-aligned.
    tensors = {f"w{i}": pattern((4_000_001 + 7 * i,), torch.bfloat16, seed=i) for i in range(6)}
    ours, ref = tmp_path / "ours.safetensors", tmp_path / "ref.safetensors"
    fastload.save_file(tensors, ours)
    save_file(tensors, str(ref))
    size = os.path.getsize(ours)
    assert size > 40 << 20
    assert cached_bytes(ours) <= 2 * os.sysconf("SC_PAGE_SIZE"), cached_bytes(ours)
    assert cached_bytes(ref) > size // 2  # the control: a buffered write leaves its pages
    assert ours.read_bytes() == ref.read_bytes()
    assert sorted(os.listdir(tmp_path)) == ["ours.safetensors", "ref.safetensors"]


def test_save_file_of_nothing_and_of_many_metadata_keys(tmp_path):
    save_file({}, str(tmp_path / "ref.safetensors"))
    fastload.save_file({}, str(tmp_path / "ours.safetensors"))
    assert (tmp_path / "ours.safetensors").read_bytes() == (
        tmp_path / "ref.safetensors"
    ).read_bytes()
    # safetensors keeps metadata in a hash map (its key order varies): same JSON, same data.
    meta = {f"k{i}": str(i) for i in range(6)}
    tensors = {"a": pattern((4, 3), torch.float32), "b": pattern((7,), torch.int8)}
    save_file(tensors, str(tmp_path / "ref2.safetensors"), metadata=meta)
    fastload.save_file(tensors, str(tmp_path / "ours2.safetensors"), metadata=meta)
    ref, ours = ((tmp_path / n).read_bytes() for n in ("ref2.safetensors", "ours2.safetensors"))
    n = int.from_bytes(ref[:8], "little")
    assert ours[:8] == ref[:8] and ours[8 + n :] == ref[8 + n :]
    assert json.loads(ours[8 : 8 + n]) == json.loads(ref[8 : 8 + n])
    got = fastload.load(tmp_path / "ours2.safetensors")
    assert_same_tensors(got, tensors)


def test_bad_tensors_names_and_metadata_are_refused_before_anything_is_written(tmp_path):
    dest = tmp_path / "x.safetensors"
    good = torch.zeros(2)
    with pytest.raises(TypeError, match=r"names must be str: 3 is int"):
        fastload.save_file({3: good}, dest)
    with pytest.raises(TypeError, match=r"metadata must be a dict of str to str.*'n': 1"):
        fastload.save_file({"a": good}, dest, metadata={"n": 1})
    with pytest.raises(TypeError, match="metadata must be a dict"):
        fastload.save_file({"a": good}, dest, metadata=[("a", "b")])
    with pytest.raises(fastload.ConfigError, match=r"Key `a` is invalid, expected torch.Tensor"):
        fastload.save_file({"a": [1, 2]}, dest)
    with pytest.raises(fastload.ConfigError, match=r"tensor 'nc' is not contiguous"):
        fastload.save_file({"nc": torch.zeros(3, 4).t()}, dest)
    with pytest.raises(fastload.ConfigError, match="sparse"):
        fastload.save_file({"s": torch.zeros(3, 3).to_sparse()}, dest)
    with pytest.raises(fastload.ConfigError, match="meta device"):
        fastload.save_file({"m": torch.zeros(3, device="meta")}, dest)
    base = torch.zeros(4, 4)
    # The same refusal as safetensors' own save_file for tensors that share memory.
    with pytest.raises(RuntimeError, match=r"share memory.*\['a', 'b'\]") as ours:
        fastload.save_file({"a": base, "b": base[:2]}, dest)
    with pytest.raises(RuntimeError, match="share memory"):
        save_file({"a": base, "b": base[:2]}, str(dest))
    assert "a" in str(ours.value)
    # Rows 0-1 and 2-3 of one storage do not overlap: written, as safetensors writes them.
    fastload.save_file({"a": base[:2], "b": base[2:]}, dest)
    assert set(load_file(str(dest))) == {"a", "b"}
    os.remove(dest)
    with pytest.raises(fastload.ConfigError, match="__metadata__"):
        fastload.save_file({"__metadata__": good}, dest)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("scheme", ["http", "https", "HTTP", "Https"])
def test_http_urls_are_refused_as_destinations_in_any_letter_case(scheme):
    # The scheme table decides, whatever the case: never a PUT to a server that only serves reads.
    with pytest.raises(fastload.ConfigError, match=r"not to http\(s\):// URLs"):
        fastload.save_file({"a": torch.zeros(2)}, f"{scheme}://127.0.0.1:9/x.safetensors")


def test_save_file_replaces_an_existing_file_atomically_by_default(tmp_path):
    # safetensors' save_file (and torch.save) replace an existing file; fastload's does too, by
    # renaming the complete new file into place: a reader that mapped the old file (safetensors'
    # safe_open) keeps its bytes, where an in-place rewrite would change or truncate them.
    dest = tmp_path / "m.safetensors"
    old = {"a": pattern((5000,), torch.float32, seed=1)}
    new = {"a": torch.ones(3), "b": torch.arange(4)}
    fastload.save_file(old, dest)
    with safe_open(str(dest), "pt") as reader:
        fastload.save_file(new, dest)
        assert_same_tensors({"a": reader.get_tensor("a")}, old)
    assert_same_tensors(load_file(str(dest)), new)
    assert os.listdir(tmp_path) == ["m.safetensors"]


def test_overwrite_false_keeps_an_existing_file(tmp_path):
    dest = tmp_path / "m.safetensors"
    fastload.save_file({"a": torch.zeros(3)}, dest)
    with pytest.raises(fastload.DestinationExistsError) as e:
        fastload.save_file({"a": torch.ones(3)}, dest, overwrite=False)
    assert isinstance(e.value, FileExistsError) and e.value.filename == str(dest)
    assert torch.equal(load_file(str(dest))["a"], torch.zeros(3))
    assert os.listdir(tmp_path) == ["m.safetensors"]


def _not_a_dict():
    return "notadict"


def _bad_value():
    return {"good": torch.zeros(2), "test": {"some": "thing"}}


def _sparse():
    return {"a": torch.zeros(2), "s1": torch.zeros(2, 3).to_sparse(),
            "s2": torch.zeros(3).to_sparse()}  # fmt: skip


def _meta():
    return {"a": torch.zeros(2), "test": torch.zeros((10, 10), device="meta")}


def _non_contiguous():
    return {"test": torch.arange(6, dtype=torch.float32).reshape((1, 2, 3))[:, :, 1]}


def _overlapping():
    a = torch.arange(6, dtype=torch.float32).reshape((2, 3))
    return {"A": a, "B": a[1:]}


def _name_not_str():
    return {3: torch.zeros(2)}


@pytest.mark.parametrize(
    "tensors, same_text",
    [
        (_not_a_dict, "equal"),
        (_bad_value, "equal"),
        (_sparse, "equal"),
        (_meta, "starts"),
        (_non_contiguous, None),
        (_overlapping, None),
        (_name_not_str, None),
    ],
    ids=["not-a-dict", "not-a-tensor", "sparse", "meta", "non-contiguous", "overlap", "name"],
)
def test_invalid_tensors_raise_what_safetensors_save_file_raises(tmp_path, tensors, same_text):
    # Code written against safetensors catches fastload's errors: the same exception type (or a
    # subclass, so fastload's ConfigError still holds), and safetensors' words where its own
    # tests match them: whole for the mapping, a value and sparse tensors, torch's "Cannot copy
    # out of meta tensor" first for a meta tensor. Nothing is written.
    with pytest.raises(Exception) as ref:
        save_file(tensors(), str(tmp_path / "ref.safetensors"))
    with pytest.raises(Exception) as ours:
        fastload.save_file(tensors(), tmp_path / "ours.safetensors")
    assert isinstance(ours.value, type(ref.value)), (ours.value, ref.value)
    if same_text == "equal":
        assert str(ours.value) == str(ref.value)
    elif same_text == "starts":
        assert str(ours.value).startswith(str(ref.value)), (ours.value, ref.value)
    if isinstance(ours.value, ValueError):
        assert isinstance(ours.value, fastload.ConfigError) and ours.value.option == "tensors"
    assert os.listdir(tmp_path) == []


@pytest.fixture
def small_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path, "1m") as mnt:
        yield mnt


def test_a_full_disk_is_a_storage_error_and_leaves_nothing(small_tmpfs):
    dest = small_tmpfs / "big.safetensors"
    with pytest.raises(fastload.StorageError, match="No space left on device") as e:
        fastload.save_file({"w": torch.zeros(600_000)}, dest)  # 2.4 MB on a 1 MiB disk
    assert str(dest) in str(e.value)
    assert os.listdir(small_tmpfs) == []
    fastload.save_file({"w": torch.zeros(1000)}, dest)  # what fits is written
    assert torch.equal(load_file(str(dest))["w"], torch.zeros(1000))


KILLED_WRITER = """
import sys, fastload, torch
tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(int(sys.argv[2]))}
print("ready", flush=True)
fastload.save_file(tensors, sys.argv[1], **eval(sys.argv[3]))
print("done", flush=True)
"""


def run_and_kill(dest: str, count: int, watch, options: str = "{}") -> None:
    """Starts a writer of `count` 4 MiB tensors and kills it (SIGKILL) once `watch()` is true."""
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, dest, str(count), options],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 60
        while not watch():
            assert proc.poll() is None, "the writer ended before it was killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL


def test_a_killed_local_writer_publishes_nothing_and_a_rerun_succeeds(tmp_path):
    dest = tmp_path / "m.safetensors"

    def writing() -> bool:
        return any(p.name.endswith(".fastload-tmp") and p.stat().st_size > (8 << 20)
                   for p in tmp_path.iterdir())  # fmt: skip

    run_and_kill(str(dest), 64, writing)
    assert not dest.exists()
    leftovers = [p.name for p in tmp_path.iterdir()]
    assert len(leftovers) == 1 and leftovers[0].startswith(".m.safetensors.")
    tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(3)}
    fastload.save_file(tensors, dest)
    assert torch.equal(load_file(str(dest))["w2"], tensors["w2"])


# ---------------------------------------------------------------------------------------------
# S3 (SeaweedFS started by the session's fixture, moto for the multipart listing)

PART = 5 << 20


def big_tensors() -> dict[str, torch.Tensor]:
    """About 13 MiB: three parts of 5 MiB."""
    return {
        "embed": pattern((1024, 2048), torch.bfloat16, seed=1),
        "proj": pattern((1024, 1024), torch.float32, seed=2),
        "norm": pattern((333,), torch.float16, seed=3),
        "step": torch.tensor(5),
    }


def open_uploads(client, prefix: str) -> list[str]:
    found = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in found]


def keys(client, prefix: str) -> list[str]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listed)


@pytest.fixture(params=["seaweed", "moto"])
def s3(request, aws_env):
    server = request.getfixturevalue("seaweed" if request.param == "seaweed" else "moto_s3")
    aws_env(server)
    s3_server.ensure_bucket(server.client(), BUCKET)
    return server


moto_s3 = s3_server.moto_s3


def test_save_file_to_s3_uploads_safetensors_bytes_in_parts(s3, tmp_path, request):
    prefix = f"w/{request.node.callspec.id}/"
    tensors = big_tensors()
    save_file(tensors, str(tmp_path / "ref.safetensors"), metadata={"format": "pt"})
    uri = f"s3://{BUCKET}/{prefix}model.safetensors"
    fastload.save_file(tensors, uri, {"format": "pt"}, part_size=PART, memory_limit=2 * PART)
    client = s3.client()
    body = client.get_object(Bucket=BUCKET, Key=f"{prefix}model.safetensors")["Body"].read()
    assert body == (tmp_path / "ref.safetensors").read_bytes()
    head = client.head_object(Bucket=BUCKET, Key=f"{prefix}model.safetensors", PartNumber=1)
    assert head.get("PartsCount") == 3 or head["ContentLength"] == PART
    assert open_uploads(client, prefix) == []
    # A small file goes up in one PUT; both read back with fastload.
    fastload.save_file({"x": torch.arange(10)}, f"s3://{BUCKET}/{prefix}small.safetensors")
    got = fastload.load(uri)
    assert_same_tensors(got, tensors)
    assert keys(client, prefix) == [f"{prefix}model.safetensors", f"{prefix}small.safetensors"]
    for name in ("model.safetensors", "small.safetensors"):
        with pytest.raises(fastload.DestinationExistsError, match="already exists"):
            fastload.save_file(
                {"y": torch.zeros(1)}, f"s3://{BUCKET}/{prefix}{name}", overwrite=False
            )
    assert_same_tensors(fastload.load(uri), tensors)
    fastload.save_file({"y": torch.zeros(1)}, uri)  # replaced by default, as safetensors does
    assert set(fastload.load(uri)) == {"y"}
    assert open_uploads(client, prefix) == []


@pytest.fixture
def proxied(seaweed_fault_proxy):
    """Starts an HttpFaultProxy in front of SeaweedFS and points AWS_ENDPOINT_URL at it."""
    return seaweed_fault_proxy


def is_part_upload(method: str, headers: dict[str, str]) -> bool:
    return method == "PUT"


def test_parts_that_fail_with_500s_are_retried(proxied, seaweed):
    proxy = proxied(plan=[Fault("status", status=500)] * 3, match=is_part_upload)
    uri = f"s3://{BUCKET}/w/retried/model.safetensors"
    tensors = big_tensors()
    fastload.save_file(tensors, uri, part_size=PART)
    assert proxy.served["status"] == 3
    got = fastload.load(uri)
    assert_same_tensors(got, tensors)
    assert open_uploads(seaweed.client(), "w/retried/") == []


def test_a_store_that_keeps_failing_leaves_no_object_and_no_upload(proxied, seaweed):
    proxied(then=Fault("status", status=500), match=is_part_upload)
    uri = f"s3://{BUCKET}/w/failing/model.safetensors"
    with pytest.raises(fastload.StorageError) as e:
        fastload.save_file(big_tensors(), uri, part_size=PART, storage_options={
            "max_retries": "1", "retry_timeout": "5"})  # fmt: skip
    assert uri in str(e.value)
    client = seaweed.client()
    assert keys(client, "w/failing/") == []
    assert open_uploads(client, "w/failing/") == []


def test_refused_credentials_name_the_object(seaweed, aws_env, monkeypatch):
    aws_env(seaweed)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + SECRET_KEY)
    uri = f"s3://{BUCKET}/w/denied/model.safetensors"
    with pytest.raises(fastload.StorageError, match="access denied") as e:
        fastload.save_file(big_tensors(), uri, part_size=PART)
    assert uri in str(e.value) and SECRET_KEY not in str(e.value)
    assert keys(seaweed.client(), "w/denied/") == []


def test_a_killed_s3_writer_publishes_nothing_and_a_rerun_succeeds(seaweed, aws_env):
    aws_env(seaweed)
    client = seaweed.client()
    uri = f"s3://{BUCKET}/w/killed/model.safetensors"
    run_and_kill(
        uri, 16, lambda: open_uploads(client, "w/killed/") != [], f"{{'part_size': {PART}}}"
    )
    assert keys(client, "w/killed/") == []
    tensors = big_tensors()
    fastload.save_file(tensors, uri, part_size=PART)
    assert keys(client, "w/killed/") == ["w/killed/model.safetensors"]
    got = fastload.load(uri)
    assert_same_tensors(got, tensors)
    for key in open_uploads(client, "w/killed/"):  # the killed writer's (invisible) parts
        for u in client.list_multipart_uploads(Bucket=BUCKET, Prefix=key)["Uploads"]:
            client.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=u["UploadId"])


# ---------------------------------------------------------------------------------------------
# save: Hugging Face-style shards


def test_save_shards_as_huggingface_hub_splits_them(tmp_path):
    from huggingface_hub import split_torch_state_dict_into_shards

    state = {f"layers.{i}.w": pattern((100, 10 * (i + 1)), torch.float32, seed=i) for i in range(6)}
    state["huge"] = pattern((3000,), torch.float32, seed=9)  # larger than a shard: alone
    split = split_torch_state_dict_into_shards(state, max_shard_size="10KB")
    written = fastload.save(state, tmp_path / "m", max_shard_size="10KB")
    assert written == [*split.filename_to_tensors, "model.safetensors.index.json"]
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    for name, names in split.filename_to_tensors.items():
        got = load_file(str(tmp_path / "m" / name))
        assert sorted(got) == sorted(names)
    got = fastload.load(tmp_path / "m")
    assert_same_tensors(got, state)
    with pytest.raises(fastload.DestinationExistsError):
        fastload.save(state, tmp_path / "m", max_shard_size="10KB", overwrite=False)
    # One shard: model.safetensors, no index, as transformers writes it.
    assert fastload.save(state, tmp_path / "one") == ["model.safetensors"]
    assert os.listdir(tmp_path / "one") == ["model.safetensors"]


def test_save_writes_the_index_byte_for_byte_as_transformers_does(tmp_path):
    """The index's bytes are transformers' ``save_pretrained`` form of the same split: keys
    sorted, two-space indent, non-ASCII and control characters escaped, a final newline."""
    from huggingface_hub import split_torch_state_dict_into_shards

    names = ["b.w", "a.w", "caf\u00e9.w", "emoji\U0001f600", 'q"\\\n\x7f', "z" * 300]
    state = {n: pattern((64,), torch.float32, seed=i) for i, n in enumerate(names)}
    split = split_torch_state_dict_into_shards(state, max_shard_size=300)
    fastload.save(state, tmp_path / "m", max_shard_size=300)
    index = {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
    want = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
    assert (tmp_path / "m" / "model.safetensors.index.json").read_bytes() == want


@st.composite
def shared_storages(draw):
    """A state dict in a drawn order whose tensors are views of a few storages, as a fused qkv
    split in three or FSDP's flat parameters are (contiguous pieces, of drawn shapes, some empty,
    some bytes of a storage in no view), some tied (one view under two names), and empty tensors
    of their own (all at storage address 0); with the names `save` drops (each tie's later name)."""
    entries: list[tuple[str, torch.Tensor]] = []
    ties: list[tuple[str, str]] = []
    for s in range(draw(st.integers(1, 5))):
        dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]))
        pieces = draw(st.lists(st.integers(0, 48), min_size=1, max_size=5))
        base = pattern((sum(pieces) + draw(st.sampled_from([0, 0, 5])),), dtype, seed=s)
        offset = 0
        for j, n in enumerate(pieces):
            view = base[offset : offset + n]
            offset += n
            if n % 4 == 0 and draw(st.booleans()):
                view = view.view(4, n // 4)
            entries.append((f"s{s}.v{j}", view))
            if n and draw(st.integers(0, 4)) == 0:
                entries.append((f"s{s}.v{j}.tied", view))
                ties.append((f"s{s}.v{j}", f"s{s}.v{j}.tied"))
    for e in range(draw(st.integers(0, 2))):
        entries.append((f"empty{e}", torch.zeros((2, 0), dtype=torch.float16)))
    order = draw(st.permutations(entries))
    position = {name: i for i, (name, _) in enumerate(order)}
    dropped = {max(pair, key=position.__getitem__) for pair in ties}
    return dict(order), dropped


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=shared_storages(), limit_fraction=st.floats(0.0, 1.2))
def test_shards_of_shared_storages_are_huggingface_hubs(drawn, limit_fraction):
    # huggingface_hub sizes a storage once, whole, by its first tensor, and puts the storage's
    # later tensors into that tensor's shard: 11 views of one storage are one storage's worth in
    # one shard, not 11 storages' worth in 11 shards. Same files, weight map and total_size as
    # its split of the state dict `save` writes (tied names dropped), and each view's own bytes.
    from huggingface_hub import split_torch_state_dict_into_shards

    state, dropped = drawn
    kept = {k: v for k, v in state.items() if k not in dropped}
    everything = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for t in state.values()}.values())  # fmt: skip
    limit = max(1, int(everything * limit_fraction))
    split = split_torch_state_dict_into_shards(kept, max_shard_size=limit)
    with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tied names' warning
        written = fastload.save(state, folder, max_shard_size=limit)
        if split.is_sharded:
            assert written == [*split.filename_to_tensors, "model.safetensors.index.json"]
            index = json.loads(Path(folder, "model.safetensors.index.json").read_text())
            assert index == {"metadata": split.metadata, "weight_map": split.tensor_to_filename}
        else:
            assert written == ["model.safetensors"]
        for name, names in split.filename_to_tensors.items():
            assert sorted(load_file(os.path.join(folder, name))) == sorted(names)
        assert_same_tensors(fastload.load(folder), kept)


def test_save_a_tied_llama_loads_in_transformers(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    state = model.state_dict()
    assert state["lm_head.weight"].data_ptr() == state["model.embed_tokens.weight"].data_ptr()
    with pytest.warns(UserWarning, match="lm_head.weight"):
        files = fastload.save(state, tmp_path / "llama", max_shard_size="40KB")
    assert files[-1] == "model.safetensors.index.json" and len(files) > 2
    config.save_pretrained(tmp_path / "llama")
    loaded = LlamaForCausalLM.from_pretrained(tmp_path / "llama")
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    # Overlapping tensors that are not the same view cannot be written as two.
    base = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="share memory without being the same tensor"):
        fastload.save({"a": base, "b": base[1:]}, tmp_path / "bad")
    assert not (tmp_path / "bad").exists()


def test_save_shards_to_s3_with_the_index_last(seaweed, aws_env):
    aws_env(seaweed)
    state = {f"w{i}": pattern((256, 256), torch.float32, seed=i) for i in range(4)}
    uri = f"s3://{BUCKET}/w/sharded/"
    files = fastload.save(state, uri, max_shard_size="300KB")
    assert files == [f"model-0000{i}-of-00004.safetensors" for i in (1, 2, 3, 4)] + [
        "model.safetensors.index.json"
    ]
    assert keys(seaweed.client(), "w/sharded/") == [f"w/sharded/{f}" for f in sorted(files)]
    got = fastload.load(uri)
    assert_same_tensors(got, state)
    with pytest.raises(fastload.DestinationExistsError, match="model-00001-of-00004"):
        fastload.save(state, uri, max_shard_size="300KB", overwrite=False)
    # Overwritten (the default) by a single file: the earlier shards and index are deleted.
    assert fastload.save({"x": torch.arange(3)}, uri) == ["model.safetensors"]
    assert keys(seaweed.client(), "w/sharded/") == ["w/sharded/model.safetensors"]
    assert_same_tensors(fastload.load(uri), {"x": torch.arange(3)})


INTERRUPTED_WRITER = """
import os, signal, sys, fastload, torch
from fastload import _write
# Ctrl-C raises KeyboardInterrupt even where the test runs with SIGINT ignored (a shell's
# background job), which the child would inherit.
signal.signal(signal.SIGINT, signal.default_int_handler)
tensors = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(4)}
part = 5 << 20
print("ready", flush=True)
try:
    if sys.argv[2] == "save_file":
        fastload.save_file(tensors, sys.argv[1], part_size=part)
    else:
        # One part in flight: the third tensor's write waits for the stalled first part.
        names = list(tensors)
        specs = [_write._spec(n, tensors[n]) for n in names]
        writer = fastload._fastload.FileWriter(
            sys.argv[1], specs, part_size=part, memory_limit=part)
        for i in writer.order:
            writer.write(tensors[names[i]])
except KeyboardInterrupt:
    if sys.argv[2] == "drop":
        del writer  # the interrupted write's worker may still hold the writer
    print("interrupted", flush=True)
    # Straight out, without the interpreter's teardown (seconds of torch's garbage collection on
    # a loaded machine): whatever the error path left for later is never done.
    os._exit(3)
print("done", flush=True)
"""


@pytest.mark.parametrize("how", ["save_file", "drop"])
def test_ctrl_c_aborts_the_upload(proxied, seaweed, how):
    # Part uploads hang (no response head) until Ctrl-C. save_file aborts the upload before the
    # KeyboardInterrupt leaves it; a FileWriter dropped right after an interrupted write aborts it
    # in its drop, which must not wait for the GIL it holds (it waited ABORT_ON_DROP, 30 s).
    proxy = proxied(then=Fault("stall_head", seconds=60), match=is_part_upload)
    uri = f"s3://{BUCKET}/w/interrupted-{how}/model.safetensors"
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_WRITER, uri, how],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 60
        while proxy.served.get("stall_head", 0) == 0:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        # A bound on a hang, well under the 60 s stall and ABORT_ON_DROP: the abort itself takes
        # well under a second, and the child skips the interpreter's teardown.
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, out) == (3, b"interrupted\n"), err.decode()[-2000:]
    client = seaweed.client()
    assert keys(client, f"w/interrupted-{how}/") == []
    assert open_uploads(client, f"w/interrupted-{how}/") == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_tensors_are_written_as_their_host_copies(tmp_path):
    tensors = {k: v.to("cuda") for k, v in all_dtypes().items()}
    save_file({k: v.cpu() for k, v in tensors.items()}, str(tmp_path / "ref.safetensors"))
    fastload.save_file(tensors, tmp_path / "ours.safetensors")
    ref = (tmp_path / "ref.safetensors").read_bytes()
    assert (tmp_path / "ours.safetensors").read_bytes() == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_gpu_tensors_produced_by_kernels_are_saved_bitwise(tmp_path):
    # Tensors whose kernels are still queued on torch's current stream (a side stream here) when
    # save_file starts: its device-to-host copies must wait for them. Small memory_limit: many
    # 1 MiB blocks through the page-locked ring.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        g = torch.Generator(device="cuda").manual_seed(0)
        a = torch.randn(2048, 2048, device="cuda", generator=g)
        b = torch.randn(2048, 2048, device="cuda", generator=g)
        for _ in range(8):
            a = (a @ b).tanh_()
        tensors = {
            "mm.f32": a,
            "mm.bf16": (a @ b).to(torch.bfloat16),
            "bias": b[0].clone(),
            "cpu": torch.arange(1000, dtype=torch.int32),
            "empty": torch.empty(0, 3, device="cuda"),
        }
        fastload.save_file(tensors, tmp_path / "ours.safetensors", memory_limit="4MiB")
        fastload.save(tensors, tmp_path / "saved", max_shard_size="10MB", memory_limit="4MiB")
    torch.cuda.synchronize()
    # A view that is not contiguous is refused as on the CPU (nothing written).
    with pytest.raises(fastload.ConfigError, match="not contiguous"):
        fastload.save_file({"t": a.t()}, tmp_path / "view.safetensors")
    assert not (tmp_path / "view.safetensors").exists()
    host = {k: v.cpu() for k, v in tensors.items()}
    save_file(host, str(tmp_path / "ref.safetensors"))
    ours = (tmp_path / "ours.safetensors").read_bytes()
    assert ours == (tmp_path / "ref.safetensors").read_bytes()
    loaded: dict[str, torch.Tensor] = {}
    for f in sorted((tmp_path / "saved").glob("model-*.safetensors")):
        loaded.update(load_file(f))
    assert sorted(loaded) == sorted(host)
    for k, v in host.items():
        assert loaded[k].dtype == v.dtype, k
        assert torch.equal(raw_bytes(loaded[k]), raw_bytes(v)), k


def test_a_new_save_replaces_every_file_of_the_earlier_one(tmp_path):
    folder = tmp_path / "m"
    three = {f"w{i}": pattern((2500,), torch.float32, seed=i) for i in range(3)}
    fastload.save(three, folder, max_shard_size="10KB")
    (folder / "config.json").write_text("{}")
    # A single file beside the earlier shards' index would be shadowed by it: refused.
    one = {"x": torch.arange(4)}
    with pytest.raises(fastload.DestinationExistsError, match=r"model-00001-of-00003"):
        fastload.save(one, folder, overwrite=False)
    assert fastload.save(one, folder, overwrite=True) == ["model.safetensors"]
    assert sorted(os.listdir(folder)) == ["config.json", "model.safetensors"]
    assert_same_tensors(fastload.load(folder), one)
    two = {f"w{i}": pattern((2500,), torch.float32, seed=i) for i in range(2)}
    fastload.save(two, folder, max_shard_size="10KB", overwrite=True)
    assert sorted(os.listdir(folder)) == [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    assert_same_tensors(fastload.load(folder), two)


def test_a_writer_dropped_unfinished_aborts_its_upload(seaweed, aws_env):
    aws_env(seaweed)
    uri = f"s3://{BUCKET}/w/dropped/model.safetensors"
    writer = fastload._fastload.FileWriter(uri, [("a", "F32", [4 << 20])], part_size=PART)
    writer.write(torch.zeros(4 << 20))  # 16 MiB: three parts started
    client = seaweed.client()
    assert open_uploads(client, "w/dropped/") == ["w/dropped/model.safetensors"]
    del writer
    assert open_uploads(client, "w/dropped/") == []
    assert keys(client, "w/dropped/") == []


@pytest.mark.parametrize("size", [1000, 3 << 20], ids=["one-put", "multipart"])
def test_an_object_created_while_writing_is_not_replaced(s3, size, request):
    # Created by someone else after the writer's first check: the one PUT is conditional
    # (If-None-Match), a multipart upload is checked again before it completes.
    key = f"w/race-{request.node.callspec.id}/model.safetensors"
    uri = f"s3://{BUCKET}/{key}"
    writer = fastload._fastload.FileWriter(uri, [("a", "F32", [size])], part_size=PART)
    writer.write(torch.zeros(size))
    client = s3.client()
    client.put_object(Bucket=BUCKET, Key=key, Body=b"theirs")
    with pytest.raises(fastload.DestinationExistsError):
        writer.finish()
    assert client.get_object(Bucket=BUCKET, Key=key)["Body"].read() == b"theirs"
    assert open_uploads(client, key) == []
