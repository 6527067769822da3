"""``_fastload.list_objects`` and ``_fastload.fetch_small_file``: the folder listing and whole small
reads that bring a model's config and tokenizer files from an object store (fastload.vllm pulls
them for ``vllm serve s3://... --load-format fastload``), on SeaweedFS, fake-gcs-server and the
Azure server of stores.py, with the stores' own credentials and endpoint rules."""

from __future__ import annotations

import os

import fastload
import pytest
import stores
from fastload import _fastload

# Plain HTTP cannot list (stores.Http.no_listing): not an object store a model path can name.
BACKENDS = ["s3", "gcs", "azure"]


@pytest.fixture(params=BACKENDS)
def store(request, monkeypatch) -> stores.Store:
    backend: stores.Store = request.getfixturevalue(f"{request.param}_store")
    for var in [v for v in os.environ if v.startswith(("AWS_", "GOOGLE_", "AZURE"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for var, value in backend.env().items():
        monkeypatch.setenv(var, value)
    return backend


def test_list_folder_with_sizes(store, store_files, sharded_dir):
    """Objects directly under the prefix, with or without its `/`, in name order: what the
    sharded folder holds, not `plain/sub/` one level down."""
    expected = sorted(
        (store.uri(f"sharded/{p.name}"), p.stat().st_size) for p in sharded_dir.iterdir()
    )
    assert _fastload.list_objects(store.uri("sharded/")) == expected
    assert _fastload.list_objects(store.uri("sharded")) == expected
    plain = [uri for uri, _ in _fastload.list_objects(store.uri("plain"))]
    assert plain and not [u for u in plain if "/sub/" in u], plain
    assert _fastload.list_objects(store.uri("nothing-here/")) == []


def test_small_objects_are_read_whole_up_to_their_limit(store, sharded_dir, tmp_path):
    """A small object (the index here, as a config or tokenizer file would be) is read whole into
    the destination; exactly at the limit is fine, one byte under it is left unread."""
    index = sharded_dir / "model.safetensors.index.json"
    uri, size = store.uri(f"sharded/{index.name}"), index.stat().st_size
    dest = tmp_path / "small"
    dest.mkdir()
    assert _fastload.fetch_small_file(uri, str(dest), index.name, 1 << 20) == ("written", size)
    assert (dest / index.name).read_bytes() == index.read_bytes()
    (dest / index.name).unlink()
    assert _fastload.fetch_small_file(uri, str(dest), index.name, size) == ("written", size)
    (dest / index.name).unlink()
    assert _fastload.fetch_small_file(uri, str(dest), index.name, size - 1) == ("too_large", size)
    assert not (dest / index.name).exists()


def test_missing_object_and_bucket(store, tmp_path):
    got = _fastload.fetch_small_file(
        store.uri("sharded/no-such.json"), str(tmp_path), "no-such.json", 1 << 20
    )
    assert got == ("missing", 0)
    missing = store.missing_bucket().rsplit("/", 1)[0]
    with pytest.raises(fastload.StorageError, match=missing.split("://")[1].split("/")[0]):
        _fastload.list_objects(missing + "/")


def test_storage_options_override_the_environment(store):
    """storage_options win over the environment (the vLLM extra config's `storage_options`)."""
    spoiled, fixes = store.spoiled()
    with pytest.MonkeyPatch.context() as mp:
        for var, value in spoiled.items():
            mp.setenv(var, value)
        with pytest.raises(fastload.StorageError):
            _fastload.list_objects(store.uri("sharded/"))
        assert _fastload.list_objects(store.uri("sharded/"), storage_options=fixes)
