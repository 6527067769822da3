"""Writes to gs:// and az:// through object_store's real GCS and Azure clients: save_file, save
and copy produce the bytes safetensors writes, never a partial object, keep an existing object
with overwrite=False, and every upload carries the checksum its store verifies on receipt. And
`verify=True` on reads of s3://, gs:// and az:// objects: the bytes are checked against the
whole-object checksum each store keeps (SeaweedFS's CRC64NVME / sha256, GCS's crc32c, Azure's
Content-MD5).

- az://: servers/azure.py, ours, with the write API object_store's Azure client uses (Put Blob,
  Put Block, Put Block List; SharedKey signatures verified; Content-MD5 checked).
- gs://: fake-gcs-server (reads, listings, storage) behind servers/gcs.py's WriteRelay, which
  serves the XML API's uploads fake-gcs-server answers 400 (a single PUT, multipart uploads) and
  checks each request's service-account JWT.
"""

from __future__ import annotations

import json
import urllib.parse

import fastload
import pytest
import torch
from helpers import assert_same_tensors, pattern
from safetensors.torch import save
from servers import gcs as gcs_server
from servers import s3 as s3_server
from servers.azure import AzureBlobServer
from servers.s3 import Fault, HttpFaultProxy, closed_port

aws_env = s3_server.aws_env

PART = 5 << 20
ACCOUNT = "fastloadwrites"
KEY = "ZmFzdGxvYWQtd3JpdGUtdGVzdC1rZXktbm90LWEtc2VjcmV0"
CONTAINER = "models"
BUCKET = "models"


def big_tensors() -> dict[str, torch.Tensor]:
    """About 8 MiB: two parts of 5 MiB."""
    return {
        "embed": pattern((1024, 2048), torch.bfloat16, seed=1),
        "proj": pattern((1024, 1024), torch.float32, seed=2),
        "norm": pattern((333,), torch.float16, seed=3),
        "step": torch.tensor(5),
    }


# ---------------------------------------------------------------------------------------------
# The stores


class Az:
    name = "az"

    def __init__(self) -> None:
        self.server = AzureBlobServer({ACCOUNT: KEY})
        self.server.containers[(ACCOUNT, CONTAINER)] = {}
        self.options = {
            "account_name": ACCOUNT,
            "access_key": KEY,
            "endpoint": self.server.endpoint(ACCOUNT),
        }

    def uri(self, key: str) -> str:
        return f"az://{CONTAINER}/{key}"

    def objects(self, prefix: str) -> dict[str, bytes]:
        blobs = self.server.containers[(ACCOUNT, CONTAINER)]
        return {k[len(prefix) :]: b.data for k, b in blobs.items() if k.startswith(prefix)}

    def put(self, key: str, data: bytes) -> None:
        self.server.put(ACCOUNT, CONTAINER, {key: data})

    def open_uploads(self, prefix: str) -> list[str]:
        """Blobs with uncommitted blocks. Azure has no abort: the service drops uncommitted
        blocks a week after their last change, or when the blob is next committed."""
        found = self.server.uncommitted(ACCOUNT, CONTAINER)
        return sorted(k for k in found if k.startswith(prefix))

    def set_corrupt(self, n: int, prefix: str = "") -> None:
        self.server.corrupt_uploads, self.server.corrupt_prefix = n, prefix

    def data_writes(self, prefix: str) -> list[dict]:
        return [
            h for what, name, h, _ in self.server.stats.writes
            if what in ("block", "blob") and name.startswith(prefix)
        ]  # fmt: skip

    checksum_header = "content-md5"

    def close(self) -> None:
        self.server.close()


class Gs:
    name = "gs"

    def __init__(self, fake) -> None:
        key = gcs_server.new_key()
        target = urllib.parse.urlsplit(fake.endpoint)
        self.fake = fake
        self.relay = gcs_server.WriteRelay((target.hostname, target.port), key.public_key())
        fake.upload(BUCKET, {})
        self.options = {
            "endpoint": self.relay.endpoint,
            "service_account_key": gcs_server.service_account(key),
        }

    def uri(self, key: str) -> str:
        return f"gs://{BUCKET}/{key}"

    def objects(self, prefix: str) -> dict[str, bytes]:
        import urllib.request

        query = urllib.parse.urlencode({"prefix": prefix})
        with urllib.request.urlopen(f"{self.fake.endpoint}/storage/v1/b/{BUCKET}/o?{query}") as r:
            names = [o["name"] for o in json.load(r).get("items", [])]
        out = {}
        for name in names:
            quoted = urllib.parse.quote(name, safe="")
            url = f"{self.fake.endpoint}/storage/v1/b/{BUCKET}/o/{quoted}?alt=media"
            with urllib.request.urlopen(url) as r:
                out[name[len(prefix) :]] = r.read()
        return out

    def put(self, key: str, data: bytes) -> None:
        self.fake.upload(BUCKET, {key: data})

    def open_uploads(self, prefix: str) -> list[str]:
        return [k for k in self.relay.open_uploads() if k.startswith(prefix)]

    def set_corrupt(self, n: int, prefix: str = "") -> None:
        self.relay.corrupt_uploads, self.relay.corrupt_prefix = n, prefix

    def data_writes(self, prefix: str) -> list[dict]:
        return [
            h for what, name, h, _ in self.relay.stats.writes
            if what in ("put", "part") and name.startswith(prefix)
        ]  # fmt: skip

    checksum_header = "x-goog-hash"

    def close(self) -> None:
        self.relay.close()


@pytest.fixture(autouse=True)
def no_cloud_settings(monkeypatch):
    """No GCS or Azure settings of the caller's; metadata servers at a closed local port."""
    import os

    for var in list(os.environ):
        if var.startswith(("AZURE_", "GOOGLE_", "STORAGE_EMULATOR")):
            monkeypatch.delenv(var)
    dead = f"127.0.0.1:{closed_port()}"
    monkeypatch.setenv("GCE_METADATA_HOST", dead)
    monkeypatch.setenv("GCE_METADATA_IP", dead)
    monkeypatch.setenv("AZURE_MSI_ENDPOINT", f"http://{dead}/token")


@pytest.fixture(scope="module", params=["az", "gs"])
def store(request):
    if request.param == "az":
        s = Az()
    else:
        s = Gs(request.getfixturevalue("fake_gcs"))
    yield s
    s.close()


@pytest.fixture
def prefix(request) -> str:
    return request.node.name.replace("[", "-").rstrip("]") + "/"


# ---------------------------------------------------------------------------------------------
# save_file, save, copy


def test_save_file_uploads_safetensors_bytes_with_checksummed_parts(store, prefix):
    tensors = big_tensors()
    uri = store.uri(prefix + "model.safetensors")
    opts = store.options
    fastload.save_file(tensors, uri, {"format": "pt"}, storage_options=opts, part_size=PART)
    fastload.save_file({"x": torch.arange(10)}, store.uri(prefix + "small.safetensors"),
                       storage_options=opts)  # fmt: skip
    assert store.objects(prefix) == {
        "model.safetensors": save(tensors, metadata={"format": "pt"}),
        "small.safetensors": save({"x": torch.arange(10)}),
    }
    assert store.open_uploads(prefix) == []
    # Two parts and the small file's one PUT, each with the checksum the store verified.
    writes = store.data_writes(prefix)
    assert len(writes) == 3
    assert all(store.checksum_header in w for w in writes), writes
    assert_same_tensors(fastload.load(uri, storage_options=opts), tensors)


def test_a_part_corrupted_on_the_way_is_refused_and_nothing_is_published(store, prefix):
    # The store flips a byte of the second part as it arrives; the part's checksum no longer
    # matches, so the store refuses it and the write fails naming the object. Without the
    # checksum the corrupted part would be stored and the object published with that byte.
    uri = store.uri(prefix + "model.safetensors")
    store.set_corrupt(0)
    tensors = big_tensors()
    writer = fastload._fastload.FileWriter(
        uri, [("a", "U8", [3 * PART])], storage_options=store.options, part_size=PART
    )
    store.set_corrupt(1)
    try:
        with pytest.raises(fastload.StorageError) as e:
            writer.write(torch.ones(3 * PART, dtype=torch.uint8))
            writer.finish()
    finally:
        store.set_corrupt(0)
    assert uri in str(e.value)
    assert "Md5Mismatch" in str(e.value) or "BadDigest" in str(e.value)
    assert store.objects(prefix) == {}
    # A small object's one PUT is checked the same way (only its upload is flipped: the first
    # writer's other parts may still arrive, and once took the flip themselves).
    store.set_corrupt(1, prefix + "s")
    try:
        with pytest.raises(fastload.StorageError):
            fastload.save_file(tensors | {"small": torch.ones(3)}, store.uri(prefix + "s"),
                               storage_options=store.options)  # fmt: skip
    finally:
        store.set_corrupt(0)
    assert store.objects(prefix) == {}


def test_save_writes_shards_then_the_index(store, prefix):
    sd = {f"layer.{i}.w": pattern((256, 1024), torch.float32, seed=i) for i in range(4)}
    dst = store.uri(prefix)
    names = fastload.save(sd, dst, max_shard_size="2MB", storage_options=store.options)
    assert names[-1] == "model.safetensors.index.json" and len(names) == 5
    got = store.objects(prefix)
    assert sorted(got) == sorted(names)
    index = json.loads(got["model.safetensors.index.json"])
    assert set(index["weight_map"]) == set(sd)
    assert_same_tensors(fastload.load(dst, storage_options=store.options), sd)
    for name in names[:-1]:
        tensors = {k: sd[k] for k, v in index["weight_map"].items() if v == name}
        assert got[name] == save(tensors, metadata={"format": "pt"})


def test_copy_a_folder_into_the_store_and_a_rerun_skips_it(store, prefix, tmp_path):
    src = tmp_path / "model"
    src.mkdir()
    tensors = big_tensors()
    (src / "model.safetensors").write_bytes(save(tensors))
    (src / "config.json").write_text('{"model_type": "llama"}')
    dst = store.uri(prefix)
    out = fastload.copy(str(src), dst, storage_options=store.options, part_size=PART,
                        progress=False)  # fmt: skip
    assert sorted(out["copied"]) == [dst + "config.json", dst + "model.safetensors"]
    assert store.objects(prefix) == {p.name: p.read_bytes() for p in src.iterdir()}
    assert store.open_uploads(prefix) == []
    again = fastload.copy(str(src), dst, storage_options=store.options, progress=False)
    assert again["copied"] == [] and sorted(again["skipped"]) == sorted(out["copied"])


# ---------------------------------------------------------------------------------------------
# Never a partial object, never an unasked overwrite


def test_an_existing_object_is_kept_with_overwrite_false_and_replaced_by_default(store, prefix):
    key = prefix + "model.safetensors"
    store.put(key, b"theirs")
    for tensors in ({"x": torch.zeros(2)}, big_tensors()):
        with pytest.raises(fastload.DestinationExistsError, match="already exists"):
            fastload.save_file(tensors, store.uri(key), storage_options=store.options,
                               part_size=PART, overwrite=False)  # fmt: skip
    assert store.objects(prefix) == {"model.safetensors": b"theirs"}
    fastload.save_file({"x": torch.zeros(2)}, store.uri(key), storage_options=store.options)
    assert store.objects(prefix) == {"model.safetensors": save({"x": torch.zeros(2)})}


@pytest.mark.parametrize("size", [1000, 3 << 20], ids=["one-put", "multipart"])
def test_an_object_created_while_writing_is_not_replaced(store, prefix, size):
    # After the writer's first check: its one PUT is conditional (If-None-Match: * on Azure,
    # x-goog-if-generation-match: 0 on GCS), and the store refuses it; a multipart upload is
    # checked again before it completes.
    key = prefix + "model.safetensors"
    writer = fastload._fastload.FileWriter(
        store.uri(key), [("a", "F32", [size])], storage_options=store.options, part_size=PART
    )
    writer.write(torch.zeros(size))
    store.put(key, b"theirs")
    with pytest.raises(fastload.DestinationExistsError):
        writer.finish()
    del writer
    assert store.objects(prefix) == {"model.safetensors": b"theirs"}
    if store.name == "gs":
        assert store.open_uploads(prefix) == []


def test_a_store_that_keeps_failing_parts_leaves_no_object(store, prefix):
    uri = store.uri(prefix + "model.safetensors")
    server = store.server if store.name == "az" else store.relay
    attr = "fail_blocks" if store.name == "az" else "fail_parts"
    setattr(server, attr, 1000)
    try:
        with pytest.raises(fastload.StorageError) as e:
            fastload.save_file(big_tensors(), uri, part_size=PART, storage_options={
                **store.options, "max_retries": "1", "retry_timeout": "5"})  # fmt: skip
    finally:
        setattr(server, attr, 0)
    assert uri in str(e.value)
    assert store.objects(prefix) == {}
    if store.name == "gs":
        assert store.open_uploads(prefix) == []  # aborted (DELETE ?uploadId)


def test_a_writer_dropped_unfinished_publishes_nothing(store, prefix):
    uri = store.uri(prefix + "model.safetensors")
    writer = fastload._fastload.FileWriter(
        uri, [("a", "F32", [4 << 20])], storage_options=store.options, part_size=PART
    )
    writer.write(torch.zeros(4 << 20))
    del writer
    assert store.objects(prefix) == {}
    if store.name == "gs":
        assert store.open_uploads(prefix) == []


def test_gcs_writes_need_valid_credentials(fake_gcs, prefix):
    store = Gs(fake_gcs)
    try:
        other = gcs_server.service_account(gcs_server.new_key())
        opts = store.options | {"service_account_key": other}
        uri = store.uri(prefix + "model.safetensors")
        with pytest.raises(fastload.StorageError) as e:
            fastload.save_file({"x": torch.zeros(2)}, uri, storage_options=opts)
        assert uri in str(e.value)
        assert store.objects(prefix) == {}
    finally:
        store.close()


def test_azure_writes_are_signed(prefix):
    store = Az()
    try:
        opts = store.options | {"access_key": "bm90LXRoZS1rZXk="}
        uri = store.uri(prefix + "model.safetensors")
        with pytest.raises(fastload.StorageError) as e:
            fastload.save_file(big_tensors(), uri, storage_options=opts, part_size=PART)
        assert uri in str(e.value)
        assert store.objects(prefix) == {}
        assert store.open_uploads(prefix) == []
    finally:
        store.close()


# ---------------------------------------------------------------------------------------------
# verify=True: the store's checksum of the whole object


def data_gets(method: str, headers: dict[str, str]) -> bool:
    """Ranged GETs past the header probe (which reads from byte 0)."""
    return method == "GET" and "range" in headers and not headers["range"].startswith("bytes=0-")


FLIP_AT = 300_000  # a body offset past the 256 KiB header probe: tensor bytes


@pytest.mark.parametrize(
    "algorithm,part_size",
    [("crc64nvme", PART), ("crc64nvme", None), ("sha256", None)],
    ids=["crc64nvme-multipart", "crc64nvme-one-put", "sha256-one-put"],
)
def test_verify_checks_s3_objects_against_their_stored_checksum(
    seaweed, aws_env, algorithm, part_size, capfd
):
    aws_env(seaweed)
    client = seaweed.client()
    s3_server.ensure_bucket(client, s3_server.BUCKET)
    key = f"verify/{algorithm}-{part_size}/model.safetensors"
    uri = f"s3://{s3_server.BUCKET}/{key}"
    tensors = big_tensors()
    fastload.save_file(tensors, uri, part_size=part_size, overwrite=True,
                       storage_options={"checksum_algorithm": algorithm})  # fmt: skip
    head = client.head_object(Bucket=s3_server.BUCKET, Key=key, ChecksumMode="ENABLED")
    assert f"x-amz-checksum-{algorithm}" in head["ResponseMetadata"]["HTTPHeaders"]
    assert_same_tensors(fastload.load(uri, verify=True), tensors)
    assert "not verified" not in capfd.readouterr().err
    port = int(seaweed.endpoint.rsplit(":", 1)[1])
    with HttpFaultProxy(("127.0.0.1", port), then=Fault("flip", after=FLIP_AT),
                        match=data_gets) as proxy:  # fmt: skip
        opts = {"endpoint": proxy.endpoint}
        # Unchecked, the flipped byte goes unnoticed: it lands in a tensor.
        got = fastload.load(uri, storage_options=opts)
        assert any(not torch.equal(got[k], tensors[k]) for k in tensors)
        with pytest.raises(fastload.FastloadError) as e:
            fastload.load(uri, storage_options=opts, verify=True)
    assert uri in str(e.value) and f"stored {algorithm} mismatch" in str(e.value)


def test_verify_passes_an_s3_object_with_only_a_composite_checksum_with_a_note(
    seaweed, aws_env, capfd
):
    aws_env(seaweed)
    uri = f"s3://{s3_server.BUCKET}/verify/composite/model.safetensors"
    tensors = big_tensors()
    fastload.save_file(tensors, uri, part_size=PART, overwrite=True,
                       storage_options={"checksum_algorithm": "sha256"})  # fmt: skip
    assert_same_tensors(fastload.load(uri, verify=True), tensors)
    err = capfd.readouterr().err
    assert f"{uri}: not verified" in err and "composite sha256 of its 2 upload parts" in err


def test_verify_checks_gcs_objects_against_their_crc32c(fake_gcs, prefix):
    store = Gs(fake_gcs)
    try:
        uri = store.uri(prefix + "model.safetensors")
        tensors = big_tensors()
        fastload.save_file(tensors, uri, part_size=PART, storage_options=store.options)
        got = fastload.load(uri, storage_options=store.options, verify=True)
        assert_same_tensors(got, tensors)
        store.relay.flip_reads_at = FLIP_AT
        with pytest.raises(fastload.FastloadError) as e:
            fastload.load(uri, storage_options=store.options, verify=True)
        assert uri in str(e.value) and "stored crc32c mismatch" in str(e.value)
    finally:
        store.close()


def test_verify_checks_azure_blobs_against_their_content_md5(prefix, capfd):
    store = Az()
    try:
        tensors = big_tensors()
        one = store.uri(prefix + "one.safetensors")
        blocks = store.uri(prefix + "blocks.safetensors")
        # Put Blob: the service keeps the blob's MD5. Put Block List: no MD5 unless the writer
        # sets one, which object_store cannot.
        fastload.save_file(tensors, one, storage_options=store.options, part_size=64 << 20)
        fastload.save_file(tensors, blocks, storage_options=store.options, part_size=PART)
        assert_same_tensors(fastload.load(one, storage_options=store.options, verify=True),
                            tensors)  # fmt: skip
        assert "not verified" not in capfd.readouterr().err
        assert_same_tensors(fastload.load(blocks, storage_options=store.options, verify=True),
                            tensors)  # fmt: skip
        err = capfd.readouterr().err
        assert f"{blocks}: not verified: its store reports no checksum" in err
        # A byte changed at rest, the stored MD5 kept.
        blob = store.server.containers[(ACCOUNT, CONTAINER)][prefix + "one.safetensors"]
        blob.data = (
            blob.data[:FLIP_AT] + bytes([blob.data[FLIP_AT] ^ 0xFF]) + blob.data[FLIP_AT + 1 :]
        )
        with pytest.raises(fastload.FastloadError) as e:
            fastload.load(one, storage_options=store.options, verify=True)
        assert one in str(e.value) and "stored MD5 mismatch" in str(e.value)
        # A reader of parts reads the blob whole and checks it when it opens.
        with pytest.raises(fastload.FastloadError, match="stored MD5 mismatch"):
            with fastload.safe_open(one, storage_options=store.options, verify=True) as f:
                f.get_tensor("step")
    finally:
        store.close()
