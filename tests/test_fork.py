"""fork beside loading threads: a child forked at any moment, with threads loading in the parent,
can load (issue 14, item 3). The hammer runs in its own interpreter with a timeout, so that a hang
fails the test instead of freezing the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import save_file

HAMMER = textwrap.dedent(
    """
    import os, sys, threading, time
    import fastload
    import torch

    torch.set_num_threads(1)  # the children compare tensors: no OpenMP pool to start in each

    path, forks = sys.argv[1], int(sys.argv[2])
    want = fastload.load(path)
    stop = threading.Event()
    loads = [0, 0]

    def loader(i):
        # Alternating methods and pool limits: the buffer pool's lock, the runtime and the file
        # sources are all in use when a fork lands.
        while not stop.is_set():
            method = "read" if loads[i] % 2 else "mmap"
            fastload.load(path, method=method, memory_limit=(1 + loads[i] % 3) << 20)
            loads[i] += 1

    threads = [threading.Thread(target=loader, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    # A watchdog kills a child that has not exited in time; the main thread waits in a blocking
    # waitpid (which releases the GIL to the loading threads).
    child = {"pid": 0, "deadline": 0.0, "killed": False}

    def watchdog():
        while not stop.is_set():
            if child["pid"] and time.monotonic() > child["deadline"]:
                child["killed"] = True
                os.kill(child["pid"], 9)
                child["pid"] = 0
            time.sleep(0.2)

    threading.Thread(target=watchdog, daemon=True).start()
    hung, failed = 0, 0
    for n in range(forks):
        pid = os.fork()
        if pid == 0:
            try:
                got = fastload.load(path, method="read" if n % 2 else "mmap")
                ok = got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
                os._exit(0 if ok else 3)
            except BaseException:
                os._exit(4)
        child.update(deadline=time.monotonic() + 10, killed=False, pid=pid)
        _, status = os.waitpid(pid, 0)
        child["pid"] = 0
        if child["killed"]:
            hung += 1
            break  # one hang fails the test: no need to wait for more
        if os.waitstatus_to_exitcode(status) != 0:
            failed += 1
    stop.set()
    for t in threads:
        t.join(timeout=30)
    print(f"forks={n + 1} hung={hung} failed={failed} parent_loads={sum(loads)}", flush=True)
    sys.exit(1 if hung or failed or min(loads) == 0 else 0)
    """
)


def test_fork_hammer_beside_loading_threads(tmp_path):
    path = tmp_path / "small.safetensors"
    save_file({f"t{i}": torch.arange(i * 1000, dtype=torch.float32) for i in range(40)}, path)
    proc = subprocess.run(
        [sys.executable, "-c", HAMMER, str(path), "500"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hung=0 failed=0" in proc.stdout


# The child probes below share this: fork (with os.fork or multiprocessing's fork context), run
# `child` there and exit with what it returns (a normal exit: the interpreter's finalisation
# drops whatever the child inherited), and wait at most `seconds` for it; "hung" if it did not
# exit by then.
RUN_CHILD = textwrap.dedent(
    """
    import multiprocessing, os, sys, time

    def run_child(how, child, seconds):
        if how == "os.fork":
            pid = os.fork()
            if pid == 0:
                sys.exit(child())
            deadline = time.monotonic() + seconds
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    return os.waitstatus_to_exitcode(status)
                if time.monotonic() > deadline:
                    os.kill(pid, 9)
                    os.waitpid(pid, 0)
                    return "hung"
                time.sleep(0.05)
        p = multiprocessing.get_context("fork").Process(target=lambda: sys.exit(child()))
        p.start()
        p.join(seconds)
        if p.is_alive():
            p.kill()
            p.join()
            return "hung"
        return p.exitcode
    """
)


CHILD_OF_STREAM = textwrap.dedent(
    """
    import multiprocessing, os, sys, threading, time
    import fastload

    path, how = sys.argv[1], sys.argv[2]
    want = fastload.load(path)
    # memory_limit: several segments, so that the parent's producers are still at work.
    s = fastload.stream(path, memory_limit="1MiB", block_size="4KiB")
    got = dict([next(s)])

    def child():
        try:
            for _ in s:
                pass
        except fastload.FastloadError as e:
            print("child:", e, flush=True)
            ok = f"process {os.getppid()}" in str(e) and "fork" in str(e)
            s.close()  # closing (and dropping) the parent's stream must not hang either
            return 0 if ok else 3
        except BaseException as e:
            print("child: unexpected", repr(e), flush=True)
            return 4
        print("child: the stream ended", flush=True)
        return 5

    code = run_child(how, child, 30)
    # The parent's stream is untouched by the child.
    got.update(s)
    same = got.keys() == want.keys() and all(got[k].equal(want[k]) for k in want)
    print(f"child_exit={code} parent_same={same}", flush=True)
    """
)


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_forked_child_iterating_its_parents_stream_raises(tmp_path, how):
    path = tmp_path / "model.safetensors"
    save_file({f"t{i}": torch.arange(100 + i % 500, dtype=torch.int32) for i in range(2000)}, path)
    proc = subprocess.run(
        [sys.executable, "-c", RUN_CHILD + CHILD_OF_STREAM, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "child_exit=0 parent_same=True" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr


CHILD_OF_SAFE_OPEN = textwrap.dedent(
    """
    import multiprocessing, os, sys, time
    import fastload

    url, path, how = sys.argv[1], sys.argv[2], sys.argv[3]
    remote = fastload.safe_open(url, "pt")
    local = fastload.safe_open(path, "pt")
    want = remote.get_tensor("w")  # the parent's pool now holds connections to the server

    def child():
        try:
            remote.get_tensor("w")
        except fastload.FastloadError as e:
            print("child:", e, flush=True)
            if not (f"process {os.getppid()}" in str(e) and "fork" in str(e) and url in str(e)):
                return 3
        except BaseException as e:
            print("child: unexpected", repr(e), flush=True)
            return 4
        else:
            print("child: read the parent's remote handle", flush=True)
            return 5
        try:
            remote.get_slice("w")[:3]
        except fastload.FastloadError:
            pass
        else:
            return 6
        # What needs no connection of the parent's works: the header, a local file, a new open.
        ok = remote.keys() == ["w"] and local.get_tensor("w").equal(want)
        ok = ok and fastload.safe_open(url, "pt").get_tensor("w").equal(want)
        return 0 if ok else 7

    code = run_child(how, child, 20)
    # The parent's handle is untouched by the child.
    same = remote.get_tensor("w").equal(want) and remote.get_slice("w")[2:5].equal(want[2:5])
    print(f"child_exit={code} parent_same={same}", flush=True)
    """
)


@pytest.mark.parametrize("how", ["os.fork", "multiprocessing"])
def test_forked_child_reading_its_parents_remote_safe_open_raises(tmp_path, range_server, how):
    # issue 29, item 9: the child's request waited 30 s for a connection only the parent drives.
    path = tmp_path / "w.safetensors"
    save_file({"w": torch.arange(4096, dtype=torch.float32)}, path)
    range_server.put({"fork/w.safetensors": path})
    url = range_server.url("fork/w.safetensors")
    proc = subprocess.run(
        [sys.executable, "-c", RUN_CHILD + CHILD_OF_SAFE_OPEN, url, str(path), how],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "child_exit=0 parent_same=True" in proc.stdout, proc.stdout + proc.stderr
    assert proc.returncode == 0, proc.stdout + proc.stderr
