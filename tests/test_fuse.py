"""method="auto" on a real FUSE mount (issue 16): a page fault of a mapping there is a round trip
through the filesystem's server, so auto reads in blocks instead of mapping, and stats() says why.
The mount is tests/fuse_passthrough.py over a directory of checkpoints, started here as root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fastload
import pytest
from helpers import assert_same_tensors, indexed_files, reference

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.skipif(
    not os.path.exists("/dev/fuse"), reason="this machine has no /dev/fuse"
)


@pytest.fixture(scope="module")
def fuse_mount(tmp_path_factory, dtypes_file, sharded_dir):
    """(mount point, the directory behind it) with all.safetensors and the sharded checkpoint."""
    source = tmp_path_factory.mktemp("fuse-src")
    shutil.copy(dtypes_file, source / "all.safetensors")
    shutil.copytree(sharded_dir, source / "sharded")
    mount = tmp_path_factory.mktemp("fuse-mnt")
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "fuse_passthrough.py"), str(source), str(mount)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not os.path.ismount(mount):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            out = proc.communicate()[0]
            pytest.fail(f"the FUSE passthrough did not mount: {out[-2000:]}")
        time.sleep(0.05)
    yield mount, source
    subprocess.run(["umount", str(mount)], check=False)
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_auto_reads_on_a_fuse_mount_and_says_why(fuse_mount, dtypes_file):
    mount, _ = fuse_mount
    path = mount / "all.safetensors"
    with fastload.stream(path) as s:
        got = dict(s)
        stats = s.stats()
    assert stats["method"] == "read", stats
    assert "FUSE" in stats["method_reason"] and str(path) in stats["method_reason"], stats
    assert_same_tensors(got, reference(dtypes_file))


def test_auto_reads_a_sharded_checkpoint_on_a_fuse_mount(fuse_mount, sharded_dir):
    mount, _ = fuse_mount
    with fastload.stream(mount / "sharded") as s:
        got = dict(s)
        stats = s.stats()
    assert stats["method"] == "read", stats
    assert_same_tensors(got, reference(*indexed_files(sharded_dir)))


def test_mmap_asked_for_on_a_fuse_mount_still_maps(fuse_mount, dtypes_file):
    mount, _ = fuse_mount
    with fastload.stream(mount / "all.safetensors", method="mmap") as s:
        got = dict(s)
        stats = s.stats()
    assert (stats["method"], stats["method_reason"]) == ("mmap", 'method="mmap" was asked for')
    assert_same_tensors(got, reference(dtypes_file))


def test_auto_maps_local_files_and_says_why(dtypes_file, monkeypatch):
    with fastload.stream(dtypes_file) as s:
        list(s)
        stats = s.stats()
    assert (stats["method"], stats["method_reason"]) == (
        "mmap",
        "local filesystem: mapped, no copy",
    )
    monkeypatch.setenv("FASTLOAD_METHOD", "read")
    with fastload.stream(dtypes_file) as s:
        list(s)
        stats = s.stats()
    assert (stats["method"], stats["method_reason"]) == ("read", "FASTLOAD_METHOD=read")
