"""Interpreter exit while daemon threads are inside fastload (issue 25, item 4).

Python <= 3.13 ends a daemon thread with `pthread_exit` when it takes the GIL back after
finalisation began; that forced unwind must never meet a Rust frame (one that catches it aborts
the process: `FATAL: exception not rethrown`, exit 134). fastload parks such a thread instead, as
CPython 3.14 does. Each run is a fresh interpreter that returns from its main module while daemon
threads load files in a loop, drain streams, and wait in `next()` for a server that trickles.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
from safetensors.torch import save_file
from servers.http import Behaviour, start_server

EXITER = textwrap.dedent(
    """
    import sys, threading
    import fastload
    from fastload import _fastload

    path, url, mode = sys.argv[1], sys.argv[2], sys.argv[3]
    started = threading.Semaphore(0)

    def loads():
        first = True
        while True:
            fastload.load(path, method="read")
            if first:
                started.release()
                first = False

    def native_streams():
        # The native iterator alone: no torch in this thread's way.
        first = True
        while True:
            for _ in _fastload.Stream([path], memory_limit=1 << 20):
                if first:
                    started.release()
                    first = False

    def waits():
        # Blocked in next() on a body that trickles in: a wait of ours when the process ends.
        s = _fastload.Stream([url], block_size=1 << 16)
        started.release()
        for _ in s:
            pass

    targets = {"load": [loads] * 3, "stream": [native_streams] * 3, "wait": [waits] * 2,
               "all": [loads, loads, native_streams, native_streams, waits]}[mode]
    for t in targets:
        threading.Thread(target=t, daemon=True).start()
    for _ in targets:
        started.acquire()
    print("returning from main", flush=True)
    """
)


# The same exit with daemon threads in torch alone (no fastload): torch 2.15's own C++ frames meet
# CPython's pthread_exit there and the process aborts ("terminate called without an active
# exception", 60 of 60 runs here). Where torch alone does that, a daemon thread inside
# `fastload.load` (whose tensors are torch's) can too, by torch's frames, not ours.
TORCH_ONLY = textwrap.dedent(
    """
    import threading, torch
    started = threading.Semaphore(0)

    def work():
        first = True
        while True:
            (torch.arange(30000, dtype=torch.float32).clone() + 1).sum()
            if first:
                started.release()
                first = False

    for _ in range(3):
        threading.Thread(target=work, daemon=True).start()
    for _ in range(3):
        started.acquire()
    print("returning from main", flush=True)
    """
)
TORCH_ABORT = "terminate called without an active exception"


def torch_alone_aborts_at_exit() -> bool:
    runs = [
        subprocess.run(
            [sys.executable, "-c", TORCH_ONLY], capture_output=True, text=True, timeout=60
        )
        for _ in range(3)
    ]
    return any(r.returncode == -6 and TORCH_ABORT in r.stderr for r in runs)


def run_exiter(path, url, mode):
    proc = subprocess.run(
        [sys.executable, "-c", EXITER, str(path), url, mode],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return proc


def test_exit_with_daemon_threads_inside_fastload(tmp_path):
    path = tmp_path / "small.safetensors"
    save_file({f"t{i}": torch.arange(i * 500, dtype=torch.float32) for i in range(60)}, path)
    big = tmp_path / "big.safetensors"
    save_file({"w": torch.zeros(1 << 20, dtype=torch.uint8)}, big)
    # Everything but the header read trickles in: a stream of it waits in next().
    server = start_server(
        {"big.safetensors": big},
        Behaviour(trickle_rate=2000, trickle_from=1024),
    )
    try:
        url = server.url("big.safetensors")
        failures = []
        torch_aborts = None
        for mode in ["load", "stream", "wait", "all", "all"]:
            proc = run_exiter(path, url, mode)
            if proc.returncode == 0 and "returning from main" in proc.stdout:
                continue
            # Modes whose threads run torch ("load", "all") may meet torch's own abort, and pass
            # on it only where torch alone aborts the same way; fastload's native modes never.
            if mode in ("load", "all") and proc.returncode == -6:
                lines = set(proc.stderr.split("\n")) - {""}
                torch_lines = {TORCH_ABORT, "terminate called recursively"}
                if TORCH_ABORT in lines <= torch_lines and "returning from main" in proc.stdout:
                    if torch_aborts is None:
                        torch_aborts = torch_alone_aborts_at_exit()
                    if torch_aborts:
                        continue
            failures.append(f"{mode}: rc {proc.returncode}: {proc.stderr[-1500:]}")
        assert not failures, "\n".join(failures)
    finally:
        server.close()
