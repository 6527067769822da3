"""A `fastload.save` that fails part-way (disk full, a Ctrl-C, an upload refused, SIGKILL) leaves
its destination loading as the complete earlier checkpoint, the complete new one, or an error:
never some of the new shards, never one checkpoint's index over the other's shards.

Generated failure points: each native step of a save (a writer opened, a tensor written, a file
prepared or published, the index written, a file removed) interrupted in turn, before and after
it ran; a local disk that fills at every point of the writing; every write request to a real S3
server (SeaweedFS) failed in turn; SIGINT and SIGKILL to a saving process. The same for
`fastload.copy(overwrite=True)` and `fastload copy --overwrite` over a different checkpoint of the
same file names (every S3 write request failed in turn, a full disk, a file that cannot be
written, SIGINT), and a resuming copy that must refuse to replace a different file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import fastload
import pytest
import safetensors.torch
import torch
from fastload import _fastload
from helpers import mounted_tmpfs, pattern, raw_bytes
from servers import s3 as s3_server
from servers.s3 import BUCKET, Fault, HttpFaultProxy, rendezvous_port

aws_env = s3_server.aws_env
seaweed_fault_proxy = s3_server.seaweed_fault_proxy
HERE = Path(__file__).resolve().parent
PYTHON = os.path.join(os.path.dirname(fastload.__file__), "..")
SHARD = "10KB"
INDEX = "model.safetensors.index.json"  # one 2,500-float tensor per shard

# (shards of the earlier checkpoint, shards of the new one); 0: no earlier checkpoint, 1: one
# model.safetensors. The same tensor names in both, different values: a mix is told apart.
CASES = [(0, 3), (3, 3), (3, 2), (2, 3), (1, 3), (3, 1)]


def checkpoint(shards: int, seed: int) -> dict[str, torch.Tensor]:
    return {f"w{i}": pattern((2500,), torch.float32, seed=seed + i) for i in range(shards)}


class Mixed(Exception):
    """The files a reader takes hold the same tensors twice (two checkpoints side by side)."""


def classify(load, old: dict | None, new: dict) -> str:
    """ "old", "new" or "raises"; anything else describes the partial or mixed load."""
    try:
        got = load()
    except Mixed as e:
        return f"mixed: {e}"
    except (fastload.FastloadError, FileNotFoundError, ValueError):
        return "raises"
    for name, want in (("new", new), ("old", old)):
        if want is not None and got.keys() == want.keys():
            if all(torch.equal(raw_bytes(got[k]), raw_bytes(want[k])) for k in want):
                return name
    return f"partial or mixed: {sorted(got)} of old {sorted(old or {})} / new {sorted(new)}"


def naive_load(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """What a reader that trusts what it finds loads (no check that a shard set is whole): the
    files the index names, or every .safetensors file when there is none. The writer alone must
    keep such a reader from a partial or mixed checkpoint."""
    if INDEX in files:
        names = sorted(set(json.loads(files[INDEX])["weight_map"].values()))
    else:
        names = sorted(n for n in files if n.endswith(".safetensors"))
    if not names:
        raise FileNotFoundError("no checkpoint")
    out: dict[str, torch.Tensor] = {}
    for name in names:
        if name not in files:
            raise FileNotFoundError(name)
        part = safetensors.torch.load(files[name])
        if part.keys() & out.keys():
            # vLLM's loader without an index loads every file it finds, in directory order, and
            # keeps whichever copy of a tensor it read last: no error, and either checkpoint's.
            raise Mixed(f"{name}: tensors seen in another file too, of {sorted(files)}")
        out.update(part)
    return out


def local_files(folder: Path) -> dict[str, bytes]:
    if not folder.exists():
        return {}
    return {p.name: p.read_bytes() for p in folder.iterdir() if not p.name.startswith(".")}


def s3_files(client, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read()
            for o in listed}  # fmt: skip


def outcome(uri: str, files: dict[str, bytes], old: dict | None, new: dict, **kw) -> str:
    """How the destination loads with fastload and with `naive_load` of its `files`: the same
    "old" or "new" for both, "raises" where one raised and the other found a whole checkpoint,
    else what was wrong."""
    ours = classify(lambda: fastload.load(uri, **kw), old, new)
    naive = classify(lambda: naive_load(files), old, new)
    for got in (ours, naive):
        if got not in ("old", "new", "raises"):
            return got
    return ours if ours == naive else "raises"


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".fastload-tmp"))


# ---------------------------------------------------------------------------------------------
# Every step interrupted in turn (a KeyboardInterrupt, as Ctrl-C raises it)


class Steps:
    """Counts the native steps of a save and raises KeyboardInterrupt at step `at` (1-based),
    before the step runs or, with `after`, once it ran (a Ctrl-C that cut short a wait whose
    work went on: a file published that the caller never heard of)."""

    def __init__(self, at: int = 0, after: bool = False) -> None:
        self.at, self.after = at, after
        self.names: list[str] = []

    def run(self, name: str, step):
        self.names.append(name)
        hit = len(self.names) == self.at
        if hit and not self.after:
            raise KeyboardInterrupt
        out = step()
        if hit:
            raise KeyboardInterrupt
        return out

    def install(self, monkeypatch) -> None:
        steps, real = self, _fastload.FileWriter

        class Writer:
            def __init__(self, *args, **kw) -> None:
                self._w = steps.run("open", lambda: real(*args, **kw))

            def __getattr__(self, name: str):
                return getattr(self._w, name)

            def write(self, t) -> None:
                steps.run("write", lambda: self._w.write(t))

            def finish(self, publish: bool = True) -> None:
                what = "publish" if publish else "prepare"
                steps.run(what, lambda: self._w.finish(publish=publish))

        monkeypatch.setattr(_fastload, "FileWriter", Writer)
        for name in ("write_bytes", "remove"):
            fn = getattr(_fastload, name)
            monkeypatch.setattr(_fastload, name, lambda *a, _f=fn, _n=name, **k: steps.run(
                _n, lambda: _f(*a, **k)))  # fmt: skip


@pytest.mark.parametrize("old_n,new_n", CASES, ids=[f"{o}-to-{n}" for o, n in CASES])
def test_a_save_interrupted_at_any_step_leaves_the_old_or_the_new_checkpoint(
    tmp_path, monkeypatch, old_n, new_n
):
    old, new = checkpoint(old_n, seed=100), checkpoint(new_n, seed=200)

    def attempt(folder: Path, steps: Steps) -> None:
        if old_n:
            fastload.save(old, folder, max_shard_size=SHARD)
        with monkeypatch.context() as m:
            steps.install(m)
            fastload.save(new, folder, max_shard_size=SHARD, overwrite=True)

    counted = Steps()
    attempt(tmp_path / "count", counted)
    # The first step a reader could notice: a file published or removed.
    first = min(i for i, n in enumerate(counted.names) if n in ("publish", "write_bytes", "remove"))
    for at in range(1, len(counted.names) + 1):
        for after in (False, True):
            folder = tmp_path / f"{at}-{after}"
            with pytest.raises(KeyboardInterrupt):
                attempt(folder, Steps(at, after))
            got = outcome(str(folder), local_files(folder), old if old_n else None, new)
            where = f"interrupted {'after' if after else 'at'} step {at} of {counted.names}"
            assert got in ("old", "new", "raises"), f"{where}: {got}"
            if at - 1 < first or (at - 1 == first and not after):
                # Until a file is published or removed nothing changed for a reader.
                assert got == ("old" if old_n else "raises"), f"{where}: {got}"
            if folder.exists():
                assert leftovers(folder) == [], where


# ---------------------------------------------------------------------------------------------
# A disk that fills at every point of the writing


@pytest.fixture
def tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path, "2m") as mnt:
        yield mnt


def test_a_disk_that_fills_during_a_save_leaves_the_old_checkpoint(tmpfs):
    # The new checkpoint: 3 shards of 400 KB. A filler file leaves room for less and less of it,
    # so the disk fills in the third shard, the second, the first: a StorageError each time, and
    # the earlier checkpoint (3 small shards: the same file names) loads whole.
    old, new = checkpoint(3, seed=100), checkpoint(3, seed=200)
    big = {k: v.repeat(40) for k, v in new.items()}
    folder = tmpfs / "m"
    filler = tmpfs / "filler"
    for room in range(1_150_000, 0, -150_000):
        fastload.save(old, folder, max_shard_size=SHARD, overwrite=True)
        free = os.statvfs(tmpfs).f_bavail * os.statvfs(tmpfs).f_frsize
        filler.write_bytes(b"\0" * max(free - room, 0))
        with pytest.raises(fastload.StorageError, match="No space left on device"):
            fastload.save(big, folder, max_shard_size="400KB", overwrite=True)
        assert outcome(str(folder), local_files(folder), old, big) == "old", room
        assert leftovers(folder) == []
        filler.unlink()
    fastload.save(big, folder, max_shard_size="400KB", overwrite=True)
    assert outcome(str(folder), local_files(folder), old, big) == "new"
    assert sorted(os.listdir(folder)) == [
        *[f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)],
        "model.safetensors.index.json",
    ]


# ---------------------------------------------------------------------------------------------
# Every write request to S3 failed in turn


def writes(method: str, headers: dict[str, str]) -> bool:
    return method in ("PUT", "POST", "DELETE")


def open_uploads(client, prefix: str) -> list[str]:
    found = client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads", [])
    return [u["Key"] for u in found]


class Nth:
    """Matches the `n`-th write request through the proxy (1-based), and no other."""

    def __init__(self, n: int) -> None:
        self.n, self.seen = n, 0

    def __call__(self, method: str, headers: dict[str, str]) -> bool:
        if not writes(method, headers):
            return False
        self.seen += 1
        return self.seen == self.n


@pytest.mark.parametrize("old_n,new_n", [(0, 3), (3, 3), (3, 2), (1, 3), (3, 1)],
                         ids=["0-to-3", "3-to-3", "3-to-2", "1-to-3", "3-to-1"])  # fmt: skip
def test_an_s3_save_whose_kth_request_fails_leaves_the_old_or_the_new_checkpoint(
    seaweed, seaweed_fault_proxy, old_n, new_n
):
    old, new = checkpoint(old_n, seed=100), checkpoint(new_n, seed=200)
    client = seaweed.client()
    no_retry = {"max_retries": "0", "retry_timeout": "5"}
    counter = Nth(0)
    seaweed_fault_proxy(match=counter)
    prefix = f"failing/{old_n}-{new_n}/count/"
    fastload.save(new, f"s3://{BUCKET}/{prefix}", max_shard_size=SHARD)
    total = counter.seen
    for k in range(1, total + 1):
        prefix = f"failing/{old_n}-{new_n}/{k}/"
        uri = f"s3://{BUCKET}/{prefix}"
        proxy = seaweed_fault_proxy(plan=[Fault("status", status=500)], match=Nth(k))
        if old_n:
            fastload.save(old, uri, max_shard_size=SHARD, storage_options={
                "endpoint": seaweed.endpoint})  # fmt: skip
        try:
            fastload.save(new, uri, max_shard_size=SHARD, storage_options=no_retry,
                          overwrite=True)  # fmt: skip
            failed = False
        except fastload.StorageError:
            failed = True
        assert proxy.served["faults"] == 1, (k, proxy.served)
        got = outcome(uri, s3_files(client, prefix), old if old_n else None, new)
        assert got in ("old", "new", "raises"), f"request {k} of {total} failed: {got}"
        assert failed or got == "new", k
        assert open_uploads(client, prefix) == [], k
        proxy.close()


# ---------------------------------------------------------------------------------------------
# Ctrl-C and kill -9 of a saving process

SAVER = """
import os, signal, sys, fastload, torch
signal.signal(signal.SIGINT, signal.default_int_handler)
n, mib = int(sys.argv[2]), int(sys.argv[3])
new = {f"w{i}": torch.full((mib << 18,), float(i)) for i in range(n)}
print("ready", flush=True)
try:
    fastload.save(new, sys.argv[1], max_shard_size=f"{mib}MiB", part_size=5 << 20, overwrite=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    os._exit(3)
print("done", flush=True)
"""


def start_saver(dest: str, shards: int, mib: int = 4) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    proc = subprocess.Popen([sys.executable, "-c", SAVER, dest, str(shards), str(mib)],
                            stdout=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stdout.readline() == b"ready\n"
    return proc


def wait_for(proc: subprocess.Popen, ready) -> None:
    deadline = time.monotonic() + 60
    while not ready():
        assert proc.poll() is None, "the saver ended first"
        assert time.monotonic() < deadline
        time.sleep(0.002)


def big(shards: int, base: int = 0, mib: int = 4) -> dict[str, torch.Tensor]:
    """The saver's tensors (`base` 0): `mib` MiB each, one a shard."""
    return {f"w{i}": torch.full((mib << 18,), float(base + i)) for i in range(shards)}


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill-9"])
def test_a_local_save_stopped_by_a_signal_leaves_the_old_checkpoint(tmp_path, sig):
    # The earlier checkpoint has the new one's file names: a new shard published too early
    # would sit under the earlier index.
    folder = tmp_path / "m"
    old = big(12, base=100, mib=32)
    fastload.save(old, folder, max_shard_size="32MiB")
    proc = start_saver(str(folder), 12, mib=32)
    # Stopped while the third shard is being written (the first two written, not published);
    # the nine 32 MiB shards still to write take far longer than the signal to land.
    wait_for(proc, lambda: any(".model-00003-of-00012" in n for n in os.listdir(folder)))
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    if sig == signal.SIGINT:
        assert (proc.returncode, out) == (3, b"interrupted\n")
        assert leftovers(folder) == []
    else:
        assert proc.returncode == -signal.SIGKILL
    new = big(12, mib=32)
    assert outcome(str(folder), local_files(folder), old, new) == "old"
    # Whatever the killed saver left (hidden temporary files) does not stop the next save.
    fastload.save(new, folder, max_shard_size="32MiB", overwrite=True)
    assert outcome(str(folder), local_files(folder), old, new) == "new"


def test_an_s3_save_interrupted_mid_upload_completes_nothing(seaweed, seaweed_fault_proxy):
    # The third shard's part hangs until Ctrl-C: the first two shards are uploaded but not
    # completed, so the earlier checkpoint (3 shards of the same names) still loads whole, and
    # the interrupted save's uploads are aborted.
    prefix = "interrupted-save/"
    uri = f"s3://{BUCKET}/{prefix}"
    old = checkpoint(3, seed=100)
    fastload.save(old, uri, max_shard_size=SHARD, storage_options={"endpoint": seaweed.endpoint})
    parts: list[str] = []

    def third_part(method: str, headers: dict[str, str]) -> bool:
        if method == "PUT":
            parts.append(method)
        return method == "PUT" and len(parts) >= 3

    proxy = seaweed_fault_proxy(then=Fault("stall_head", seconds=60), match=third_part)
    proc = start_saver(uri, 3)
    try:
        wait_for(proc, lambda: proxy.served.get("stall_head", 0) > 0)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert (proc.returncode, out) == (3, b"interrupted\n")
    client = seaweed.client()
    assert open_uploads(client, prefix) == []
    files = s3_files(client, prefix)
    assert outcome(uri, files, old, big(3), storage_options={"endpoint": seaweed.endpoint}) == "old"


# ---------------------------------------------------------------------------------------------
# An overwriting copy over a different checkpoint of the same file names: each file is held
# back complete until all are, then published with the index last; a failure or Ctrl-C before
# that aborts them all (the earlier checkpoint stays), one while publishing leaves none.

CONFIG = "config.json"


def source_folder(folder: Path, shards: int, seed: int, config: bytes = b'{"v": 2}') -> dict:
    """A saved checkpoint with a config beside it (a file that is no weight); its tensors."""
    sd = checkpoint(shards, seed=seed)
    fastload.save(sd, folder, max_shard_size=SHARD)
    (folder / CONFIG).write_bytes(config)
    return sd


# The config a copy's destination may hold beside each outcome of its weights: the new one only
# beside the whole new checkpoint.
CONFIG_BESIDE = {"old": [b'{"v": 1}', None], "new": [b'{"v": 2}'], "raises": [b'{"v": 1}', None]}

# (3, 1) and (1, 3): the request that fails may be one removing the earlier layout's files.
COPY_CASES = [(3, 3), (3, 2), (2, 3), (3, 1), (1, 3)]


@pytest.mark.parametrize("old_n,new_n", COPY_CASES, ids=[f"{o}-to-{n}" for o, n in COPY_CASES])
def test_an_s3_copy_whose_kth_request_fails_leaves_the_old_or_the_new_checkpoint(
    seaweed, seaweed_fault_proxy, tmp_path, old_n, new_n
):
    old_src = tmp_path / "old"
    new_src = tmp_path / "new"
    old = source_folder(old_src, old_n, seed=100, config=b'{"v": 1}')
    new = source_folder(new_src, new_n, seed=200)
    client = seaweed.client()
    direct = {"endpoint": seaweed.endpoint}
    no_retry = {"max_retries": "0", "retry_timeout": "5"}

    def over_old(prefix: str) -> str:
        uri = f"s3://{BUCKET}/{prefix}"
        fastload.copy(str(old_src), uri, progress=False, storage_options=direct)
        return uri

    counter = Nth(0)
    seaweed_fault_proxy(match=counter)
    uri = over_old(f"copy-failing/{old_n}-{new_n}/count/")
    fastload.copy(str(new_src), uri, progress=False, overwrite=True)
    total = counter.seen
    for k in range(1, total + 1):
        prefix = f"copy-failing/{old_n}-{new_n}/{k}/"
        uri = over_old(prefix)
        proxy = seaweed_fault_proxy(plan=[Fault("status", status=500)], match=Nth(k))
        try:
            fastload.copy(str(new_src), uri, progress=False, overwrite=True,
                          storage_options=no_retry)  # fmt: skip
            failed = False
        except fastload.StorageError:
            failed = True
        assert proxy.served["faults"] == 1, (k, proxy.served)
        files = s3_files(client, prefix)
        got = outcome(uri, files, old, new, storage_options=direct)
        assert got in ("old", "new", "raises"), f"request {k} of {total} failed: {got}"
        assert failed or got == "new", k
        # The config goes with the weights: the new one only beside the whole new checkpoint.
        assert files.get(CONFIG) in CONFIG_BESIDE[got], (k, got, files.get(CONFIG))
        assert open_uploads(client, prefix) == [], k
        proxy.close()


@pytest.fixture
def bigger_tmpfs(tmp_path):
    with mounted_tmpfs(tmp_path, "4m") as mnt:
        yield mnt


# One file at a time (less memory than two parts): the order of what is written is fixed.
ONE_AT_A_TIME = {"part_size": 5 << 20, "memory_limit": (10 << 20) - 1}


def test_a_disk_that_fills_during_a_copy_leaves_the_old_checkpoint(bigger_tmpfs, tmp_path):
    # The new checkpoint: 3 shards of 400 KB with the old one's file names. The disk fills in
    # the third shard, the second, the first: the earlier checkpoint loads whole each time.
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, 3, seed=100, config=b'{"v": 1}')
    new = {k: v.repeat(40) for k, v in checkpoint(3, seed=200).items()}
    fastload.save(new, new_src, max_shard_size="400KB")
    folder = bigger_tmpfs / "m"
    filler = bigger_tmpfs / "filler"
    for room in range(1_150_000, 0, -150_000):
        fastload.copy(str(old_src), str(folder), progress=False, overwrite=True)
        free = os.statvfs(bigger_tmpfs).f_bavail * os.statvfs(bigger_tmpfs).f_frsize
        filler.write_bytes(b"\0" * max(free - room, 0))
        with pytest.raises(fastload.StorageError, match="No space left on device"):
            fastload.copy(str(new_src), str(folder), progress=False, overwrite=True,
                          **ONE_AT_A_TIME)  # fmt: skip
        assert outcome(str(folder), local_files(folder), old, new) == "old", room
        assert leftovers(folder) == []
        filler.unlink()
    fastload.copy(str(new_src), str(folder), progress=False, overwrite=True, **ONE_AT_A_TIME)
    assert outcome(str(folder), local_files(folder), old, new) == "new"


def test_a_local_copy_failing_part_way_leaves_the_old_checkpoint(tmp_path):
    # One file at a time, the largest first: shards 1 and 2 (10 and 8 KB) are written, then the
    # tokenizer (7 KB) cannot be (a folder is in its way). The new shards were never published,
    # so the earlier checkpoint (the same file names) loads whole, its config beside it.
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, 3, seed=100, config=b'{"v": 1}')
    new = {
        f"w{i}": pattern((n,), torch.float32, seed=200 + i)
        for i, n in enumerate((2500, 2000, 1500))
    }
    fastload.save(new, new_src, max_shard_size=SHARD)
    (new_src / CONFIG).write_bytes(b'{"v": 2}')
    (new_src / "tokenizer.json").write_bytes(b" " * 7000)
    folder = tmp_path / "m"
    fastload.copy(str(old_src), str(folder), progress=False)
    (folder / "tokenizer.json").mkdir()
    with pytest.raises(fastload.StorageError, match=r"tokenizer\.json: is a directory"):
        fastload.copy(str(new_src), str(folder), progress=False, overwrite=True, **ONE_AT_A_TIME)
    (folder / "tokenizer.json").rmdir()
    assert outcome(str(folder), local_files(folder), old, new) == "old"
    assert (folder / CONFIG).read_bytes() == b'{"v": 1}'
    assert leftovers(folder) == []
    fastload.copy(str(new_src), str(folder), progress=False, overwrite=True)
    assert outcome(str(folder), local_files(folder), old, new) == "new"


COPIER = """
import os, signal, sys, fastload
signal.signal(signal.SIGINT, signal.default_int_handler)
print("ready", flush=True)
try:
    fastload.copy(sys.argv[1], sys.argv[2], progress=False, overwrite=True,
                  part_size=5 << 20, memory_limit=(10 << 20) - 1)
except KeyboardInterrupt:
    print("interrupted", flush=True)
    os._exit(3)
print("done", flush=True)
"""


def test_a_local_copy_stopped_by_ctrl_c_leaves_the_old_checkpoint(tmp_path):
    # One file at a time: stopped while the third shard is written (two written, not published).
    # 12 shards of 32 MiB: the nine still to write take long enough (hundreds of MB, at disk
    # speed) that the signal lands before the copy could publish anything.
    old_src, new_src, folder = tmp_path / "old", tmp_path / "new", tmp_path / "m"
    old, new = big(12, base=100, mib=32), big(12, mib=32)
    fastload.save(old, old_src, max_shard_size="32MiB")
    fastload.save(new, new_src, max_shard_size="32MiB")
    fastload.copy(str(old_src), str(folder), progress=False)
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    proc = subprocess.Popen([sys.executable, "-c", COPIER, str(new_src), str(folder)],
                            stdout=subprocess.PIPE, env=env)  # fmt: skip
    assert proc.stdout.readline() == b"ready\n"
    wait_for(proc, lambda: any(".model-00003-of-00012" in n for n in os.listdir(folder)))
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert (proc.returncode, out) == (3, b"interrupted\n")
    assert leftovers(folder) == []
    assert outcome(str(folder), local_files(folder), old, new) == "old"


@pytest.mark.parametrize("where", ["local", "s3"])
def test_a_resuming_copy_never_replaces_a_different_file(seaweed, aws_env, tmp_path, where):
    # Without overwrite a copy resumes: a destination file that is not a copy of the source is
    # refused (naming overwrite=True), so the earlier checkpoint stays whole.
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, 3, seed=100, config=b'{"v": 1}')
    new = source_folder(new_src, 3, seed=200)
    if where == "s3":
        aws_env(seaweed)
        uri = f"s3://{BUCKET}/copy-resume/"
        files = lambda: s3_files(seaweed.client(), "copy-resume/")  # noqa: E731
    else:
        uri = str(tmp_path / "m")
        files = lambda: local_files(Path(uri))  # noqa: E731
    fastload.copy(str(old_src), uri, progress=False)
    with pytest.raises(fastload.DestinationExistsError, match="overwrite=True"):
        fastload.copy(str(new_src), uri, progress=False)
    assert outcome(uri, files(), old, new) == "old"
    assert files()[CONFIG] == b'{"v": 1}'


def test_the_cli_copy_with_overwrite_whose_second_upload_fails_leaves_no_mix(
    seaweed, seaweed_fault_proxy, tmp_path
):
    # `fastload copy --overwrite`, 3 shards over 3 of the same names, the second write request
    # refused: the earlier checkpoint loads whole (before, w0 was new and w1, w2 old).
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, 3, seed=100, config=b'{"v": 1}')
    new = source_folder(new_src, 3, seed=200)
    prefix = "copy-cli-failing/"
    uri = f"s3://{BUCKET}/{prefix}"
    direct = {"endpoint": seaweed.endpoint}
    fastload.copy(str(old_src), uri, progress=False, storage_options=direct)
    proxy = seaweed_fault_proxy(plan=[Fault("status", status=500)], match=Nth(2))
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    cli = [sys.executable, "-c", "import fastload._cli as c; c.main()", "copy", str(new_src), uri]
    opts = ["--overwrite", "--option", "max_retries=0"]
    done = subprocess.run([*cli, *opts], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and proxy.served["faults"] == 1, done.stderr
    files = s3_files(seaweed.client(), prefix)
    assert outcome(uri, files, old, new, storage_options=direct) == "old", done.stderr
    assert files[CONFIG] == b'{"v": 1}'
    assert open_uploads(seaweed.client(), prefix) == []


# ---------------------------------------------------------------------------------------------
# An overwriting copy over a checkpoint of another layout (one file over shards, fewer shards,
# shards over one file): the earlier files the copy does not replace are removed, as a save
# removes them, so the earlier index cannot decide what loads; files that are no checkpoint stay.

LAYOUTS = [(3, 1), (3, 2), (1, 3)]
USER_FILE = "README.md"


def checkpoint_names(shards: int) -> set[str]:
    if shards == 1:
        return {"model.safetensors"}
    return {f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)} | {INDEX}


@pytest.mark.parametrize("where", ["local", "s3"])
@pytest.mark.parametrize("old_n,new_n", LAYOUTS, ids=[f"{o}-to-{n}" for o, n in LAYOUTS])
def test_an_overwriting_copy_over_another_layout_loads_exactly_the_new_checkpoint(
    seaweed, aws_env, tmp_path, old_n, new_n, where
):
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, old_n, seed=100, config=b'{"v": 1}')
    new = source_folder(new_src, new_n, seed=200)
    if where == "s3":
        aws_env(seaweed)
        prefix = f"copy-layout/{old_n}-{new_n}/"
        uri = f"s3://{BUCKET}/{prefix}"
        files = lambda: s3_files(seaweed.client(), prefix)  # noqa: E731
        seaweed.client().put_object(Bucket=BUCKET, Key=prefix + USER_FILE, Body=b"mine")
    else:
        uri = str(tmp_path / "m")
        files = lambda: local_files(Path(uri))  # noqa: E731
    fastload.copy(str(old_src), uri, progress=False)
    if where == "local":
        (Path(uri) / USER_FILE).write_bytes(b"mine")
    assert checkpoint_names(old_n) <= files().keys()
    fastload.copy(str(new_src), uri, progress=False, overwrite=True)
    got = files()
    assert outcome(uri, got, old, new) == "new"
    assert set(got) == checkpoint_names(new_n) | {CONFIG, USER_FILE}
    assert (got[CONFIG], got[USER_FILE]) == (b'{"v": 2}', b"mine")


def test_an_overwriting_copy_and_a_save_leave_the_same_files(tmp_path):
    # The copy's rule for stale checkpoint files is the save's: over each earlier layout, beside
    # files that only look like weights, both leave the same names.
    bystanders = {"other.safetensors": b"x", "model-extra.safetensors": b"y", USER_FILE: b"z"}
    for old_n, new_n in LAYOUTS:
        new_src = tmp_path / f"new-{old_n}-{new_n}"
        new = checkpoint(new_n, seed=200)
        fastload.save(new, new_src, max_shard_size=SHARD)
        left = []
        for how in ("save", "copy"):
            folder = tmp_path / f"{how}-{old_n}-{new_n}"
            fastload.save(checkpoint(old_n, seed=100), folder, max_shard_size=SHARD)
            for name, body in bystanders.items():
                (folder / name).write_bytes(body)
            if how == "save":
                fastload.save(new, folder, max_shard_size=SHARD, overwrite=True)
            else:
                fastload.copy(str(new_src), str(folder), progress=False, overwrite=True)
            left.append(sorted(local_files(folder)))
        assert left[0] == left[1] == sorted(checkpoint_names(new_n) | bystanders.keys())


def test_the_cli_copy_with_overwrite_over_another_layout_removes_the_earlier_shards(
    seaweed, aws_env, tmp_path
):
    # `fastload copy --overwrite`, one file over 3 shards and their index on S3: the earlier index
    # is gone, so the new file loads, and the user's file beside it stays.
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, 3, seed=100, config=b'{"v": 1}')
    new = source_folder(new_src, 1, seed=200)
    prefix = "copy-cli-layout/"
    uri = f"s3://{BUCKET}/{prefix}"
    aws_env(seaweed)
    client = seaweed.client()
    fastload.copy(str(old_src), uri, progress=False)
    client.put_object(Bucket=BUCKET, Key=prefix + USER_FILE, Body=b"mine")
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    cli = [sys.executable, "-c", "import fastload._cli as c; c.main()", "copy", str(new_src), uri]
    cli.append("--overwrite")
    done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    files = s3_files(client, prefix)
    assert outcome(uri, files, old, new) == "new"
    assert set(files) == {"model.safetensors", CONFIG, USER_FILE}
    assert files[USER_FILE] == b"mine"


# ---------------------------------------------------------------------------------------------
# A group of ranks copying over a checkpoint (`process_group`): each rank stages its share, and
# none publishes until every rank has staged; rank 0 then removes the earlier files, the indexes
# go first (naming shards not yet there: a load raises), the weights after. A rank that fails,
# or dies, leaves the earlier checkpoint, the new one or an error on every rank's reader.

GROUP_TIMEOUT = 60  # seconds: a dead peer ends a collective long before this


def _group_rank(rank: int, world: int, rdv: str, endpoint: str, old_src: str, new_src: str,
                base: str, outs: str, part_size: int) -> None:  # fmt: skip
    """Rank `rank` of a gloo group: for k = 0, 1, ... the earlier checkpoint copied (no fault)
    to `base`k/, then the new one over it with overwrite=True, rank 1's k-th write request
    answered 500 (k = 0: none, counting rank 1's write requests), until k passes that count."""
    import datetime

    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rdv}", rank=rank,
                            world_size=world, timeout=timeout)  # fmt: skip
    target = ("127.0.0.1", int(endpoint.rsplit(":", 1)[1]))
    no_retry = {"max_retries": "0", "retry_timeout": "5"}
    results, k, total = [], 0, 0
    try:
        while k <= total:
            uri = f"s3://{BUCKET}/{base}{k}/"
            fastload.copy(old_src, uri, progress=False, storage_options={"endpoint": endpoint})
            nth = Nth(k)
            plan = [Fault("status", status=500)]
            proxy = HttpFaultProxy(target, plan=plan, match=nth) if rank == 1 else None
            try:
                via = proxy.endpoint if proxy else endpoint
                out = fastload.copy(new_src, uri, progress=False, overwrite=True,
                                    part_size=part_size,
                                    storage_options={"endpoint": via, **no_retry})  # fmt: skip
                error = None
            except fastload.FastloadError as e:
                error, out = f"{type(e).__name__}: {e}", {}
            finally:
                if proxy:
                    proxy.close()
            faults = proxy.served["faults"] if proxy else 0
            if k == 0:
                seen: list = [None] * world
                dist.all_gather_object(seen, nth.seen)
                total = seen[1]
            results.append({"k": k, "uri": uri, "error": error, "faults": faults, "out": out})
            k += 1
    finally:
        dist.destroy_process_group()
    Path(outs, f"{rank}.json").write_text(json.dumps({"total": total, "results": results}))


# (earlier shards, new shards, the new first shard split into parts that both ranks upload)
GROUP_CASES = [(3, 3, False), (3, 2, False), (2, 3, False), (3, 3, True)]
PART = 5 << 20


@pytest.mark.parametrize("old_n,new_n,split", GROUP_CASES,
                         ids=["3-to-3", "3-to-2", "2-to-3", "3-to-3-split"])  # fmt: skip
def test_a_group_copy_whose_kth_request_fails_on_one_rank_leaves_no_mix(
    seaweed, aws_env, tmp_path, old_n, new_n, split
):
    # Two ranks share the files (rank 0 one shard and the index, rank 1 the others and the
    # config, or so); each write request of rank 1 fails in turn. Before, each rank published its
    # share on its own: rank 0's new shard beside rank 1's earlier ones loaded without an error.
    # Split: the first shard (21 MiB, five parts) is uploaded by both ranks, and rank 0 completes
    # its upload only with the group's other files.
    import torch.multiprocessing as mp

    aws_env(seaweed)
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, old_n, seed=100, config=b'{"v": 1}')
    new = checkpoint(new_n, seed=200)
    if split:
        new["w0"] = pattern(((21 << 20) // 4,), torch.float32, seed=300)
    fastload.save(new, new_src, max_shard_size=SHARD)
    (new_src / CONFIG).write_bytes(b'{"v": 2}')
    base = f"group-failing/{old_n}-{new_n}-{split}/"
    mp.start_processes(_group_rank, args=(2, str(rendezvous_port()), seaweed.endpoint,
                       str(old_src), str(new_src), base, str(tmp_path), PART), nprocs=2,
                       start_method="spawn")  # fmt: skip
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    total = ranks[1]["total"]
    assert total >= 4 and len(ranks[0]["results"]) == total + 1, ranks
    if split:
        # Rank 0 completed the big shard's upload; rank 1 uploaded 3 of its 5 parts (the last
        # one short).
        first = f"s3://{BUCKET}/{base}0/model-00001-of-{new_n:05d}.safetensors"
        assert first in ranks[0]["results"][0]["out"]["copied"], ranks[0]["results"][0]
        assert ranks[1]["results"][0]["out"]["bytes"] > 2 * PART, ranks[1]["results"][0]
    client = seaweed.client()
    direct = {"endpoint": seaweed.endpoint}
    for mine, other in zip(ranks[1]["results"], ranks[0]["results"]):
        k = mine["k"]
        # One error, raised on both ranks; without a fault, none.
        assert mine["error"] == other["error"], (k, mine, other)
        assert (mine["faults"], mine["error"] is None) == ((1, False) if k else (0, True)), mine
        prefix = f"{base}{k}/"
        files = s3_files(client, prefix)
        got = outcome(mine["uri"], files, old, new, storage_options=direct)
        assert got in ("old", "new", "raises"), f"request {k} of {total} failed: {got}"
        assert mine["error"] or got == "new", k
        assert files.get(CONFIG) in CONFIG_BESIDE[got], (k, got, files.get(CONFIG))
        assert open_uploads(client, prefix) == [], k


GROUP_COPIER = """
import datetime, os, signal, sys
import fastload, torch.distributed as dist
rank, rdv, src, dst = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
dying, die_at = int(sys.argv[5]), int(sys.argv[6])
timeout = datetime.timedelta(seconds=int(sys.argv[7]))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rdv}", rank=rank, world_size=2,
                        timeout=timeout)
calls, gather = 0, dist.all_gather_object
def counted(*args, **kwargs):
    global calls
    calls += 1
    if rank == dying and calls == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    return gather(*args, **kwargs)
dist.all_gather_object = counted
try:
    fastload.copy(src, dst, progress=False, overwrite=True)
    print("done", calls, flush=True)
except Exception as e:
    print("raised", calls, type(e).__name__, str(e)[:300].replace(chr(10), " "), flush=True)
os._exit(0)
"""


@pytest.mark.parametrize("dying", [1, 0])
def test_a_rank_killed_at_any_step_of_a_group_copy_leaves_no_mix(tmp_path, dying):
    # Two processes copy a checkpoint over an earlier one of the same file names; one rank is
    # killed (SIGKILL) before its n-th exchange with the other, for every n: after staging, after
    # rank 0 removed the earlier files, after publishing its index or its weights. The other
    # raises (or, once every file was published, finishes), and the folder loads as the earlier
    # checkpoint, the new one, or raises: a dead rank's shards never load as a smaller model.
    # Rank 0 also removes the earlier files and hosts the group's rendezvous store.
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, 3, seed=100, config=b'{"v": 1}')
    new = source_folder(new_src, 3, seed=200)
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}

    def run(n: int, folder: Path) -> list[tuple[int, str]]:
        fastload.copy(str(old_src), str(folder), progress=False)
        rdv = str(rendezvous_port())
        procs = [subprocess.Popen([sys.executable, "-c", GROUP_COPIER, str(r), rdv, str(new_src),
                                   str(folder), str(dying), str(n), str(GROUP_TIMEOUT)],
                                  stdout=subprocess.PIPE, env=env)
                 for r in range(2)]  # fmt: skip
        outs = [p.communicate(timeout=GROUP_TIMEOUT + 60)[0].decode() for p in procs]
        return [(p.returncode, out) for p, out in zip(procs, outs)]

    counted = run(0, tmp_path / "count")
    assert [rc for rc, _ in counted] == [0, 0], counted
    assert all(out.startswith("done") for _, out in counted), counted
    calls = int(counted[dying][1].split()[1])
    # The plan, staged, cleared, indexes, weights, the errors' gather.
    assert calls >= 6, counted
    got = {}
    for n in range(1, calls + 1):
        folder = tmp_path / f"m{n}"
        ranks = run(n, folder)
        (rc, out), (dead_rc, dead_out) = ranks[1 - dying], ranks[dying]
        assert (rc, dead_rc, dead_out) == (0, -signal.SIGKILL, ""), (n, ranks)
        got[n] = outcome(str(folder), local_files(folder), old, new)
        assert got[n] in ("old", "new", "raises"), (n, got[n], out)
        assert out.startswith("raised") or got[n] == "new", (n, out)
    # Killed before it staged anything of its own the earlier checkpoint stays; killed after
    # every file was published, the new one loads.
    assert got[1] == "old" and got[calls] == "new", got


# ---------------------------------------------------------------------------------------------
# kill -9 while publishing: a save's or an overwriting copy's process held at its k-th write
# request (the proxy answers nothing) and killed there, for every k

KILLED_SAVER = """
import sys, fastload
fastload.save(fastload.load(sys.argv[1]), sys.argv[2], max_shard_size=sys.argv[3], overwrite=True)
"""


# (how, shards of the earlier checkpoint): a resuming copy over an earlier one is refused
# (tests/test_copy.py), so only into nothing.
KILLED = [
    ("save", 0),
    ("save", 1),
    ("save", 3),
    ("copy", 0),
    ("copy", 1),
    ("copy", 3),
    ("resume", 0),
]


@pytest.mark.parametrize("how,old_n", KILLED, ids=[f"{h}-over-{n}" for h, n in KILLED])
def test_a_process_killed_at_any_write_request_leaves_no_smaller_model(
    seaweed, seaweed_fault_proxy, tmp_path, how, old_n
):
    # Where nothing earlier is left to load (an empty prefix, or the earlier files removed first:
    # those of the same names, or one model.safetensors that new shards would sit beside), the
    # index is published before the shards: killed between two of them, the prefix holds an index
    # naming shards not yet there (a load raises). Before, it held some new shards without an
    # index (a smaller model to a reader taking every *.safetensors), or, over one earlier
    # model.safetensors, that file beside some new shards (vLLM would load both: a mix). A
    # resuming copy publishes its index first too.
    old_src, new_src = tmp_path / "old", tmp_path / "new"
    old = source_folder(old_src, old_n, seed=100, config=b'{"v": 1}') if old_n else None
    new = source_folder(new_src, 3, seed=200)
    client = seaweed.client()
    direct = {"endpoint": seaweed.endpoint}
    env = {**os.environ, "PYTHONPATH": PYTHON + os.pathsep + str(HERE)}
    if how == "save":
        cmd = [sys.executable, "-c", KILLED_SAVER, str(new_src)]
    else:
        overwrite = ["--overwrite"] if how == "copy" else []
        cmd = [sys.executable, "-c", "import fastload._cli as c; c.main()", "copy", *overwrite,
               str(new_src)]  # fmt: skip
    got, k = {}, 0
    while True:
        k += 1
        prefix = f"killed/{how}-{old_n}/{k}/"
        uri = f"s3://{BUCKET}/{prefix}"
        if old_n:
            fastload.copy(str(old_src), uri, progress=False, storage_options=direct)
        proxy = seaweed_fault_proxy(plan=[Fault("stall_head", seconds=120)], match=Nth(k))
        args = [*cmd, uri, SHARD] if how == "save" else [*cmd, uri]
        proc = subprocess.Popen(args, env={**env, "AWS_ENDPOINT_URL": proxy.endpoint},
                                stderr=subprocess.PIPE)  # fmt: skip
        deadline = time.monotonic() + 60
        while proxy.served["faults"] == 0 and proc.poll() is None:
            assert time.monotonic() < deadline, k
            time.sleep(0.01)
        proc.kill()
        err = proc.communicate(timeout=60)[1].decode()
        proxy.close()
        if proxy.served["faults"] == 0:  # no k-th write request: the process finished
            assert proc.returncode == 0, err[-2000:]
            assert outcome(uri, s3_files(client, prefix), old, new, storage_options=direct) == "new"
            break
        got[k] = outcome(uri, s3_files(client, prefix), old, new, storage_options=direct)
        assert got[k] in ("old", "new", "raises"), (k, got[k], got)
    assert k > 4 and "raises" in got.values(), got
