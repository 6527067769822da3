"""Imported at start-up by every Python process of the vLLM tests (tests/test_vllm.py puts this
folder on their PYTHONPATH): asks Linux for permission to use AMX tile data.

Linux lets a process execute AMX instructions only after ``arch_prctl(ARCH_REQ_XCOMP_PERM,
XFEATURE_XTILEDATA)``; the permission survives fork but not exec. vLLM's CPU worker is a fresh
interpreter, and on CPUs with AMX one of its bfloat16 kernels uses AMX without asking: the worker
dies with SIGILL on the first forward pass (the API server then answers HTTP 500). Asking here, in
every process, before any kernel runs, is what vLLM's worker omits. On CPUs without AMX the call
fails (EOPNOTSUPP; EINVAL on kernels before 5.16, which know no AMX) and nothing changes.

With ``FASTLOAD_TEST_AMX_LOG`` set to a folder, each process writes a file named by its pid
holding the call's result and errno, so the tests can check that vLLM's workers ran it.
"""

from __future__ import annotations


def _request_amx() -> None:
    import ctypes
    import os
    import platform

    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return
    sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata = 158, 0x1023, 18
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(sys_arch_prctl, arch_req_xcomp_perm, xfeature_xtiledata)
    log = os.environ.get("FASTLOAD_TEST_AMX_LOG")
    if log:
        with open(os.path.join(log, str(os.getpid())), "w") as f:
            f.write(f"{rc} {ctypes.get_errno()}\n")


try:
    _request_amx()
except Exception:  # never stop an interpreter from starting
    pass
