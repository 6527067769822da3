"""Peers (`peers=`, `FASTLOAD_PEERS`): a load of an origin URI reads a file from a serve that
lists the same origin object with the same canonical identity, and falls back to the origin at
the byte it reached when the peer dies, stalls, lies or answers 409; a peer of another version
is never used; the token is sent and a wrong one refused. The peer here is
tests/servers/peer.py (protocol v1 from memory, with faults); the origins are the plain HTTP
range server (whose log counts the bytes each GET asked for) and SeaweedFS."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import fastload
import pytest
from helpers import assert_same_tensors, reference, run_ranks, wait_held
from servers import http as http_server
from servers import peer as peer_server
from servers.peer import Fault, PeerFile

BLOCK = 256 << 10
CONCURRENCY = 4
NAME = "model.safetensors"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """About 3 MiB over a dozen tensors: several blocks, several reads in flight."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    tensors = {f"layer.{i}.weight": torch.randn(256, 256 + i, generator=g) for i in range(12)}
    path = tmp_path_factory.mktemp("peers") / NAME
    save_file(tensors, str(path))
    return path


@pytest.fixture
def origin(checkpoint):
    server = http_server.start_server({f"/m/{NAME}": checkpoint.read_bytes()})
    yield server
    server.close()


def origin_bytes(server) -> int:
    """Bytes the origin's GETs asked for (206: their ranges; 200: the whole file)."""
    total = 0
    for method, _path, rng, status in server.behaviour.log:
        if method != "GET" or status not in (200, 206):
            continue
        if status == 200:
            total += len(next(iter(server.files.values())))
            continue
        a, b = rng.split("=")[1].split("-")
        total += int(b) + 1 - int(a)
    return total


def peer_of(origin, data: bytes, *, etag=None, token=None, fault=None):
    """A peer holding `data` as the origin's file, listed under the origin's ETag (or `etag`)."""
    uri = origin.url(f"m/{NAME}")
    tag = etag or origin.etags[f"/m/{NAME}"]
    f = PeerFile(data, {"sha256": None, "etag": tag, "version": None, "commit": None}, uri)
    return peer_server.start({"m": (origin.url("m/"), {NAME: f})}, token=token, fault=fault)


def load(uri, **kw):
    return fastload.load(uri, block_size=BLOCK, concurrency=CONCURRENCY, **kw)


def test_a_peer_holding_the_origin_version_serves_every_byte(origin, checkpoint):
    data = checkpoint.read_bytes()
    peer = peer_of(origin, data)
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[f"127.0.0.1:{peer.server_address[1]}"])
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    assert origin_bytes(origin) == 0
    assert peer.state.sent >= len(data)
    # Every file request named the identity the client pinned at the origin.
    asked = {i for p, i, _ in peer.state.requests if p.startswith("/v1/files/")}
    assert asked == {peer_server.canonical(len(data), origin.etags[f"/m/{NAME}"])}


def test_peers_from_the_environment(origin, checkpoint, monkeypatch):
    peer = peer_of(origin, checkpoint.read_bytes())
    monkeypatch.setenv("FASTLOAD_PEERS", f" ,{peer.base}")
    try:
        got = load(origin.url(f"m/{NAME}"))
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    assert origin_bytes(origin) == 0


def test_the_manifests_are_asked_while_the_origin_is_opened(origin, checkpoint):
    """A load with peers asks their manifests while it pins the origin, not after: here the
    origin answers nothing until the peer was asked for its manifest, so a load that asked
    them in turn would leave the origin's wait to run out (10 s)."""
    peer = peer_of(origin, checkpoint.read_bytes())
    origin.behaviour.hold = peer.state.manifest_asked
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[peer.base])
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    assert origin.behaviour.held_out == 0
    assert origin_bytes(origin) == 0


def test_a_peer_of_another_version_is_not_used(origin, checkpoint):
    data = checkpoint.read_bytes()
    other = bytearray(data)
    other[-1] ^= 0xFF
    peer = peer_of(origin, bytes(other), etag='"another-version"')
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[peer.base])
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    assert not [p for p, *_ in peer.state.requests if p.startswith("/v1/files/")]
    assert peer.state.sent == 0
    assert origin_bytes(origin) >= len(data) - 8


def test_a_peer_answering_409_mid_load_is_dropped_for_the_origin(origin, checkpoint):
    """The manifest said the same version; by the time the tensors are read the peer holds
    another (409 to the pinned identity): the reads go to the origin."""
    data = checkpoint.read_bytes()
    peer = peer_of(origin, data)
    try:
        with fastload.safe_open(origin.url(f"m/{NAME}"), "pt", peers=[peer.base]) as f:
            peer.state.checkpoints["m"][1][NAME].identity["etag"] = '"changed-at-the-peer"'
            got = {k: f.get_tensor(k) for k in f.keys()}
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    codes = [p for p, *_ in peer.state.requests if p.startswith("/v1/files/")]
    assert codes, "the header came from the peer"
    assert origin_bytes(origin) > 0


@pytest.mark.parametrize("fraction", [0.3, 0.6, 0.9])
def test_a_peer_killed_mid_load_falls_back_to_the_origin_at_the_byte_reached(
    origin, checkpoint, fraction
):
    data = checkpoint.read_bytes()
    peer = peer_of(origin, data, fault=Fault(int(len(data) * fraction), "die"))
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[peer.base])
    finally:
        peer.state.release.set()
    assert_same_tensors(got, reference(checkpoint))
    assert peer.state.sent == int(len(data) * fraction)
    assert origin_bytes(origin) <= len(data) - peer.state.sent + CONCURRENCY * BLOCK


def test_a_stalling_peer_is_cut_by_the_stall_rule_and_the_origin_reads_the_rest(origin, checkpoint):
    data = checkpoint.read_bytes()
    peer = peer_of(origin, data, fault=Fault(len(data) // 2, "stall"))
    rule = {"min_rate": "1MiB", "min_rate_window": "1"}
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[peer.base], storage_options=rule)
    finally:
        peer.state.release.set()
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    assert origin_bytes(origin) <= len(data) - peer.state.sent + CONCURRENCY * BLOCK


def test_a_peer_sending_another_identity_mid_load_is_dropped(origin, checkpoint, capfd):
    data = checkpoint.read_bytes()
    peer = peer_of(origin, data, fault=Fault(len(data) // 2, "lie"))
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[peer.base])
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    lied = [i for p, i, _ in peer.state.requests if p.startswith("/v1/files/")]
    assert len(lied) > 1
    assert origin_bytes(origin) <= len(data) - len(data) // 2 + CONCURRENCY * BLOCK
    assert "dropped" in capfd.readouterr().err


def test_a_lying_peer_never_sends_bytes_that_land(origin, checkpoint):
    """A peer whose identity differs from its first answer on: not one of its bytes is used."""
    data = checkpoint.read_bytes()
    garbage = bytes(len(data))
    peer = peer_of(origin, garbage, fault=Fault(0, "lie"))
    try:
        got = load(origin.url(f"m/{NAME}"), peers=[peer.base])
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))


def test_the_token_is_sent_and_a_missing_or_wrong_one_refused(origin, checkpoint, capfd):
    data = checkpoint.read_bytes()
    secret = "peer-s3cret-token"
    peer = peer_of(origin, data, token=secret)
    uri = origin.url(f"m/{NAME}")
    try:
        assert_same_tensors(load(uri, peers=[peer.base], peer_token=secret), reference(checkpoint))
        assert origin_bytes(origin) == 0
        assert all(ok for *_, ok in peer.state.requests)
        for token in (None, "wrong-token"):
            origin.behaviour.log.clear()
            peer.state.requests.clear()
            got = load(uri, peers=[peer.base], peer_token=token)
            assert_same_tensors(got, reference(checkpoint))
            assert [ok for *_, ok in peer.state.requests] == [False]  # the manifest, refused
            assert origin_bytes(origin) >= len(data) - 8
    finally:
        peer.close()
    err = capfd.readouterr().err
    assert "401" in err
    assert secret not in err and "wrong-token" not in err


def test_peer_options_are_checked(origin):
    for bad in ("ftp://h:1", "http://h:1/path", "not a peer"):
        with pytest.raises(fastload.ConfigError) as info:
            load(origin.url(f"m/{NAME}"), peers=[bad])
        assert info.value.option == "peers"
    with pytest.raises(fastload.ConfigError) as info:
        load(origin.url(f"m/{NAME}"), peers=[5])
    assert info.value.option == "peers"


def test_s3_origin_through_a_peer(s3_store, checkpoint, monkeypatch):
    """SeaweedFS as the origin: the identity the client pins (its ETag, no version id) is the
    one the peer lists, so the bytes come from the peer."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_store.endpoint)
    for k, v in s3_store.env().items():
        monkeypatch.setenv(k, v)
    from servers import s3 as s3_server
    from stores import S3_BUCKET

    data = checkpoint.read_bytes()
    client = s3_store.server.client()
    s3_server.upload(client, S3_BUCKET, {f"peers/{NAME}": data})
    head = client.head_object(Bucket=S3_BUCKET, Key=f"peers/{NAME}")
    uri = s3_store.uri(f"peers/{NAME}")
    identity = {"sha256": None, "etag": head["ETag"], "version": head.get("VersionId")}
    f = PeerFile(data, identity, uri)
    peer = peer_server.start({"m": (s3_store.uri("peers/"), {NAME: f})})
    try:
        got = load(uri, peers=[peer.base])
    finally:
        peer.close()
    assert_same_tensors(got, reference(checkpoint))
    assert peer.state.sent >= len(data)


RANK_SCRIPT = """
import json, os, sys
from datetime import timedelta
import torch.distributed as dist
import fastload
dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
got = fastload.load(sys.argv[1], process_group=dist.group.WORLD, block_size=262144)
out = {k: v.float().sum().item() for k, v in got.items()}
open(sys.argv[2] + f"/rank{dist.get_rank()}.json", "w").write(json.dumps(out))
dist.barrier()
dist.destroy_process_group()
"""


def test_a_group_of_three_ranks_reads_each_byte_once_from_the_peer(origin, checkpoint, tmp_path):
    from safetensors import safe_open

    data = checkpoint.read_bytes()
    peer = peer_of(origin, data)
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    env = {**os.environ, "FASTLOAD_PEERS": peer.base}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    uri = origin.url(f"m/{NAME}")
    try:
        run_ranks(3, [sys.executable, str(script), uri, str(tmp_path)], tmp_path, env, 120)
    finally:
        peer.close()
    with safe_open(str(checkpoint), "pt") as f:
        want = {k: f.get_tensor(k).float().sum().item() for k in f.keys()}
    for r in range(3):
        assert json.loads((tmp_path / f"rank{r}.json").read_text()) == want
    tensor_bytes = sum(t.numel() * t.element_size() for t in reference(checkpoint).values())
    probe = min(len(data), 256 << 10)
    # Each tensor byte once over the group, from the peer; each rank reads the header itself,
    # twice (the group's agreement on the tensors, then the load), from the peer too: nothing
    # from the origin.
    assert tensor_bytes <= peer.state.sent <= tensor_bytes + 2 * 3 * probe
    assert origin_bytes(origin) == 0


# ---------------------------------------------------------------------------------------------
# Against the real serve (`python -m fastload serve`, a subprocess on 127.0.0.1)


class RealServe:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        import select
        import subprocess

        python = str(Path(__file__).resolve().parent.parent / "python")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastload", "serve", "--port", "0", *args],
            env={**os.environ, "PYTHONPATH": python, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if "serving on" not in line:
            self.close()
            pytest.skip(f"no fastload serve in this build: {line!r}")
        self.base = line.split("serving on", 1)[1].strip()

    def bytes_served(self) -> int:
        import urllib.request

        with urllib.request.urlopen(f"{self.base}/metrics", timeout=10) as r:
            lines = r.read().decode().splitlines()
        # Bytes sent (not fastload_serve_bytes_held: what it holds).
        return sum(
            int(float(x.rsplit(" ", 1)[1]))
            for x in lines
            if x.startswith("fastload_serve_bytes_total")
        )

    def manifest(self) -> dict:
        import urllib.request

        with urllib.request.urlopen(f"{self.base}/v1/manifest", timeout=10) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


def test_the_real_serve_of_an_s3_origin_serves_a_load_of_that_origin(
    s3_store, checkpoint, monkeypatch, tmp_path
):
    from servers import s3 as s3_server
    from stores import S3_BUCKET

    env = {**s3_store.env(), "FASTLOAD_CACHE": str(tmp_path / "cache")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    data = checkpoint.read_bytes()
    s3_server.upload(s3_store.server.client(), S3_BUCKET, {f"real/{NAME}": data})
    serve = RealServe([s3_store.uri("real/")], env)
    try:
        got = load(s3_store.uri(f"real/{NAME}"), peers=[serve.base.split("://")[1]])
        served = serve.bytes_served()
    finally:
        serve.close()
    assert_same_tensors(got, reference(checkpoint))
    assert served >= len(data)


def test_the_real_serve_of_a_hub_origin_serves_a_load_of_that_origin(
    checkpoint, monkeypatch, tmp_path
):
    """Two processes: `fastload serve hf://org/pair` filled from the mock Hub, and a load of the
    same hf:// URI with peers= that takes every byte of the file from the serve: the Hub's
    storage sends it nothing (the Hub's API still names the commit and sha256 it pins)."""
    import urllib.request

    from servers.hub import MockHub

    data = checkpoint.read_bytes()
    hub = MockHub()
    try:
        hub.add("org/pair", {NAME: data, "config.json": b'{"model_type": "llama"}'})
        serve_env = {
            "HF_ENDPOINT": hub.base,
            "HF_HOME": str(tmp_path / "serve-hf"),
            "FASTLOAD_CACHE": str(tmp_path / "serve-cache"),
        }
        serve = RealServe(["hf://org/pair"], serve_env)
        try:
            # The serve fills from the Hub on first use: one whole read of the file, then the
            # fill finishes in the background (until then the serve reads the Hub for what it is
            # asked).
            with urllib.request.urlopen(f"{serve.base}/v1/files/pair/{NAME}", timeout=60) as r:
                assert r.read() == data
            wait_held(serve.manifest)
            filled = serve.bytes_served()
            monkeypatch.setenv("HF_ENDPOINT", hub.base)
            monkeypatch.setenv("HF_HOME", str(tmp_path / "client-hf"))
            monkeypatch.setenv("FASTLOAD_CACHE", str(tmp_path / "client-cache"))
            for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
                monkeypatch.delenv(var, raising=False)
            before = [r for r in hub.requests(hub.storage) if r[0] == "GET"]
            got = load("hf://org/pair", peers=[serve.base.split("://")[1]])
            after = [r for r in hub.requests(hub.storage) if r[0] == "GET"]
            served = serve.bytes_served() - filled
        finally:
            serve.close()
    finally:
        hub.close()
    assert_same_tensors(got, reference(checkpoint))
    assert after == before
    assert served >= len(data)


def test_fastload_bench_reads_from_the_peers_its_peers_flag_names(
    s3_store, checkpoint, monkeypatch, tmp_path
):
    """`fastload bench URI --peers HOST:PORT`: the runs read the file from that serve (its
    /metrics count every byte), as a load with `peers=` does; a peer that is no host:port is
    refused by the flag's name."""
    import subprocess

    from servers import s3 as s3_server
    from stores import S3_BUCKET

    for k, v in s3_store.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("FASTLOAD_PEERS", raising=False)
    data = checkpoint.read_bytes()
    s3_server.upload(s3_store.server.client(), S3_BUCKET, {f"bench/{NAME}": data})
    serve = RealServe([s3_store.uri("bench/")], {"FASTLOAD_CACHE": str(tmp_path / "cache")})
    bench = [sys.executable, "-m", "fastload", "bench", s3_store.uri(f"bench/{NAME}")]
    bench += ["--repeat", "1", "--compare=none", "--json"]
    try:
        run = subprocess.run(
            [*bench, "--peers", serve.base.split("://")[1]],
            capture_output=True,
            text=True,
            timeout=300,
        )
        served = serve.bytes_served()
        bad = subprocess.run([*bench, "--peers", "ftp://x:1"], capture_output=True, text=True)
    finally:
        serve.close()
    assert run.returncode == 0, run.stderr[-2000:]
    assert served >= len(data), run.stderr[-2000:]
    assert bad.returncode != 0 and "--peers" in bad.stderr, bad.stderr[-2000:]


def test_the_real_serve_of_a_versioned_bucket_serves_the_version_a_client_pins(
    s3_store, checkpoint, monkeypatch, tmp_path
):
    """A versioned bucket: the serve pins each object it lists by a HEAD, version id included,
    so a client that pins the object by its own HEAD (one object named) or by a listing (the
    prefix) reads it from the serve. Once the object has a new version, the serve (pinned to the
    old one) is not asked, and the load reads the new version from the origin."""
    import torch
    from safetensors.torch import save_file
    from servers import s3 as s3_server

    for k, v in s3_store.env().items():
        monkeypatch.setenv(k, v)
    # The serve's cache only: a client with one would read its own copy the second time.
    env = {**s3_store.env(), "FASTLOAD_CACHE": str(tmp_path / "cache")}
    s3, bucket, key = s3_store.server.client(), "peers-versioned", f"m/{NAME}"
    s3_server.upload(s3, bucket, {})
    s3.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    data = checkpoint.read_bytes()
    s3_server.upload(s3, bucket, {key: data})
    version = s3.head_object(Bucket=bucket, Key=key).get("VersionId")
    assert version not in (None, "null")
    serve = RealServe([f"s3://{bucket}/m/"], env)
    peers = [serve.base.split("://")[1]]
    new = tmp_path / "new.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, str(new))
    try:
        import urllib.request

        with urllib.request.urlopen(f"{serve.base}/v1/manifest", timeout=10) as r:
            listed = json.loads(r.read())["checkpoints"][0]["files"][0]["identity"]
        one = load(f"s3://{bucket}/{key}", peers=peers)
        after_one = serve.bytes_served()
        prefix = load(f"s3://{bucket}/m/", peers=peers)
        after_prefix = serve.bytes_served()
        s3_server.upload(s3, bucket, {key: new.read_bytes()})
        newer = load(f"s3://{bucket}/{key}", peers=peers)
        newer_prefix = load(f"s3://{bucket}/m/", peers=peers)
        last = serve.bytes_served()
    finally:
        serve.close()
    assert_same_tensors(one, reference(checkpoint))
    assert_same_tensors(prefix, reference(checkpoint))
    assert after_one >= len(data)
    assert after_prefix - after_one >= len(data)
    assert_same_tensors(newer, reference(new))
    assert_same_tensors(newer_prefix, reference(new))
    assert last == after_prefix
    assert listed["version"] == version


def test_peer_uris_load_straight_from_the_real_serve_of_a_folder(checkpoint, tmp_path):
    import shutil

    folder = tmp_path / "ckpt"
    folder.mkdir()
    shutil.copy(checkpoint, folder / NAME)
    serve = RealServe([str(folder), "--name", "m"])
    authority = serve.base.split("://")[1]
    try:
        whole = load(f"peer://{authority}/m")
        one = load(f"peer://{authority}/m/{NAME}")
        with pytest.raises(fastload.FastloadError):
            load(f"peer://{authority}/nothing-here")
    finally:
        serve.close()
    assert_same_tensors(whole, reference(checkpoint))
    assert_same_tensors(one, reference(checkpoint))


def test_a_hub_origin_is_read_from_a_peer_listing_its_commit_path_and_sha256(hub_store):
    """The mock Hub as the origin: a peer whose checkpoint is `hf://org/repo@<commit>` and
    whose file has the Hub's sha256 serves the load; one with another commit is not asked."""
    import hashlib

    from stores import HUB_REPO

    key = "big.safetensors"
    repo = hub_store.server.repos[HUB_REPO]
    commit = repo.refs["main"]
    data = repo.commits[commit][key]
    sha = hashlib.sha256(data).hexdigest()
    identity = {"sha256": sha, "etag": None, "version": None, "commit": commit}
    f = PeerFile(data, identity, None)
    uri = hub_store.uri(key)
    options = hub_store.options()
    want = fastload.load(uri, storage_options=options)
    for origin, used in (
        (f"hf://{HUB_REPO}@{commit}", True),
        (f"hf://{HUB_REPO}@{'0' * 40}", False),
    ):
        peer = peer_server.start({"big": (origin, {key: f})})
        try:
            got = load(uri, peers=[peer.base], storage_options=options)
        finally:
            peer.close()
        assert_same_tensors(got, want)
        assert (peer.state.sent >= len(data)) == used, origin
        assert bool([p for p, *_ in peer.state.requests if p.startswith("/v1/files/")]) == used
