"""Session fixtures: checkpoints written once by the reference writer (see helpers.py)."""

import os

import helpers
import pytest


@pytest.fixture(autouse=True)
def _no_fastload_env(monkeypatch):
    """Tests start from the built-in defaults, whatever the caller's environment says."""
    for var in [v for v in os.environ if v.startswith("FASTLOAD_")]:
        monkeypatch.delenv(var)


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
