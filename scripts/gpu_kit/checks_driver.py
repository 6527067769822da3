"""Checks at the level of the CUDA driver (no torch CUDA needed): they run on a GPU machine, and
against the simulated driver (tests/fake_cuda) in the test suite; the no-driver checks run where
fastload finds no driver at all (CI).

    python checks_driver.py NAME WORKDIR
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from kit_common import (
    MiB,
    checkpoint,
    differing,
    driver_load,
    main,
    raw,
    reference,
    result,
    short,
    small,
    verdict,
)


def _cli(*args: str, env: dict | None = None, timeout: float = 540) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fastload._cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def _small_file(work: Path) -> Path:
    return checkpoint(work, "small", count=12, each=256 << 10)


# ---------------------------------------------------------------------------------------------
# Without a driver


def no_driver_load(work: Path) -> dict:
    """``device="cuda"`` raises a clear FastloadError; CPU loads in the same process go on."""
    import fastload

    path = _small_file(work)
    try:
        fastload.load(path, device="cuda")
    except fastload.FastloadError as e:
        error = e
    else:
        return result("fail", "device='cuda' loaded without a driver")
    msg = str(error)
    clear = "CUDA driver not found" in msg and not isinstance(error, (ValueError, OSError))
    bad = differing(fastload.load(path), reference(path))
    return verdict(
        clear and not bad,
        f"clear error ({msg!r}); the CPU load after it is bitwise equal",
        f"error {type(error).__name__}: {msg!r}; CPU tensors differing after it: {bad[:5]}",
    )


def cli_no_driver(work: Path) -> dict:
    """``fastload bench --device cuda`` exits with the driver-not-found message, no panic."""
    proc = _cli("bench", str(_small_file(work)), "--device", "cuda", "--repeat", "1")
    ok = proc.returncode != 0 and "CUDA driver not found" in proc.stderr
    ok = ok and "panicked" not in proc.stderr
    return verdict(
        ok,
        f"exit {proc.returncode}: {short(proc.stderr, 300)}",
        f"exit {proc.returncode}; stderr: {short(proc.stderr)}",
        returncode=proc.returncode,
    )


# ---------------------------------------------------------------------------------------------
# With a driver


def cli_bench_cuda(work: Path) -> dict:
    """``fastload bench FILE --device cuda --json``: device memory from the driver (cuMemAlloc),
    every byte copied; its best rate is the report's CLI throughput row (warm page cache)."""
    if small():
        path, repeat = checkpoint(work, "bench-small", count=8, each=1 * MiB), "2"
    else:
        path, repeat = checkpoint(work, "throughput", count=128, each=16 * MiB), "3"
    size = path.stat().st_size
    proc = _cli("bench", str(path), "--device", "cuda", "--repeat", repeat, "--json")
    if proc.returncode != 0:
        return result("fail", f"exit {proc.returncode}: {short(proc.stderr)}")
    report = json.loads(proc.stdout)
    tensor_bytes = sum(t.nbytes for t in reference(path).values())
    ok = report["bytes"] == tensor_bytes and len(report["runs"]) == int(repeat)
    # The device's page-locked copy rate, measured by the same bench before its runs.
    h2d = report.get("limits", {}).get("host_to_device", {})
    return verdict(
        ok,
        f"{report['bytes']} bytes to {report['device']}, best {report['best_gb_per_s']:.2f} GB/s",
        f"report {report['bytes']} bytes, {len(report['runs'])} runs; expected "
        f"{tensor_bytes} bytes, {repeat} runs",
        file_bytes=size,
        bytes=report["bytes"],
        best_gb_per_s=report["best_gb_per_s"],
        runs_gb_per_s=[r.get("gb_per_s") for r in report["runs"]],
        block_size=report.get("block_size"),
        memory_limit=report.get("memory_limit"),
        host_to_device_gb_per_s=h2d.get("gb_per_s"),
        host_to_device_bytes=h2d.get("bytes", 0),
    )


def fork_child(work: Path) -> dict:
    """A child forked after a GPU load: a GPU load there fails with a clear error about fork,
    ``release_memory()`` frees nothing of the parent's, and CPU loads work."""
    import fastload

    path = _small_file(work)
    want = reference(path)
    parent_bad = differing(driver_load(path), want)
    want_raw = raw(want)
    pinned = fastload.cached_memory()["pinned"]
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, never return into the parent's code
        out: dict = {}
        try:
            try:
                driver_load(path)
                out["error"] = None
            except Exception as e:
                out["error"] = {
                    "type": type(e).__name__,
                    "fastload": isinstance(e, fastload.FastloadError),
                    "message": str(e),
                }
            out["released"] = fastload.release_memory()
            got = raw(fastload.load(path))
            out["cpu_bad"] = [n for n in want_raw if got.get(n) != want_raw[n]]
        except BaseException as e:
            out["crash"] = f"{type(e).__name__}: {e}"
        os.write(write, json.dumps(out).encode())
        os._exit(0)
    os.close(write)
    deadline = time.monotonic() + 60
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return result("fail", "the forked child hung for 60 s", parent_pinned=pinned)
    status = done[1]
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    child = json.loads(b"".join(chunks) or b"{}")
    numbers = {"parent_pinned": pinned, "child": child, "child_wait_status": status}
    if parent_bad:
        return result("fail", f"the parent's load differs: {parent_bad[:5]}", **numbers)
    if "crash" in child or not child:
        return result("fail", f"the child crashed: {child.get('crash', status)}", **numbers)
    err = child["error"]
    problems = []
    if err is None:
        problems.append("the child's GPU load succeeded")
    elif "fork" not in err["message"].lower():
        problems.append(f"the child's error does not say fork: {err['type']}: {err['message']!r}")
    if child["released"].get("pinned", 0) != 0:
        problems.append(
            f"release_memory() in the child reports {child['released']['pinned']} page-locked "
            "bytes freed (the parent's)"
        )
    if child["cpu_bad"]:
        problems.append(f"the child's CPU load differs: {child['cpu_bad'][:5]}")
    return verdict(
        not problems,
        f"child: {err and err['type']}: {err and err['message']!r}; released "
        f"{child['released']}; CPU load bitwise equal",
        "; ".join(problems),
        **numbers,
    )


_CLEAR_NO_DEVICE = re.compile(r"no (visible )?CUDA devices?|CUDA_VISIBLE_DEVICES", re.IGNORECASE)

_NO_DEVICE_PROBE = """
import json, sys, fastload
try:
    fastload.load(sys.argv[1], device="cuda:0")
    out = None
except Exception as e:
    out = {"type": type(e).__name__, "fastload": isinstance(e, fastload.FastloadError),
           "message": str(e)}
print(json.dumps(out))
"""


def no_visible_device(work: Path) -> dict:
    """With ``CUDA_VISIBLE_DEVICES=""`` (a driver, no device) the CLI and ``load`` say so clearly,
    not with a raw driver code."""
    path = _small_file(work)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    cli = _cli("bench", str(path), "--device", "cuda", "--repeat", "1", env=env, timeout=120)
    probe = subprocess.run(
        [sys.executable, "-c", _NO_DEVICE_PROBE, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    py = json.loads(probe.stdout.strip().splitlines()[-1]) if probe.returncode == 0 else None
    problems = []
    if cli.returncode == 0:
        problems.append("the CLI succeeded")
    elif "panicked" in cli.stderr or not _CLEAR_NO_DEVICE.search(cli.stderr):
        problems.append(f"CLI: {short(cli.stderr, 400)!r}")
    if py is None:
        problems.append(f"load: {'succeeded' if probe.returncode == 0 else short(probe.stderr)}")
    elif not py["fastload"] or not _CLEAR_NO_DEVICE.search(py["message"]):
        problems.append(f"load: {py['type']}: {py['message']!r}")
    return verdict(
        not problems,
        f"CLI: {short(cli.stderr, 300)!r}; load: {py and py['message']!r}",
        "not a clear no-device error: " + "; ".join(problems),
        cli_returncode=cli.returncode,
        load_error=py,
    )


CHECKS = {
    "no_driver_load": no_driver_load,
    "cli_no_driver": cli_no_driver,
    "cli_bench_cuda": cli_bench_cuda,
    "fork_child": fork_child,
    "no_visible_device": no_visible_device,
}

if __name__ == "__main__":
    main(CHECKS)
