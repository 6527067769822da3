"""`fastload copy` / `fastload.copy`: a Hub repo, an object prefix or a local folder to any store,
against the mock Hub (servers/hub.py) and SeaweedFS: every file byte for byte, the Hub's digests
checked in flight (a poisoned blob aborts that file), reruns skipping verified copies, existing
files refused, hostile names refused, failing parts retried, refused credentials named, a kill -9
followed by a rerun, and a group of two ranks splitting the files."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fastload
import pytest
import torch
from helpers import assert_same_tensors, gloo_threads
from servers import s3 as s3_server
from servers.hub import MockHub, lfs_sha256
from servers.s3 import BUCKET, SECRET_KEY, Fault, HttpFaultProxy, rendezvous_port

aws_env = s3_server.aws_env
s3 = s3_server.s3_client

HERE = Path(__file__).resolve().parent
PYTHON = str(HERE.parent / "python")
PART = 5 << 20
REPO = "org/model"


def saved_checkpoint(folder: Path, shards: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Six 64x64 float32 tensors saved to `folder` by fastload.save: one model.safetensors
    (`shards` 1), or 3 shards of 2 tensors (`shards` 3)."""
    torch.manual_seed(seed)
    sd = {f"layer.{i}.weight": torch.randn(64, 64) for i in range(6)}
    fastload.save(sd, folder, max_shard_size="1MB" if shards == 1 else 40_000)
    return sd


def files_of(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


def model_tree(sharded_dir: Path) -> dict[str, bytes]:
    """A model folder as the Hub holds one: shards and index, configs, tokenizer, chat template,
    a LoRA adapter, and one file large enough for a multipart upload."""
    tree = files_of(sharded_dir)
    tree.update(
        {
            "config.json": b'{"model_type": "llama"}',
            "generation_config.json": b'{"max_length": 32}',
            "tokenizer.json": b'{"version": "1.0"}',
            "tokenizer_config.json": b"{}",
            "chat_template.jinja": b"{{ messages }}",
            "adapter/adapter_config.json": b'{"r": 8}',
            "adapter/adapter_model.safetensors": next(
                v for k, v in sorted(tree.items()) if k.endswith(".safetensors")
            ),
            "big.bin": torch.randint(0, 255, (12 << 20,), dtype=torch.uint8).numpy().tobytes(),
        }
    )
    return tree


@pytest.fixture(scope="module")
def hub(sharded_dir):
    hub = MockHub()
    hub.tree = model_tree(sharded_dir)
    hub.add(REPO, hub.tree)
    hub.add("org/hostile", {"config.json": b"{}", "a/%2e%2e/x.json": b"{}"})
    hub.add("org/parent", {"config.json": b"{}", "../x.json": b"{}"})
    yield hub
    hub.close()


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.setenv("HF_ENDPOINT", hub.base)
    yield
    hub.faults.clear()
    hub.storage.faults.clear()
    hub.storage.poison.clear()


def objects(client, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {
        o["Key"][len(prefix) :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
        for o in listed
    }


def open_uploads(client, prefix: str) -> list[str]:
    found = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in found]


def test_copy_a_hub_repo_to_s3_verifies_and_a_rerun_skips_it(hub, env, s3, sharded_dir):
    prefix = "copy/hub/org/model/"
    dst = f"s3://{BUCKET}/{prefix}"
    out = fastload.copy(f"hf://{REPO}", dst, part_size=PART, block_size="1MiB", progress=False)
    assert sorted(out["copied"]) == sorted(dst + k for k in hub.tree)
    assert out["bytes"] == sum(map(len, hub.tree.values()))
    assert objects(s3, prefix) == hub.tree
    assert open_uploads(s3, prefix) == []
    # The big file went up in parts; each object records its source's sha256 (LFS) or blob id.
    head = s3.head_object(Bucket=BUCKET, Key=prefix + "big.bin", PartNumber=1)
    assert head["ContentLength"] == PART
    meta = s3.head_object(Bucket=BUCKET, Key=prefix + "big.bin")["Metadata"]
    assert meta == {"fastload-source": "sha256:" + lfs_sha256(hub.tree["big.bin"])}
    # The copy loads as the original does.
    assert_same_tensors(fastload.load(dst), fastload.load(str(sharded_dir)))
    gets = len(hub.requests(hub.storage))
    again = fastload.copy(f"hf://{REPO}", dst, progress=False)
    assert again["copied"] == [] and sorted(again["skipped"]) == sorted(out["copied"])
    assert len(hub.requests(hub.storage)) == gets  # nothing read again


def test_a_poisoned_hub_blob_aborts_that_file_and_names_it(hub, env, s3):
    prefix = "copy/poison/"
    data = hub.tree["big.bin"]
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    hub.storage.poison[lfs_sha256(data)] = bytes(bad)
    with pytest.raises(fastload.FastloadError, match=r"big\.bin") as e:
        fastload.copy(
            f"hf://{REPO}/big.bin", f"s3://{BUCKET}/{prefix}", part_size=PART, progress=False
        )
    assert "sha256" in str(e.value)
    assert objects(s3, prefix) == {}
    assert open_uploads(s3, prefix) == []


def test_a_poisoned_blob_in_a_whole_repo_copy_stops_the_files_beside_it(hub, env, s3):
    # Several files are in flight when big.bin's digest fails: the copy raises naming big.bin,
    # and no file is left half-uploaded (the others in flight are aborted or completed whole).
    prefix = "copy/poison-repo/"
    data = hub.tree["big.bin"]
    bad = bytearray(data)
    bad[-1] ^= 0xFF
    hub.storage.poison[lfs_sha256(data)] = bytes(bad)
    with pytest.raises(fastload.FastloadError, match=r"big\.bin") as e:
        fastload.copy(f"hf://{REPO}", f"s3://{BUCKET}/{prefix}", part_size=PART, progress=False)
    assert "sha256" in str(e.value)
    stored = objects(s3, prefix)
    assert "big.bin" not in stored
    assert all(stored[k] == hub.tree[k] for k in stored)
    assert open_uploads(s3, prefix) == []


def test_an_existing_different_file_is_refused_unless_overwrite(hub, env, tmp_path):
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "config.json").write_bytes(b"something else")
    with pytest.raises(fastload.DestinationExistsError, match=r"config\.json"):
        fastload.copy(f"hf://{REPO}/config.json", str(dst), progress=False)
    assert (dst / "config.json").read_bytes() == b"something else"
    fastload.copy(f"hf://{REPO}/config.json", str(dst), overwrite=True, progress=False)
    assert (dst / "config.json").read_bytes() == hub.tree["config.json"]
    # A local copy made by something else (no record of its source) is verified by its digest.
    (dst / "tokenizer.json").write_bytes(hub.tree["tokenizer.json"])
    out = fastload.copy(f"hf://{REPO}/tokenizer.json", str(dst), progress=False)
    assert out["skipped"] == [str(dst / "tokenizer.json")]


@pytest.mark.parametrize("to", ["local", "s3"])
def test_an_unverified_copy_is_checked_again_and_overwrite_copies_again(
    hub, env, tmp_path, request, to
):
    """`verify=False` from a Hub whose storage serves corrupted bytes records the copy as
    unchecked, not by the Hub's sha256: a later `verify=True` checks it again (and fails while
    the bytes are still wrong) and repairs it once they are right; `overwrite=True` copies a file
    again even when it is a verified copy."""
    name = "model-00001-of-00003.safetensors"
    data = hub.tree[name]
    sha = lfs_sha256(data)
    bad = bytearray(data)
    bad[len(bad) // 2] ^= 0xFF
    if to == "local":
        folder = tmp_path / "out"
        folder.mkdir()
        dst, dst_file = str(folder), str(folder / name)
        try:
            os.setxattr(folder, "user.fastload_probe", b"1")
        except OSError:
            pytest.skip("no user extended attributes on this filesystem")

        def stored() -> tuple[bytes, str]:
            record = os.getxattr(dst_file, "user.fastload_source").decode()
            return Path(dst_file).read_bytes(), record

    else:
        s3 = request.getfixturevalue("s3")
        prefix = f"copy/unverified-{tmp_path.name}/"
        dst, dst_file = f"s3://{BUCKET}/{prefix}", f"s3://{BUCKET}/{prefix}{name}"

        def stored() -> tuple[bytes, str]:
            got = s3.get_object(Bucket=BUCKET, Key=prefix + name)
            return got["Body"].read(), got["Metadata"]["fastload-source"]

    def copy(**kw):
        return fastload.copy(f"hf://{REPO}/{name}", dst, progress=False, **kw)

    hub.storage.poison[sha] = bytes(bad)
    assert copy(verify=False)["copied"] == [dst_file]
    body, record = stored()
    assert body == bytes(bad) and record != f"sha256:{sha}", record
    # A rerun that does not verify resumes: the unchecked copy is this source's.
    assert copy(verify=False)["skipped"] == [dst_file]
    # Verifying checks it again: the corrupted bytes fail, nothing is replaced or skipped.
    with pytest.raises(fastload.FastloadError, match="sha256"):
        copy()
    assert stored()[0] == bytes(bad)
    hub.storage.poison.clear()
    assert copy()["copied"] == [dst_file]
    assert stored() == (data, f"sha256:{sha}")
    assert copy()["skipped"] == [dst_file]
    # Overwriting copies again, whatever is there.
    gets = len(storage_gets(hub))
    assert copy(overwrite=True)["copied"] == [dst_file]
    assert len(storage_gets(hub)) > gets
    assert stored() == (data, f"sha256:{sha}")


def storage_gets(hub) -> list:
    return [r for r in hub.requests(hub.storage) if r[0] == "GET"]


def test_hostile_names_in_the_source_listing_write_nothing(hub, env, tmp_path):
    dst = tmp_path / "out" / "in"
    for repo, name in (("org/hostile", "a/%2e%2e/x.json"), ("org/parent", "../x.json")):
        with pytest.raises(fastload.FastloadError, match="nothing was copied") as e:
            fastload.copy(f"hf://{repo}", str(dst), progress=False)
        assert repr(name).replace("'", '"') in str(e.value)
        assert not (tmp_path / "out").exists()


def test_cli_copies_an_s3_prefix_to_a_local_folder_and_help_is_accurate(hub, env, s3, tmp_path):
    prefix = "copy/cli/"
    fastload.copy(f"hf://{REPO}", f"s3://{BUCKET}/{prefix}", part_size=PART, progress=False)
    env_vars = {**os.environ, "PYTHONPATH": PYTHON}
    run = [sys.executable, "-c", "import fastload._cli as c; c.main()"]
    done = subprocess.run(
        [*run, "copy", f"s3://{BUCKET}/{prefix}", str(tmp_path / "m"), "--block-size", "1MiB"],
        env=env_vars,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"copied {len(hub.tree)} files" in done.stderr
    assert files_of(tmp_path / "m") == hub.tree
    again = subprocess.run(
        [*run, "copy", f"s3://{BUCKET}/{prefix}", str(tmp_path / "m")],
        env=env_vars,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0 and f"skipped {len(hub.tree)} files" in again.stderr
    helped = subprocess.run([*run, "copy", "--help"], env=env_vars, capture_output=True, text=True)
    for flag in ("--overwrite", "--no-verify", "--concurrency", "--block-size", "--part-size"):
        assert flag in helped.stdout


def test_parts_failing_with_500s_are_retried_and_each_carries_a_checksum(
    hub, env, s3, seaweed, monkeypatch
):
    port = int(seaweed.endpoint.rsplit(":", 1)[1])
    puts: list[dict[str, str]] = []

    def part(method: str, headers: dict[str, str]) -> bool:
        if method == "PUT":
            puts.append(headers)
        return method == "PUT"

    proxy = HttpFaultProxy(("127.0.0.1", port), plan=[Fault("status", status=500)] * 3, match=part)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        prefix = "copy/retried/"
        fastload.copy(f"hf://{REPO}/big.bin", f"s3://{BUCKET}/{prefix}", part_size=PART,
                      progress=False)  # fmt: skip
        assert proxy.served["status"] == 3
    finally:
        proxy.close()
    assert objects(s3, prefix) == {"big.bin": hub.tree["big.bin"]}
    assert open_uploads(s3, prefix) == []
    # Every part (retries included) carried its CRC64NVME, which SeaweedFS checks on receipt: a
    # part whose bytes do not match is refused (BadDigest), so a corrupted part never lands.
    assert len(puts) == 3 + 3  # three parts of big.bin, three refused tries
    assert all(len(base64.b64decode(h["x-amz-checksum-crc64nvme"])) == 8 for h in puts)
    upload = s3.create_multipart_upload(Bucket=BUCKET, Key=prefix + "x", ChecksumAlgorithm="SHA256")
    wrong = base64.b64encode(hashlib.sha256(b"other").digest()).decode()
    with pytest.raises(Exception, match="BadDigest"):
        s3.upload_part(Bucket=BUCKET, Key=prefix + "x", UploadId=upload["UploadId"], PartNumber=1,
                       Body=b"data", ChecksumSHA256=wrong)  # fmt: skip
    s3.abort_multipart_upload(Bucket=BUCKET, Key=prefix + "x", UploadId=upload["UploadId"])
    # The object keeps a CRC64NVME of its whole content (what verify=True checks on reads).
    head = s3.head_object(Bucket=BUCKET, Key=prefix + "big.bin", ChecksumMode="ENABLED")
    headers = head["ResponseMetadata"]["HTTPHeaders"]
    assert "x-amz-checksum-crc64nvme" in headers
    assert headers.get("x-amz-checksum-type") == "FULL_OBJECT"


def test_refused_credentials_name_the_destination(hub, env, s3, monkeypatch):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-" + SECRET_KEY)
    dst = f"s3://{BUCKET}/copy/denied/"
    with pytest.raises(fastload.StorageError, match="access denied") as e:
        fastload.copy(f"hf://{REPO}/config.json", dst, progress=False)
    # Its first request lists the destination (for an earlier checkpoint of another layout),
    # so the folder is named: the destination, not the source.
    assert str(e.value).startswith(dst) and SECRET_KEY not in str(e.value)


KILLED = """
import sys, fastload
print("ready", flush=True)
fastload.copy(sys.argv[1], sys.argv[2], part_size=5 << 20, concurrency=1, block_size=1 << 20,
              progress=False)
print("done", flush=True)
"""


def test_a_copy_killed_midway_is_finished_by_a_rerun(hub, env, s3, tmp_path):
    prefix = "copy/killed/"
    dst = f"s3://{BUCKET}/{prefix}"
    hub.storage.rate = 4 << 20  # slow enough to be killed midway
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED, f"hf://{REPO}", dst],
        stdout=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": PYTHON},
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 60
        # big.bin (the largest file, started first) is going up, and files copied beside it
        # were published.
        while not (open_uploads(s3, prefix) and objects(s3, prefix)):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=30)
        hub.storage.rate = 0
    assert "big.bin" not in objects(s3, prefix)  # nothing partial is visible
    published = set(objects(s3, prefix))
    assert published and published < set(hub.tree)
    out = fastload.copy(f"hf://{REPO}", dst, part_size=PART, progress=False)
    assert {k[len(dst) :] for k in out["skipped"]} == published
    assert objects(s3, prefix) == hub.tree
    for key in open_uploads(s3, prefix):  # the killed copy's invisible parts
        for u in s3.list_multipart_uploads(Bucket=BUCKET, Prefix=key)["Uploads"]:
            s3.abort_multipart_upload(Bucket=BUCKET, Key=key, UploadId=u["UploadId"])


def test_files_are_copied_side_by_side_and_the_index_before_its_shards(
    hub, env, s3, seaweed, monkeypatch
):
    # The order in which SeaweedFS receives the requests (the relay's log): another file's
    # requests arrive while big.bin's multipart upload is open (from its creation to its
    # completion), and the index before any shard's first request (stopped at any point, the
    # copy leaves an index naming shards not yet there, never shards alone).
    port = int(seaweed.endpoint.rsplit(":", 1)[1])
    prefix = "copy/overlap/"
    hub.storage.rate = 8 << 20  # big.bin's 12 MiB take a while; the small files are not LFS
    with HttpFaultProxy(("127.0.0.1", port), match=lambda m, h: False) as proxy:
        monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
        try:
            out = fastload.copy(f"hf://{REPO}", f"s3://{BUCKET}/{prefix}", part_size=PART,
                                progress=False)  # fmt: skip
        finally:
            hub.storage.rate = 0
        log = [(method, target.split("?")[0].split(prefix, 1)[-1], target)
               for method, target, _ in proxy.log if prefix in target]  # fmt: skip
    assert objects(s3, prefix) == hub.tree and len(out["copied"]) == len(hub.tree)
    # big.bin's multipart upload: created (POST ?uploads) ... completed (POST ?uploadId=).
    big = [i for i, (m, key, _) in enumerate(log) if key == "big.bin" and m == "POST"]
    assert len(big) == 2
    beside = {key for _, key, _ in log[big[0] : big[-1]]} - {"big.bin"}
    assert beside, log
    shards = [k for k in hub.tree if k.startswith("model-")]
    index = next(
        i for i, (m, key, _) in enumerate(log) if m == "PUT" and key.endswith(".index.json")
    )
    for shard in shards:
        assert min(i for i, (_, key, _) in enumerate(log) if key == shard) > index, log


INTERRUPTED = """
import os, signal, sys, fastload
# Ctrl-C raises KeyboardInterrupt even where the test runs with SIGINT ignored (a shell's
# background job), which the child would inherit.
signal.signal(signal.SIGINT, signal.default_int_handler)
print("ready", flush=True)
try:
    fastload.copy(sys.argv[1], sys.argv[2], part_size=5 << 20, progress=False)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    os._exit(3)  # no teardown: what the copy left undone when it raised stays undone
print("done", flush=True)
"""


def test_ctrl_c_aborts_the_uploads_of_the_files_in_flight(hub, env, s3):
    prefix = "copy/interrupted/"
    dst = f"s3://{BUCKET}/{prefix}"
    # Slow enough (12 s for big.bin) that the copy is still running when the signal lands.
    hub.storage.rate = 1 << 20
    proc = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED, f"hf://{REPO}", dst],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, "PYTHONPATH": PYTHON},
    )
    try:
        assert proc.stdout.readline() == b"ready\n"
        deadline = time.monotonic() + 60
        while not open_uploads(s3, prefix):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.01)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        hub.storage.rate = 0
    assert (proc.returncode, out) == (3, b"interrupted\n"), err.decode()[-2000:]
    assert open_uploads(s3, prefix) == []
    assert "big.bin" not in objects(s3, prefix)


GROUP_COPIER = """
import os, signal, sys, time
import torch.distributed as dist
import fastload
signal.signal(signal.SIGINT, signal.default_int_handler)
rank, port, src, dst, how = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
calls, gather = 0, dist.all_gather_object
def counted(*args, **kwargs):
    global calls
    calls += 1
    print("exchange", calls, flush=True)
    return gather(*args, **kwargs)
dist.all_gather_object = counted
try:
    fastload.copy(src, dst, progress=False, overwrite=how == "overwrite")
    print("done", flush=True)
except KeyboardInterrupt as e:
    print("interrupted", getattr(e, fastload._fastload.UNANSWERED, False), calls, flush=True)
    # Lives on a while after the Ctrl-C (a REPL, a server), its group too.
    time.sleep(float(sys.argv[6]))
except fastload.FastloadError as e:
    notes = " ".join(getattr(e, "__notes__", []))
    print("raised", type(e).__name__, str(e).replace(chr(10), " "), notes, flush=True)
os._exit(0)
"""


@contextlib.contextmanager
def group_copy(hub, dst: Path, how: str, linger: float):
    """Two processes (gloo) copying the mock Hub's repo to `dst` at 1 MiB/s (`how`: "resume" or
    "overwrite"); an interrupted one prints so and lives `linger` seconds more. Each prints
    "exchange N" as it enters its N-th collective."""
    hub.storage.rate = 1 << 20
    rdv = str(rendezvous_port())
    procs = [subprocess.Popen([sys.executable, "-c", GROUP_COPIER, str(r), rdv, f"hf://{REPO}",
                               str(dst), how, str(linger)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, env={**os.environ, "PYTHONPATH": PYTHON})
             for r in range(2)]  # fmt: skip
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
        hub.storage.rate = 0


def test_ctrl_c_on_one_rank_of_a_group_copy_reaches_the_others_at_once(hub, env, tmp_path):
    # Rank 0 copies big.bin (12 s at this rate), rank 1 the small files, then waits to hear how
    # the group's copy ended. A Ctrl-C on rank 0 alone: rank 0 raises KeyboardInterrupt and
    # rank 1 a FastloadError saying so, at once. Before, rank 0 left without telling the group,
    # and rank 1 waited for as long as rank 0's process lived (or the group's timeout).
    dst = tmp_path / "dst"
    with group_copy(hub, dst, "resume", 300) as procs:
        assert procs[0].stdout.readline() == b"exchange 1\n"  # the plan agreed
        deadline = time.monotonic() + 60
        while not list(dst.glob(".big.bin*")):  # rank 0's temporary file: big.bin under way
            assert time.monotonic() < deadline and procs[0].poll() is None
            time.sleep(0.01)
        procs[0].send_signal(signal.SIGINT)
        # The copy's own exchanges were over: rank 0 joins the group's gather of the errors.
        assert procs[0].stdout.readline() == b"exchange 2\n"
        assert procs[0].stdout.readline() == b"interrupted False 2\n"
        out, err = procs[1].communicate(timeout=60)
    assert procs[1].returncode == 0, err.decode()[-2000:]
    said = out.decode().splitlines()[-1]
    assert said.startswith("raised FastloadError copy interrupted (KeyboardInterrupt)"), (
        out.decode() + err.decode()[-2000:]
    )
    if sys.version_info >= (3, 11):  # the note saying whose error it is (add_note)
        assert "(raised on rank 0 of 2" in said
    assert not (dst / "big.bin").exists()


def test_ctrl_c_in_a_group_copys_exchange_runs_no_other_collective(hub, env, tmp_path):
    # An overwriting group copy: rank 1 stages its small files, then waits in the group's second
    # exchange (every rank staged?) for rank 0, still on big.bin. A Ctrl-C there is raised once
    # that collective returns, so rank 1 leaves the copy's exchanges part way: rank 0 goes on to
    # the next one. A gather run by rank 1 now would meet it and be read as rank 1's answer
    # there; so none is run (the KeyboardInterrupt says so), and rank 0 hears of rank 1 when its
    # process exits, then undoes its part: nothing of the copy is left.
    dst = tmp_path / "dst"
    with group_copy(hub, dst, "overwrite", 5) as procs:
        lines = [procs[1].stdout.readline() for _ in range(2)]
        assert lines == [b"exchange 1\n", b"exchange 2\n"], lines
        procs[1].send_signal(signal.SIGINT)
        assert procs[1].stdout.readline() == b"interrupted True 2\n"
        out, err = procs[0].communicate(timeout=120)
    assert procs[0].returncode == 0, err.decode()[-2000:]
    assert out.decode().splitlines()[-1].startswith("raised "), out.decode() + err.decode()[-2000:]
    assert not list(dst.glob("*.safetensors")) and not (dst / "big.bin").exists()


def _rank(rank: int, world: int, src: str, dst: str, port: str, outs: str) -> None:
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    try:
        out = fastload.copy(src, dst, process_group="default", progress=False)
        Path(outs, f"{rank}.json").write_text(json.dumps(out))
    finally:
        dist.destroy_process_group()


def test_two_ranks_split_the_files(tmp_path):
    import json

    import torch.multiprocessing as mp

    src = tmp_path / "src"
    for i, size in enumerate([3 << 20, 2 << 20, 1 << 20, 10, 20]):
        (src / "d").mkdir(parents=True, exist_ok=True)
        (src / "d" / f"f{i}").write_bytes(
            hashlib.sha256(str(i).encode()).digest() * (size // 32 + 1)
        )
    port = str(rendezvous_port())
    dst = tmp_path / "dst"
    mp.start_processes(_rank, args=(2, str(src), str(dst), port, str(tmp_path)), nprocs=2,
                       start_method="spawn")  # fmt: skip
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    mine = [set(o["copied"]) for o in outs]
    assert mine[0] and mine[1] and not (mine[0] & mine[1])
    assert files_of(dst) == files_of(src)


def _rank_watching(rank: int, world: int, src: str, dst: str, port: str, outs: str) -> None:
    """`_rank`, recording what the destination holds when each of the group's exchanges returns."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    seen, gather = [], dist.all_gather_object

    def watched(*args, **kwargs):
        out = gather(*args, **kwargs)
        seen.append(sorted(os.listdir(dst)) if os.path.isdir(dst) else [])
        return out

    dist.all_gather_object = watched
    try:
        out = fastload.copy(src, dst, process_group="default", progress=False)
    finally:
        dist.destroy_process_group()
    Path(outs, f"{rank}.json").write_text(json.dumps({**out, "seen": seen}))


def test_a_resuming_group_publishes_the_index_before_any_shard(tmp_path):
    # Rank 0 copies the index before the ranks agree on their plan (their first exchange), so
    # when that returns on either rank the index is there already: stopped at any point, the
    # group leaves an index naming shards not yet there (a load raises), never shards alone.
    import json

    import torch.multiprocessing as mp

    src, dst = tmp_path / "src", tmp_path / "dst"
    sd = saved_checkpoint(src, 3)
    index = "model.safetensors.index.json"
    mp.start_processes(_rank_watching, args=(2, str(src), str(dst), str(rendezvous_port()),
                       str(tmp_path)), nprocs=2, start_method="spawn")  # fmt: skip
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert all(index in o["seen"][0] for o in outs), outs
    assert str(dst / index) in outs[0]["copied"], outs
    mine = [set(o["copied"]) for o in outs]
    assert mine[0] and mine[1] and not (mine[0] & mine[1]), outs
    assert files_of(dst) == files_of(src)
    assert_same_tensors(fastload.load(str(dst)), sd)


def _split_rank(rank: int, world: int, src: str, dst: str, port: str, outs: str,
                endpoints: list[str]) -> None:  # fmt: skip
    import json
    import threading

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)  # fmt: skip
    # Every collective of the copy is run by the thread that called it (none from a thread of
    # fastload's, where it could be left in flight, or meet another CUDA device).
    threads = set()
    all_gather_object = dist.all_gather_object

    def recorded(*args, **kwargs):
        threads.add(threading.current_thread().name)
        return all_gather_object(*args, **kwargs)

    dist.all_gather_object = recorded
    kept = None
    try:
        out = fastload.copy(src, dst, process_group="default", progress=False, part_size=PART,
                            storage_options={"endpoint": endpoints[rank]})  # fmt: skip
    except Exception as e:
        kept = e  # as pytest.raises or a log keeps an error
        out = {"error": f"{type(e).__name__}: {e}"}
    finally:
        before = gloo_threads()
        dist.destroy_process_group()
    # The group's threads end with destroy_process_group(): fastload keeps no reference to it
    # (a group left alive into interpreter exit aborted the process: gloo's thread, dropping a
    # finished all-gather's tensors, took the GIL while the interpreter finalised).
    out["gloo_threads"] = [before, gloo_threads()]
    out["collective_threads"] = sorted(threads)
    del kept
    Path(outs, f"{rank}.json").write_text(json.dumps(out))


def _split_copy(tmp_path: Path, seaweed, dst: str, plans: list[list[Fault]]):
    """Two ranks copy one 21 MiB local file (five parts) to `dst`, rank r through a relay that
    injects `plans[r]` into its part uploads: (each rank's result, each rank's part PUTs)."""
    import json

    import torch.multiprocessing as mp

    src = tmp_path / "big.bin"
    if not src.exists():
        src.write_bytes(
            torch.randint(0, 255, ((21 << 20) + 5,), dtype=torch.uint8).numpy().tobytes()
        )
    port = int(seaweed.endpoint.rsplit(":", 1)[1])
    proxies = [
        HttpFaultProxy(("127.0.0.1", port), plan=plan, match=lambda m, h: m == "PUT")
        for plan in plans
    ]
    rdv = str(rendezvous_port())
    try:
        endpoints = [p.endpoint for p in proxies]
        mp.start_processes(_split_rank, args=(2, str(src), dst, rdv, str(tmp_path), endpoints),
                           nprocs=2, start_method="spawn")  # fmt: skip
    finally:
        for p in proxies:
            p.close()
    outs = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    parts = [sum("partNumber=" in target for _, target, _ in p.log) for p in proxies]
    return src, outs, parts


def test_two_ranks_split_one_big_file_into_parts(seaweed, s3, tmp_path):
    prefix = "copy/split/"
    dst = f"s3://{BUCKET}/{prefix}big.bin"
    src, outs, parts = _split_copy(tmp_path, seaweed, dst, [[], []])
    assert all("error" not in o for o in outs), outs
    assert all(o["gloo_threads"][0] > 0 and o["gloo_threads"][1] == 0 for o in outs), outs
    assert all(o["collective_threads"] == ["MainThread"] for o in outs), outs
    # Five parts: rank 0 uploaded parts 1-2, rank 1 parts 3-5; each byte read once in all.
    assert parts == [2, 3]
    assert [o["copied"] for o in outs] == [[dst], []]
    assert sum(o["bytes"] for o in outs) == src.stat().st_size
    assert objects(s3, prefix) == {"big.bin": src.read_bytes()}
    assert open_uploads(s3, prefix) == []
    # The upload carried the source's identity: a rerun (one process) skips the copy.
    again = fastload.copy(str(src), dst, part_size=PART, progress=False)
    assert (again["copied"], again["skipped"]) == ([], [dst])
    # So does the group: rank 0 finds the copy done, and no rank uploads anything.
    _, outs, parts = _split_copy(tmp_path, seaweed, dst, [[], []])
    assert [o["skipped"] for o in outs] == [[dst], []] and parts == [0, 0]


def test_a_rank_failing_its_parts_fails_every_rank_and_aborts_the_upload(seaweed, s3, tmp_path):
    prefix = "copy/split-failed/"
    dst = f"s3://{BUCKET}/{prefix}big.bin"
    denied = Fault("status", status=403, code="AccessDenied")
    _, outs, parts = _split_copy(tmp_path, seaweed, dst, [[], [denied] * 10])
    assert parts[1] >= 1
    # Rank 1's error, raised on both ranks; nothing published, the upload aborted.
    assert all("error" in o for o in outs), outs
    assert outs[0]["error"] == outs[1]["error"]
    assert outs[0]["error"].startswith(f"StorageError: {dst}: access denied")
    # Though each rank keeps its error, the group is gone with destroy_process_group().
    assert all(o["gloo_threads"][0] > 0 and o["gloo_threads"][1] == 0 for o in outs), outs
    assert all(o["collective_threads"] == ["MainThread"] for o in outs), outs
    assert objects(s3, prefix) == {}
    assert open_uploads(s3, prefix) == []


# ---------------------------------------------------------------------------------------------
# vLLM: `fastload copy hf://... s3://...`, then `vllm serve s3://... --load-format fastload`

try:
    from test_vllm import (
        LOG_LINE,
        S3_BUCKET,
        _engine_env,
        _greedy_tokens,
        _run_driver,
        _serving,
        _tail,
        _worker_load_lines,
        needs_vllm,
        offline,  # noqa: F401 (the module's engines and vLLM's own tokens, as a fixture)
    )
except ImportError:  # pragma: no cover
    needs_vllm = pytest.mark.skip(reason="tests/test_vllm.py not importable")


@pytest.mark.slow
@needs_vllm
def test_copy_from_the_hub_to_s3_then_serve_it_with_vllm(offline, seaweed, tmp_path):
    """The seeds' flow in one command: ``fastload copy hf://org/tiny-llama s3://models/...``
    (mock Hub to SeaweedFS, no local staging), then ``vllm serve s3://... --load-format
    fastload`` answers with the tokens vLLM's own loader gave on the original folder."""
    from hf_models import engine_hub

    expected, _, work = offline
    folder = work / "tiny-llama"
    dst = f"s3://{S3_BUCKET}/copied/tiny-llama/"
    client = seaweed.client()
    s3_server.ensure_bucket(client, S3_BUCKET)
    with engine_hub(folder, "org/tiny-llama", tmp_path / "hf_home") as (_, hub_env):
        env = {**os.environ, **hub_env, **seaweed.env(), "PYTHONPATH": PYTHON}
        done = subprocess.run(
            [sys.executable, "-c", "import fastload._cli as c; c.main()", "copy",
             "hf://org/tiny-llama", dst],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
    copied = objects(client, "copied/tiny-llama/")
    assert copied == {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    model = dst.rstrip("/")
    env = {**_engine_env(), **seaweed.env(), "VLLM_ASSETS_CACHE": str(tmp_path / "assets")}
    log = tmp_path / "serve.log"
    with _serving(model, log, env) as base:
        assert _greedy_tokens(base, model) == expected["safetensors"][0]
    output, _ = _worker_load_lines(log)
    assert "fastload pulled" in output, _tail(output)


@pytest.mark.slow
@needs_vllm
def test_a_model_and_its_lora_adapter_copied_to_s3_serve_with_vllm(seaweed, tmp_path):
    """Tensorizer's flow: the model with its LoRA adapter files beside it goes to S3 with
    fastload.copy; vLLM serves the weights from S3 (load_format="fastload") with the adapter
    (copied back bitwise) enabled, and gives the tokens its own loader gives on the originals,
    which the adapter changes."""
    client = seaweed.client()
    s3_server.ensure_bucket(client, S3_BUCKET)
    results, output = _run_driver("lora", tmp_path, **seaweed.env())
    stored = objects(client, "lora/tiny-llama/adapter/")
    adapter = tmp_path / "tiny-llama" / "adapter"
    assert stored == {p.name: p.read_bytes() for p in adapter.iterdir()}
    assert results["adapter_bitwise"] == {
        "adapter_config.json": True,
        "adapter_model.safetensors": True,
    }
    assert results["fastload_s3_base"] == results["reference_base"], _tail(output)
    assert results["fastload_s3_lora"] == results["reference_lora"], _tail(output)
    assert results["reference_lora"] != results["reference_base"]
    # The second engine's weights came through fastload's loader (vLLM's logs its own line).
    assert any(LOG_LINE in line and "[vllm.py:" in line for line in output.splitlines()), _tail(
        output
    )


def test_the_cli_draws_a_progress_bar_on_a_terminal_only(tmp_path):
    import pty

    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(3 << 20))
    run = [sys.executable, "-c", "import fastload._cli as c; c.main()", "copy"]
    env = {**os.environ, "PYTHONPATH": PYTHON}
    piped = subprocess.run([*run, str(src), str(tmp_path / "a")], env=env, capture_output=True)
    assert piped.returncode == 0 and b"B/s" not in piped.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [*run, str(src), str(tmp_path / "b")], env=env, stderr=follower, stdout=subprocess.DEVNULL
    )
    os.close(follower)
    seen = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the terminal closed with the process
            break
        if not chunk:
            break
        seen += chunk
    os.close(leader)
    assert proc.wait(timeout=60) == 0
    assert b"copy 1 file" in seen and b"B/s" in seen, seen
    assert (tmp_path / "b" / "w.bin").read_bytes() == (src / "w.bin").read_bytes()


def test_copy_checks_its_options_in_one_place_for_python_and_the_command_line(tmp_path):
    """`fastload.copy` passes its values on as given; the native copy checks them with the rules
    of a load's reads and a write's parts, and so does `fastload copy`: a value out of range is a
    ConfigError naming the argument (a flag on the command line), before anything is read."""
    src = tmp_path / "src.bin"
    src.write_bytes(b"x" * 1000)
    dst = tmp_path / "dst.bin"
    cases = [
        ({"overwrite": "yes"}, "overwrite", "expected a bool, got str"),
        ({"concurrency": 0}, "concurrency", "0 is not a positive int"),
        ({"block_size": "1KiB"}, "block_size", "1KiB is not between 4KiB and 1GiB"),
        ({"part_size": 6 << 30}, "part_size", "6GiB is not between 5MiB and 5GiB"),
        ({"memory_limit": [1]}, "memory_limit", "expected an int or a string"),
    ]
    for kwargs, option, says in cases:
        with pytest.raises(fastload.ConfigError) as e:
            fastload.copy(src, dst, progress=False, **kwargs)
        assert e.value.option == option and says in str(e.value), (kwargs, e.value)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    cli = [sys.executable, "-m", "fastload._cli", "copy", str(src), str(dst)]
    for flag, value, says in [
        ("--concurrency", "5000", "invalid option --concurrency: 5000 is not in 1..=4096"),
        ("--block-size", "1KiB", "invalid option --block-size: 1KiB is not between 4KiB and 1GiB"),
    ]:
        out = subprocess.run([*cli, flag, value], capture_output=True, text=True, env=env)
        assert out.returncode == 1 and says in out.stderr, out.stderr
    assert not dst.exists()


@pytest.mark.parametrize(
    "dst",
    [
        "hf://org/repo",
        "HF://org/repo",
        "https://example.invalid/x",
        "HTTP://x/y",
        "peer://127.0.0.1:1/m",
    ],
)
def test_read_only_destinations_are_refused_before_anything_is_read(tmp_path, dst):
    """The Hub, plain HTTP(S) servers and a serve are only read: a copy to one is refused, in any
    letter case, naming what a copy writes to, before the source is listed (it does not exist)."""
    with pytest.raises(fastload.ConfigError, match="copies to local paths") as e:
        fastload.copy(str(tmp_path / "missing"), dst)
    assert "missing" not in str(e.value)


def test_an_overwriting_copy_by_ranks_that_cannot_talk_is_refused(tmp_path, monkeypatch):
    # torchrun's RANK and WORLD_SIZE without torch.distributed initialised: the ranks could copy
    # their shares, but not publish them together, so an overwriting copy is refused before
    # anything is written (a resuming one never replaces a file, so it goes ahead).
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.bin").write_bytes(b"a" * 100)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    dst = tmp_path / "dst"
    with pytest.raises(fastload.ConfigError, match=r"overwrite.*group of 2 ranks.*process_group="):
        fastload.copy(str(src), str(dst), overwrite=True, progress=False)
    assert not dst.exists()
    fastload.copy(str(src), str(dst), progress=False)


@pytest.mark.parametrize(
    "old_n,new_n", [(1, 3), (3, 1)], ids=["one-under-shards", "shards-under-one"]
)
def test_a_resuming_copy_over_another_layout_of_the_same_model_is_refused(tmp_path, old_n, new_n):
    # A resuming copy never replaces a file; left beside the copy's own files, an earlier
    # checkpoint of another layout would decide what loads (transformers takes model.safetensors
    # first, vLLM and fastload the index) or be loaded with them. So it is refused, naming the
    # file, before anything is written; overwrite=True replaces it.
    old = saved_checkpoint(tmp_path / "dst", old_n, seed=1)
    new = saved_checkpoint(tmp_path / "src", new_n, seed=2)
    before = files_of(tmp_path / "dst")
    assert len([n for n in before if n.endswith(".safetensors")]) == old_n
    with pytest.raises(fastload.DestinationExistsError, match="already exists") as e:
        fastload.copy(str(tmp_path / "src"), str(tmp_path / "dst"), progress=False)
    assert Path(e.value.filename).name in before
    assert files_of(tmp_path / "dst") == before
    assert_same_tensors(fastload.load(str(tmp_path / "dst")), old)
    fastload.copy(str(tmp_path / "src"), str(tmp_path / "dst"), overwrite=True, progress=False)
    assert files_of(tmp_path / "dst") == files_of(tmp_path / "src")
    assert_same_tensors(fastload.load(str(tmp_path / "dst")), new)
