"""hf:// against the mock Hub (servers/hub.py): the Hub's URIs, revisions and files, tokens and
their errors, redirects to a storage host that never sees the token, signed locations that expire
or are refused, injected 429/5xx, and offline loads from the Hugging Face cache. The real
`huggingface_hub` client reads the same mock, which shows the mock is faithful.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import fastload
import huggingface_hub
import pytest
from helpers import (
    assert_same_tensor,
    assert_same_tensors,
    indexed_files,
    reference,
    write_all_dtypes,
    write_multi_block,
)
from servers.hub import MockHub, git_blob_sha1

REPO = "org/model"
TOKEN = "hf_secret_token_value"


def files_of(directory: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(directory)): p.read_bytes() for p in directory.rglob("*") if p.is_file()
    }


@pytest.fixture(scope="module")
def hub(sharded_dir, dtypes_file):
    hub = MockHub()
    tree = files_of(sharded_dir)
    tree["sub/dtypes.safetensors"] = dtypes_file.read_bytes()
    hub.v1 = hub.add(REPO, tree, tags=("v1.0",))
    hub.add(REPO, {"model.safetensors": dtypes_file.read_bytes()}, branch="refs/pr/1")
    hub.add("org/private", tree, private=True)
    hub.add("org/gated", tree, gated=True)
    hub.tokens.add(TOKEN)
    hub.renamed["old/name"] = REPO
    yield hub
    hub.close()


@pytest.fixture
def env(hub, monkeypatch, tmp_path):
    """The environment huggingface_hub would read: the mock as HF_ENDPOINT, an empty HF_HOME."""
    for var in (
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "HF_HUB_CACHE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", hub.base)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    hub.faults.clear()
    hub.storage.faults.clear()
    return monkeypatch


def storage_gets(hub) -> list:
    return [r for r in hub.requests(hub.storage) if r[0] == "GET"]


def test_the_real_client_reads_the_mock(hub, env, sharded_dir, tmp_path):
    """huggingface_hub's hf_hub_download and snapshot_download work against the mock, bitwise."""
    cache = tmp_path / "cache"
    name = "model-00001-of-00003.safetensors"
    path = huggingface_hub.hf_hub_download(REPO, name, endpoint=hub.base, cache_dir=cache)
    assert Path(path).read_bytes() == (sharded_dir / name).read_bytes()
    assert f"snapshots/{hub.v1}/" in path
    folder = huggingface_hub.snapshot_download(REPO, endpoint=hub.base, cache_dir=cache)
    for rel, data in files_of(sharded_dir).items():
        assert (Path(folder) / rel).read_bytes() == data, rel
    # The client's download went through the signed redirect, without the token.
    assert storage_gets(hub)


def test_loads_a_repo_through_its_index(hub, env, sharded_dir):
    before, before_hub = len(hub.requests(hub.storage)), len(hub.requests())
    got = fastload.load(f"hf://{REPO}", block_size="64KiB")
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    gets = hub.requests(hub.storage)[before:]
    assert gets and all(r[2].get("range", "").startswith("bytes=") for r in gets)
    # Each file's location is resolved once and reused by all its reads (header, then data).
    heads = [r for r in hub.requests()[before_hub:] if r[0] == "HEAD" and "/resolve/" in r[1]]
    shards = indexed_files(sharded_dir)
    assert len(heads) == 1 + len(shards) and len(gets) >= 2 * len(shards), (heads, len(gets))


@pytest.mark.parametrize(
    "revision", ["", "@main", "@v1.0", "@{commit}", "@refs%2Fpr%2F1", "@refs/pr/1"]
)
def test_revisions(hub, env, sharded_dir, dtypes_file, revision):
    uri = f"hf://{REPO}{revision.format(commit=hub.v1)}"
    got = fastload.load(uri)
    if "pr" in revision:
        assert_same_tensors(got, reference(dtypes_file))
    else:
        assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


def test_folders_single_files_and_inspect(hub, env, sharded_dir, dtypes_file):
    assert_same_tensors(fastload.load(f"hf://{REPO}/sub"), reference(dtypes_file))
    assert_same_tensors(
        fastload.load(f"hf://{REPO}@v1.0/sub/dtypes.safetensors"), reference(dtypes_file)
    )
    stray = f"hf://{REPO}/stray.safetensors"
    assert_same_tensors(fastload.load(stray), reference(sharded_dir / "stray.safetensors"))
    files = [f["file"] for f in fastload.inspect(f"hf://{REPO}")["files"]]
    # Named at the commit the revision resolved to, once for the whole load.
    assert files == [f"hf://{REPO}@{hub.v1}/{p.name}" for p in indexed_files(sharded_dir)]


def test_the_token_goes_to_the_hub_only(hub, env, sharded_dir):
    env.setenv("HF_TOKEN", TOKEN)
    before_hub, before_storage = len(hub.requests()), len(hub.requests(hub.storage))
    got = fastload.load("hf://org/private")
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    to_hub = hub.requests()[before_hub:]
    to_storage = hub.requests(hub.storage)[before_storage:]
    assert to_hub and all(r[2].get("authorization") == f"Bearer {TOKEN}" for r in to_hub)
    assert to_storage and not any("authorization" in r[2] for r in to_storage)


def test_token_file_under_hf_home(hub, env, tmp_path, sharded_dir):
    home = tmp_path / "hf_home"
    home.mkdir()
    (home / "token").write_text(TOKEN + "\n")
    assert_same_tensors(fastload.load("hf://org/private"), reference(*indexed_files(sharded_dir)))


def test_private_repo_errors_name_the_repo_and_the_token_source(hub, env, tmp_path):
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/private")
    msg = str(e.value)
    assert "org/private" in msg and "without a token" in msg and "HF_TOKEN" in msg, msg

    env.setenv("HF_TOKEN", "hf_wrong_value")
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/private")
    msg = str(e.value)
    assert "org/private" in msg and "from HF_TOKEN" in msg and "hf_wrong_value" not in msg, msg


def test_gated_repo(hub, env):
    env.setenv("HF_TOKEN", TOKEN)
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/gated")
    msg = str(e.value)
    assert "org/gated is a gated repo" in msg and "from HF_TOKEN" in msg and TOKEN not in msg, msg
    hub.gated_access["org/gated"] = {TOKEN}
    try:
        assert fastload.load("hf://org/gated")
    finally:
        hub.gated_access.clear()


def test_missing_revisions_and_files(hub, env):
    with pytest.raises(fastload.StorageError, match="no such revision"):
        fastload.load(f"hf://{REPO}@nope")
    with pytest.raises(FileNotFoundError):
        fastload.load(f"hf://{REPO}/nope.safetensors")
    with pytest.raises(fastload.StorageError, match="org/absent was not found"):
        fastload.load("hf://org/absent")
    with pytest.raises(fastload.ConfigError):
        fastload.load("hf://org")


def test_429_and_5xx_are_retried(hub, env, sharded_dir):
    hub.faults += [
        ("api", 429, "1"),
        ("api", 503, None),
        ("resolve", 500, None),
        ("resolve", 429, "0"),
    ]
    hub.storage.faults += [("storage", 503, None), ("storage", 429, "0")]
    got = fastload.load(f"hf://{REPO}")
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    assert not hub.faults and not hub.storage.faults  # every fault was met, and got over


def test_a_renamed_repo_redirects(hub, env, sharded_dir):
    got = fastload.load("hf://old/name")
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


def test_expiring_locations_are_resolved_again(hub, env, sharded_dir):
    """A signed URL about to expire is not used: resolve/ is asked again before reading."""
    hub.storage.ttl = 5  # less than the 30 s margin: every read resolves first
    try:
        before = len([r for r in hub.requests() if "/resolve/" in r[1]])
        got = fastload.load(f"hf://{REPO}", block_size="64KiB")
    finally:
        hub.storage.ttl = 3600
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    resolves = len([r for r in hub.requests() if "/resolve/" in r[1]]) - before
    # One resolve per shard (+ the index) at open, then again for reads.
    assert resolves > 4 + len(indexed_files(sharded_dir)), resolves


def test_a_refused_location_is_resolved_again(hub, env, sharded_dir):
    """The storage host refuses URLs signed before a key rotation (403): fastload resolves the
    location again and goes on."""

    def resolves():
        return len([r for r in hub.requests() if "/resolve/" in r[1]])

    before = resolves()
    # Every URL handed out before the first read arrives is refused from then on.
    hub.storage.rotate_on_next_get = True
    got = fastload.load(f"hf://{REPO}")
    assert not hub.storage.rotate_on_next_get
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    files = 1 + len(indexed_files(sharded_dir))  # the index and the shards, resolved at open
    assert resolves() - before > files


@pytest.fixture
def swapping_hub(env, multi_block_file, tmp_path):
    """A Hub of its own holding big.safetensors, in LFS or (`plain`) served by the Hub itself,
    and the version someone overwrites it with: the same size and header, other values."""
    own = MockHub()
    own.plain.add("plain/big.safetensors")
    data = multi_block_file.read_bytes()
    own.add(REPO, {"big.safetensors": data, "plain/big.safetensors": data})
    env.setenv("HF_ENDPOINT", own.base)
    new = write_multi_block(tmp_path / "new.safetensors", seed=100)
    yield own, new
    own.close()


@pytest.mark.parametrize("lfs", [True, False], ids=["lfs", "plain"])
def test_a_file_overwritten_while_loading_is_an_error_not_torn(swapping_hub, env, tmp_path, lfs):
    """The storage host's ETag seen first pins every later GET (If-Match); a file whose bytes
    change under the same URL midway is a clear error. With cache=, nothing torn is published:
    the next load reads the new bytes whole."""
    hub, new = swapping_hub
    path = "big.safetensors" if lfs else "plain/big.safetensors"
    old_bytes = hub.repos[REPO].commits[next(iter(hub.repos[REPO].commits))][path]
    if lfs:
        hub.storage.swap(hashlib.sha256(old_bytes).hexdigest(), new.read_bytes(), after=3)
    else:
        hub.swap(path, new.read_bytes(), after=3)
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    uri = f"hf://{REPO}/{path}"
    with pytest.raises(fastload.StorageError, match="changed while loading") as info:
        fastload.load(uri, block_size="64KiB", cache=True)
    assert REPO in str(info.value)
    server = hub.storage if lfs else hub
    assert server.refused_if_match > 0
    fastload.cache_stats()  # waits for copies being published
    blobs = list((tmp_path / "hf_cache").rglob("blobs/*"))
    assert [b for b in blobs if not b.name.endswith(".incomplete")] == []
    if not lfs:
        # The Hub says the new bytes' blob id from now on: the next load reads them whole.
        want = reference(new)
        assert_same_tensors(fastload.load(uri, block_size="64KiB", cache=True), want)
        assert_same_tensors(fastload.load(uri, cache=True), want)


def test_offline_reads_the_hf_cache(hub, env, tmp_path, sharded_dir):
    cache = tmp_path / "hf_home" / "hub"
    huggingface_hub.snapshot_download(REPO, endpoint=hub.base, cache_dir=cache)
    env.setenv("HF_HUB_OFFLINE", "1")
    env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: must not be asked
    want = reference(*indexed_files(sharded_dir))
    assert_same_tensors(fastload.load(f"hf://{REPO}"), want)
    assert_same_tensors(fastload.load(f"hf://{REPO}@{hub.v1}"), want)
    with pytest.raises(fastload.StorageError, match="HF_HUB_OFFLINE is set") as e:
        fastload.load("hf://org/other")
    assert "org/other" in str(e.value)


def test_offline_a_repo_absent_from_the_cache_is_not_found_as_huggingface_hub_says(
    hub, env, tmp_path
):
    cache = tmp_path / "hf_home" / "hub"
    huggingface_hub.snapshot_download(REPO, endpoint=hub.base, cache_dir=cache)
    env.setenv("HF_HUB_OFFLINE", "1")
    env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens: must not be asked
    with pytest.raises(FileNotFoundError) as want:  # LocalEntryNotFoundError
        huggingface_hub.hf_hub_download(
            "org/other", "model.safetensors", cache_dir=cache, local_files_only=True
        )
    assert isinstance(want.value, huggingface_hub.errors.LocalEntryNotFoundError)
    for open_ in (
        lambda: fastload.load("hf://org/other"),
        lambda: fastload.load("hf://org/other@v2/model.safetensors"),
        lambda: fastload.safe_open("hf://org/other/model.safetensors", "pt"),
    ):
        with pytest.raises(fastload.NotFoundError) as e:
            open_()
        assert isinstance(e.value, FileNotFoundError)
        assert e.value.filename.startswith("hf://org/other@"), e.value.filename
        assert "HF_HUB_OFFLINE is set" in str(e.value) and "org/other" in str(e.value)


def test_schemes_come_from_rust():
    assert "hf" in fastload._fastload.SCHEMES
    assert fastload._fastload.is_remote_uri("hf://org/repo")


def test_all_dtypes_roundtrip(hub, env, tmp_path):
    path = write_all_dtypes(tmp_path / "all.safetensors")
    data = path.read_bytes()
    hub.add("org/dtypes", {"model.safetensors": data})
    got = fastload.load("hf://org/dtypes")
    assert_same_tensors(got, reference(path))
    assert hashlib.sha256(data).hexdigest() in hub.storage.blobs


needs_cache = pytest.mark.skipif(
    not hasattr(fastload, "cache_stats"), reason="needs the local cache (cache=, branch cache)"
)


@needs_cache
def test_cache_fills_the_hf_cache_for_huggingface_hub(env, tmp_path, sharded_dir):
    """cache= on hf:// writes the standard Hugging Face cache: huggingface_hub finds the files
    there without the network, bitwise equal; a second load with the Hub stopped and
    HF_HUB_OFFLINE=1 reads them."""
    hub_cache = tmp_path / "hf_cache"
    env.setenv("HF_HUB_CACHE", str(hub_cache))
    env.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    own = MockHub()
    try:
        commit = own.add(REPO, files_of(sharded_dir))
        env.setenv("HF_ENDPOINT", own.base)
        want = reference(*indexed_files(sharded_dir))
        published = fastload.cache_stats()["published"]  # waits for the copies to publish
        assert_same_tensors(fastload.load(f"hf://{REPO}", cache=True), want)
        shards = indexed_files(sharded_dir)
        assert fastload.cache_stats()["published"] - published == 1 + len(shards)
        names = ["model.safetensors.index.json", *(p.name for p in indexed_files(sharded_dir))]
        for name in names:
            path = huggingface_hub.hf_hub_download(
                REPO, name, endpoint=own.base, cache_dir=hub_cache, local_files_only=True
            )
            assert Path(path).read_bytes() == (sharded_dir / name).read_bytes(), name
        folder = huggingface_hub.snapshot_download(
            REPO, endpoint=own.base, cache_dir=hub_cache, local_files_only=True
        )
        assert Path(folder).name == commit
        for name in names:
            assert (Path(folder) / name).read_bytes() == (sharded_dir / name).read_bytes()
        # Without cache=, files already in the HF cache are read from it, as huggingface_hub
        # does: the Hub is asked for the commit and the files' etags, the storage host for nothing.
        before = len(storage_gets(own))
        assert_same_tensors(fastload.load(f"hf://{REPO}"), want)
        assert len(storage_gets(own)) == before
        assert fastload.cache_stats()["published"] - published == 1 + len(shards)
    finally:
        own.close()
    env.setenv("HF_HUB_OFFLINE", "1")
    assert_same_tensors(fastload.load(f"hf://{REPO}"), want)


# ---------------------------------------------------------------------------------------------
# Trusting what can be checked: refs offline, weak and long ETags, verify=


def test_an_offline_ref_that_is_not_a_commit_is_an_error(env, tmp_path, dtypes_file):
    """refs/main holding ../../x must not lead a load to a checkpoint outside the snapshots."""
    cache = tmp_path / "hf_home" / "hub"
    repo = cache / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("../../x")
    outside = repo / "snapshots" / ".." / ".." / "x"
    outside.mkdir(parents=True)
    (outside / "model.safetensors").write_bytes(dtypes_file.read_bytes())
    env.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(fastload.StorageError, match="not a 40-hex commit") as e:
        fastload.load(f"hf://{REPO}")
    assert "refs/main" in str(e.value) and "../../x" in str(e.value)


def safetensors_bytes(value: float) -> bytes:
    import torch
    from safetensors.torch import save

    return save({"w": torch.full((1000,), value)})


@needs_cache
@pytest.mark.parametrize("etag", ['W/"same"', '"{oid}' + "e" * 360 + '"'])
def test_files_outside_lfs_with_weak_or_long_etags(env, tmp_path, etag):
    """Two files with one weak ETag never share a blob (a weak ETag is no identity: such files
    are not cached); a 400-character ETag is cached (its blob named by its hash)."""
    from safetensors.torch import load

    env.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    own = MockHub()
    try:
        files = {"a.safetensors": safetensors_bytes(0.0), "b.safetensors": safetensors_bytes(1.0)}
        own.add("org/plain", files)
        own.plain |= set(files)
        own.plain_etag = etag
        env.setenv("HF_ENDPOINT", own.base)
        before = fastload.cache_stats()
        for name, data in files.items():
            for _ in range(2):
                got = fastload.load(f"hf://org/plain/{name}", cache=tmp_path / "c")
                assert_same_tensors(got, load(data))
                # A load does not wait for its copy to be published; this call does, so the
                # second load finds the copy (without it, it may race the flush and miss).
                fastload.cache_stats()
        after = fastload.cache_stats()
        blobs = sorted((tmp_path / "hf_cache" / "models--org--plain" / "blobs").glob("*"))
        if etag.startswith("W/"):
            assert blobs == [] and after["hits"] == before["hits"]
        else:
            assert sorted(b.read_bytes() for b in blobs) == sorted(files.values())
            assert after["hits"] - before["hits"] == 2  # each second load read the copy
    finally:
        own.close()


@needs_cache
def test_verify_checks_lfs_files_wherever_their_bytes_come_from(env, tmp_path, dtypes_file, capfd):
    """verify=True: a same-size poisoned blob in the HF cache is removed and the file read from
    the Hub; wrong bytes from the network are a StorageError naming the file, the expected and
    the actual sha256; a fill of wrong bytes is that error too (verify or not) and publishes
    nothing."""
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    own = MockHub()
    try:
        data = dtypes_file.read_bytes()
        own.add("org/v", {"model.safetensors": data})
        env.setenv("HF_ENDPOINT", own.base)
        want = reference(dtypes_file)
        sha = hashlib.sha256(data).hexdigest()
        blob = tmp_path / "hf_cache" / "models--org--v" / "blobs" / sha
        assert_same_tensors(fastload.load("hf://org/v", cache=True), want)
        fastload.cache_stats()
        assert blob.read_bytes() == data
        bad = bytearray(data)
        bad[-1] ^= 0xFF
        bad_sha = hashlib.sha256(bad).hexdigest()

        # A poisoned copy in the HF cache, cache off: removed, the file read from the Hub.
        blob.write_bytes(bytes(bad))
        capfd.readouterr()
        assert_same_tensors(fastload.load("hf://org/v", verify=True), want)
        assert not blob.exists()
        assert bad_sha in capfd.readouterr().err
        # Cache on: read from the Hub and filled again.
        blob.write_bytes(bytes(bad))
        assert_same_tensors(fastload.load("hf://org/v", cache=True, verify=True), want)
        fastload.cache_stats()
        assert blob.read_bytes() == data

        # The storage host serving wrong bytes of the same size.
        own.storage.poison[sha] = bytes(bad)
        blob.unlink()
        with pytest.raises(fastload.StorageError, match=sha) as e:
            fastload.load("hf://org/v", verify=True)
        assert "model.safetensors" in str(e.value) and bad_sha in str(e.value)
        with pytest.raises(fastload.StorageError, match=bad_sha):
            for _ in fastload.stream("hf://org/v", verify=True):
                pass
        # A fill checks what it writes: the same error, nothing published, nothing left.
        with pytest.raises(fastload.StorageError, match=bad_sha):
            fastload.load("hf://org/v", cache=True)
        fastload.cache_stats()
        assert sorted(blob.parent.iterdir()) == []
    finally:
        own.close()


def _read_every_way(f, want) -> None:
    """Every tensor through get_tensor, a slice of each through get_slice, and get_tensors, all
    bitwise equal to `want`."""
    import torch

    for name in f.keys():
        assert_same_tensor(f.get_tensor(name), want[name], name)
        if want[name].dim() and want[name].numel():
            got, ref = f.get_slice(name)[-1:], want[name][-1:]
            assert got.shape == ref.shape and torch.equal(
                got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)
            ), name
    assert_same_tensors(f.get_tensors(), want)


@needs_cache
@pytest.mark.parametrize("lfs", [True, False], ids=["lfs", "plain"])
def test_safe_open_verify_checks_a_cached_blob_before_serving_it(
    env, tmp_path, dtypes_file, capfd, lfs
):
    """safe_open(verify=True): a same-size poisoned blob in the HF cache is hashed whole (sha256,
    or the git blob id of a file outside LFS) before any byte of it is served: removed, and
    every method reads the file from the Hub. Without verify the blob is served as it is."""
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    own = MockHub()
    try:
        data = dtypes_file.read_bytes()
        if not lfs:
            own.plain.add("model.safetensors")
        own.add("org/v", {"model.safetensors": data})
        env.setenv("HF_ENDPOINT", own.base)
        want = reference(dtypes_file)
        fastload.load("hf://org/v", cache=True)
        fastload.cache_stats()
        blob_id = hashlib.sha256(data).hexdigest() if lfs else git_blob_sha1(data)
        blob = tmp_path / "hf_cache" / "models--org--v" / "blobs" / blob_id
        assert blob.read_bytes() == data
        bad = bytearray(data)
        bad[-1] ^= 0xFF  # the last tensor's last byte
        blob.write_bytes(bytes(bad))
        tensors = fastload.inspect(str(dtypes_file))["tensors"]
        last = max(tensors, key=lambda t: t["data_offsets"][1])["name"]
        uri = "hf://org/v/model.safetensors"
        with fastload.safe_open(uri, "pt") as f:
            assert not torch_equal(f.get_tensor(last), want[last]), "the poisoned blob is read"
        capfd.readouterr()
        with fastload.safe_open(uri, "pt", verify=True) as f:
            assert not blob.exists(), "the poisoned blob was not removed at open"
            _read_every_way(f, want)
        assert "removed, read from the network" in capfd.readouterr().err
    finally:
        own.close()


@needs_cache
def test_safe_open_verify_hashes_a_remote_file_whole_before_serving_it(env, tmp_path, dtypes_file):
    """safe_open(verify=True) over the network: the file is read whole once and hashed when it
    opens; wrong bytes from the storage host are a StorageError naming the sha256s, before any
    tensor is served (and so for a load of some tensors, names=). With cache=, that read fills a
    verified copy, which later reads use."""
    env.setenv("HF_HUB_CACHE", str(tmp_path / "hf_cache"))
    own = MockHub()
    try:
        data = dtypes_file.read_bytes()
        own.add("org/v", {"model.safetensors": data})
        env.setenv("HF_ENDPOINT", own.base)
        want = reference(dtypes_file)
        sha = hashlib.sha256(data).hexdigest()
        bad = bytearray(data)
        bad[-1] ^= 0xFF
        own.storage.poison[sha] = bytes(bad)
        uri = "hf://org/v/model.safetensors"
        with fastload.safe_open(uri, "pt") as f:
            f.get_tensor(f.keys()[0])  # without verify, it opens and serves
        with pytest.raises(fastload.StorageError, match=sha) as e:
            fastload.safe_open(uri, "pt", verify=True)
        assert hashlib.sha256(bad).hexdigest() in str(e.value)
        # A load of some tensors means the same: the file is checked whole first.
        first = next(iter(want))
        with pytest.raises(fastload.StorageError, match=sha):
            fastload.load(uri, verify=True, names=[first])

        del own.storage.poison[sha]
        blob = tmp_path / "hf_cache" / "models--org--v" / "blobs" / sha
        with fastload.safe_open(uri, "pt", verify=True) as f:
            _read_every_way(f, want)
        assert not blob.exists(), "no cache=: nothing written"
        with fastload.safe_open(uri, "pt", verify=True, cache=True) as f:
            gets = len(storage_gets(own))
            _read_every_way(f, want)
            assert len(storage_gets(own)) == gets, "read from the verified copy"
        assert blob.read_bytes() == data
    finally:
        own.close()


def torch_equal(a, b) -> bool:
    import torch

    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


# ---------------------------------------------------------------------------------------------
# Xet-backed repos, as the Hub serves them in 2026: the HEAD of resolve/ answers 302 with the
# metadata (X-Xet-Hash, a Link rel="xet-auth") and a signed URL on a bridge host, which honours
# Range, refuses a plain GET of a large file and ignores Range when gzip is accepted.

XET = "org/xet"


@pytest.fixture(scope="module")
def xet_hub(sharded_dir, multi_block_file):
    hub = MockHub()
    tree = files_of(sharded_dir)
    tree["big.safetensors"] = multi_block_file.read_bytes()
    hub.xet_commit = hub.add(XET, tree, xet=True)
    yield hub
    hub.close()


@pytest.fixture
def xet_env(xet_hub, env):
    env.setenv("HF_ENDPOINT", xet_hub.base)
    xet_hub.bridge.plain_get_limit = 1  # every plain GET of an LFS file is refused
    return env


def bridge_requests(hub, since: int = 0) -> list:
    return hub.requests(hub.bridge)[since:]


def test_a_xet_repo_loads_bitwise_through_the_bridge(xet_hub, xet_env, sharded_dir):
    before, before_hub = len(bridge_requests(xet_hub)), len(xet_hub.requests())
    refused, whole = xet_hub.bridge.refused_plain, xet_hub.bridge.whole_for_gzip
    got = fastload.load(f"hf://{XET}", block_size="64KiB")
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))
    to_bridge = bridge_requests(xet_hub, before)
    # Only ranged GETs, each asking for the bytes as stored; the HEAD's redirect never followed.
    assert to_bridge and all(r[0] == "GET" for r in to_bridge), to_bridge
    assert all(r[2].get("range", "").startswith("bytes=") for r in to_bridge)
    assert all(r[2].get("accept-encoding") == "identity" for r in to_bridge)
    assert xet_hub.bridge.refused_plain == refused and xet_hub.bridge.whole_for_gzip == whole
    # The Hub is asked for the metadata of each Xet file with a HEAD, never for its bytes.
    resolved = [r for r in xet_hub.requests()[before_hub:] if r[1].endswith(".safetensors")]
    assert resolved and all(r[0] == "HEAD" and "/resolve/" in r[1] for r in resolved), resolved
    assert not xet_hub.requests(xet_hub.storage)  # nothing of a xet repo is on the LFS host


def test_a_file_only_fetchable_with_ranges_loads(xet_hub, xet_env, multi_block_file):
    """A file above the bridge's limit for plain GETs (50 GB on the real host) loads."""
    size = multi_block_file.stat().st_size
    xet_hub.bridge.plain_get_limit = size // 2
    url = f"{xet_hub.base}/{XET}/resolve/main/big.safetensors"
    assert _get(_head(url)["location"])[0] == 400  # a plain GET is refused
    got = fastload.load(f"hf://{XET}/big.safetensors", block_size="64KiB")
    assert_same_tensors(got, reference(multi_block_file))


def _head(url: str) -> dict:
    """The headers of a HEAD of `url`, redirects not followed (lower-case names)."""
    import http.client
    import urllib.parse

    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=10)
    try:
        conn.request("HEAD", parts.path)
        response = conn.getresponse()
        response.read()
        return {"status": response.status, **{k.lower(): v for k, v in response.getheaders()}}
    finally:
        conn.close()


def _get(url: str, headers: dict | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_the_mock_serves_xet_files_as_the_hub_does(xet_hub, xet_env, sharded_dir):
    name = "model-00001-of-00003.safetensors"
    data = (sharded_dir / name).read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    head = _head(f"{xet_hub.base}/{XET}/resolve/main/{name}")
    # The metadata is on the 302 itself; the location is a signed URL on another host.
    assert head["status"] == 302, head
    assert head["x-repo-commit"] == xet_hub.xet_commit
    assert head["x-linked-size"] == str(len(data)) and head["x-linked-etag"] == f'"{sha}"'
    assert len(head["x-xet-hash"]) == 64 and head["x-xet-hash"] != sha
    assert 'rel="xet-auth"' in head["link"]
    location = head["location"]
    assert location.startswith(xet_hub.bridge.base) and "Signature=" in location
    # The bridge: 206 for a range, 400 for a plain GET of a file above its limit, the whole file
    # with 200 (Range ignored) when gzip is accepted, and 403 once the signature is altered.
    assert _get(location, {"Range": "bytes=8-15"}) == (206, data[8:16])
    assert _get(location)[0] == 400
    whole = xet_hub.bridge.whole_for_gzip
    assert _get(location, {"Range": "bytes=8-15", "Accept-Encoding": "gzip"}) == (200, data)
    assert xet_hub.bridge.whole_for_gzip == whole + 1
    assert _get(location.replace("Signature=", "Signature=0"), {"Range": "bytes=0-1"})[0] == 403
    xet_hub.bridge.plain_get_limit = len(data)
    assert _get(location) == (200, data)


def test_the_real_client_reads_a_xet_repo(xet_hub, xet_env, sharded_dir, tmp_path, monkeypatch):
    """huggingface_hub downloads a Xet-backed file from the mock through the bridge (hf_xet's
    own protocol is not served: its fallback, plain HTTP, is what reads the bridge)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
    xet_hub.bridge.plain_get_limit = 50 * 10**9
    name = "model-00001-of-00003.safetensors"
    data = (sharded_dir / name).read_bytes()
    before = len(bridge_requests(xet_hub))
    path = huggingface_hub.hf_hub_download(XET, name, endpoint=xet_hub.base, cache_dir=tmp_path)
    assert Path(path).read_bytes() == data
    assert f"snapshots/{xet_hub.xet_commit}/" in path
    # Named by the LFS sha256 in the cache, as for any LFS file.
    assert Path(path).resolve().name == hashlib.sha256(data).hexdigest()
    assert any(r[0] == "GET" for r in bridge_requests(xet_hub, before))


def test_a_whole_file_for_a_range_is_an_error(xet_hub, xet_env, multi_block_file):
    """A host that answers a ranged GET with 200 and the whole file (as CloudFront does when
    gzip is accepted) is refused with a clear error, never taken for the range."""
    xet_hub.bridge.ignores_range = True
    try:
        with pytest.raises(fastload.StorageError, match="ignored Range") as e:
            fastload.load(f"hf://{XET}/big.safetensors", block_size="64KiB")
    finally:
        xet_hub.bridge.ignores_range = False
    assert "big.safetensors" in str(e.value) and "200 OK" in str(e.value), e.value


def test_offline_a_missing_file_is_not_found_and_a_missing_revision_is_named(
    hub_env, tmp_path, dtypes_file
):
    hub = MockHub()
    try:
        commit = hub.add("org/m", {"model.safetensors": dtypes_file.read_bytes()})
        cache = tmp_path / "hf_home" / "hub"
        huggingface_hub.snapshot_download("org/m", endpoint=hub.base, cache_dir=cache)
    finally:
        hub.close()
    hub_env.setenv("HF_HUB_OFFLINE", "1")
    hub_env.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    assert_same_tensors(fastload.load("hf://org/m"), reference(dtypes_file))
    for uri in ("hf://org/m/nope.safetensors", f"hf://org/m@{commit}/nope.safetensors"):
        with pytest.raises(fastload.NotFoundError) as e:
            fastload.load(uri)
        assert "nope.safetensors" in e.value.filename, e.value.filename
        assert "revision" not in str(e.value), str(e.value)
    with pytest.raises(fastload.StorageError) as e:
        fastload.load("hf://org/m@v9/model.safetensors")
    assert not isinstance(e.value, fastload.NotFoundError)
    assert "revision v9" in str(e.value) and "HF_HUB_OFFLINE" in str(e.value)
