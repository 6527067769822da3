"""A read-only FUSE passthrough filesystem: `python fuse_passthrough.py SOURCE MOUNTPOINT
[LATENCY_MS]` mounts SOURCE at MOUNTPOINT (foreground; ends when unmounted or killed); each read
request waits LATENCY_MS first (default 0), as one over a network would. Every read of a file on
the mount goes through this process, as on any FUSE filesystem (an object store mounted with s3fs or
gcsfuse, a network filesystem's user-space client): that is what method="auto" must notice."""

from __future__ import annotations

import errno
import os
import sys
import time

import mfusepy as fuse


class Passthrough(fuse.Operations):
    use_ns = True

    def __init__(self, root: str, latency: float = 0.0):
        self.root = root
        self.latency = latency

    def _path(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    def getattr(self, path, fh=None):
        try:
            st = os.lstat(self._path(path))
        except FileNotFoundError:
            raise fuse.FuseOSError(errno.ENOENT) from None
        keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid")
        out = {k: getattr(st, k) for k in keys}
        out.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return out

    def readdir(self, path, fh):
        return [".", "..", *os.listdir(self._path(path))]

    def open(self, path, flags):
        return os.open(self._path(path), os.O_RDONLY)

    def read(self, path, size, offset, fh):
        if self.latency:
            time.sleep(self.latency)
        return os.pread(fh, size, offset)

    def release(self, path, fh):
        os.close(fh)
        return 0

    def statfs(self, path):
        st = os.statvfs(self._path(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files")
        return {k: getattr(st, k) for k in (*keys, "f_flag", "f_frsize", "f_namemax")}


if __name__ == "__main__":
    latency = float(sys.argv[3]) / 1000 if len(sys.argv) > 3 else 0.0
    fuse.FUSE(Passthrough(sys.argv[1], latency), sys.argv[2], foreground=True, ro=True)
