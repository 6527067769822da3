"""The GPU verification kit's runner (standard library only): installs the kit's wheels offline
into a temporary target, then runs every check in its own process and writes one report.

    python kit/runner.py [--out DIR] [--only a,b] [--skip a,b] [--work DIR]
    python scripts/gpu_kit/runner.py --root . --no-install --sim LIBDIR   # the test suite's run

Each check ends as pass, fail or not-run (with the reason: no GPU, no driver, no
compute-sanitizer...); a check that fails, crashes or times out never stops the others. On a
machine without a GPU the run goes to the end, running what needs none. The report is
``gpu-kit-report.json`` and ``gpu-kit-report.md`` in ``--out`` ($OUT when set, else the kit
folder); the exit status is 1 when a check failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from kit_common import RESULT_TAG, result, short  # noqa: E402
from kit_report import write_report  # noqa: E402

REPORT_NAME = "gpu-kit-report"


@dataclass
class Ctx:
    """What every check needs: where things are, the environments, what the machine has."""

    root: Path  # holds tests/, benches/ (the kit folder, or the repository)
    work: Path  # checkpoints and scratch files
    python: str
    env: dict  # the children's environment: the installed wheels on PYTHONPATH
    sim: Path | None
    out: Path | None = None  # the report folder, where checks that write files put them
    probe: dict = field(default_factory=dict)
    wheels: Path | None = None
    setup: dict = field(default_factory=dict)  # what was installed where
    log: list[str] = field(default_factory=list)

    def driver_env(self, name: str) -> dict:
        """The environment of a driver-level check: the simulated driver where one is given."""
        if self.sim is None:
            return self.env
        return {
            **self.env,
            "LD_LIBRARY_PATH": f"{self.sim}:{self.env.get('LD_LIBRARY_PATH', '')}",
            "FAKE_CUDA_LOG": str(self.work / f"{name}.fakelog"),
            "FAKE_CUDA_DEVICES": "1",
            "GPU_KIT_SIM": "1",
        }

    def run(self, argv: list[str], env: dict, timeout: float) -> tuple[int | None, str]:
        """Runs a child, returns (exit status or None on timeout, its output); logs both. The
        child leads a process group of its own: on timeout the whole group is killed, so that a
        grandchild holding the output pipe cannot hang the run."""
        proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            env=env,
            cwd=self.root,
            start_new_session=True,
        )
        code: int | None
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            code = None
        except BaseException:  # Ctrl-C: the group goes with the runner
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        self.log.append(f"$ {' '.join(argv)}\n{out}\n[exit {code}]\n")
        return code, out


# ---------------------------------------------------------------------------------------------
# The checks, and when each can run


@dataclass
class Check:
    name: str
    title: str
    needs: str  # always | no-driver | driver | gpu
    run: Callable[[Ctx, Check], dict]
    timeout: float


def script_check(script: str, function: str, **extra_env: str) -> Callable[[Ctx, Check], dict]:
    """A function of checks_driver.py / checks_gpu.py, run in a fresh process."""

    def run(ctx: Ctx, check: Check) -> dict:
        driver_level = check.needs == "driver"
        env = {**(ctx.driver_env(check.name) if driver_level else ctx.env), **extra_env}
        argv = [ctx.python, str(HERE / script), function, str(ctx.work)]
        code, out = ctx.run(argv, env, check.timeout)
        res = parse_result(code, out, check.timeout)
        if driver_level and ctx.sim is not None:
            simulated(ctx, check.name, res)
        return res

    run.script, run.function = script, function  # type: ignore[attr-defined]
    return run


def parse_result(code: int | None, out: str, timeout: float) -> dict:
    lines = [ln for ln in out.splitlines() if ln.startswith(RESULT_TAG)]
    if code is None:
        return result("fail", f"timed out after {timeout:g} s (a deadlock?): {short(out)}")
    if not lines:
        return result("fail", f"exit {code} without a result: {short(out)}")
    return json.loads(lines[-1][len(RESULT_TAG) :])


def simulated(ctx: Ctx, name: str, res: dict) -> None:
    """Adds the simulator's counters; any misuse it detected fails the check."""
    log = ctx.work / f"{name}.fakelog"
    if not log.exists():
        return
    text = log.read_text().split()
    counters = {k: int(v) for k, v in (f.split("=", 1) for f in text if "=" in f)}
    res["numbers"]["simulator"] = counters
    if counters.get("violations", 0) and res["status"] == "pass":
        res["status"] = "fail"
        res["details"] += f"; the simulator counted {counters['violations']} violation(s)"


def wheels_offline(ctx: Ctx, check: Check) -> dict:
    """Every wheel of the kit installs offline (--no-index --no-deps) into a scratch target, and
    the dependencies import from it alone (no site-packages)."""
    if ctx.wheels is None:
        return result("not-run", "--no-install: the environment's own fastload is used")
    wheels = sorted(ctx.wheels.glob("*.whl"))
    if not any(w.name.startswith("fastload-") for w in wheels):
        return result("fail", f"no fastload wheel in {ctx.wheels} (run gpu_kit.sh build)")
    if ctx.setup.get("status") != "ok":
        return result("fail", f"installing into the target: {ctx.setup.get('status')}")
    scratch = ctx.work / "all-wheels"
    code, out = ctx.run(pip_install(ctx.python, scratch, wheels), ctx.env, check.timeout)
    if code != 0:
        return result("fail", f"pip exit {code}: {short(out)}")
    modules = [dist_name(w) for w in wheels if not w.name.startswith("fastload-")]
    code2, out2 = ctx.run(
        [
            ctx.python,
            "-S",
            "-c",
            f"import sys; sys.path.insert(0, {str(scratch)!r}); "
            f"import {', '.join(modules) or 'sys'}",
        ],
        ctx.env,
        120,
    )
    return result(
        "pass" if code2 == 0 else "fail",
        f"{len(wheels)} wheels installed offline; {', '.join(modules)} import without site-packages"
        if code2 == 0
        else f"imports from the wheels alone failed: {short(out2)}",
        wheels=[w.name for w in wheels],
        bytes=sum(w.stat().st_size for w in wheels),
    )


def import_fastload(ctx: Ctx, check: Check) -> dict:
    info = ctx.probe.get("fastload", {})
    if "error" in info:
        return result("fail", f"import fastload: {info['error']}")
    where = info.get("file", "?")
    from_wheel = ctx.wheels is None or where.startswith(str(ctx.env.get("GPU_KIT_SITE", "-")))
    return result(
        "pass" if from_wheel else "fail",
        f"fastload from {where}" + ("" if from_wheel else " (not the kit's wheel)"),
        **info,
    )


def gpu_test_files(root: Path) -> list[str]:
    """The test files with ``gpu``-marked tests (the kit ships only those)."""
    files = sorted((root / "tests").glob("test_*.py"))
    return [str(f) for f in files if "pytest.mark.gpu" in f.read_text(errors="replace")]


def pytest_argv(ctx: Ctx, *extra: str) -> list[str]:
    return [
        ctx.python, "-m", "pytest", "-p", "no:cacheprovider", "-m", "gpu",
        *gpu_test_files(ctx.root), *extra,
    ]  # fmt: skip


def pytest_collect(ctx: Ctx, check: Check) -> dict:
    """The shipped tests import and their ``gpu`` tests are collected (runs everywhere)."""
    code, out = ctx.run(pytest_argv(ctx, "--collect-only", "-q"), pytest_env(ctx), check.timeout)
    m = re.search(r"(\d+)(?:/\d+)? tests? (?:collected|selected)", out)
    n = int(m.group(1)) if m else 0
    return result(
        "pass" if code == 0 and n > 0 else "fail",
        f"{n} gpu-marked tests collected" if code == 0 else f"exit {code}: {short(out)}",
        collected=n,
    )


def pytest_env(ctx: Ctx) -> dict:
    # The machine's own pytest plugins (xdist, cov, ...) stay out of the kit's runs.
    return {**ctx.env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}


def junit(path: Path) -> tuple[dict[str, int], list[str]]:
    """A JUnit XML file's counts, and each failed or erroring test with its message."""
    suite = ET.parse(path).getroot()
    suite = suite if suite.tag == "testsuite" else suite[0]
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = []
    for case in suite.iter("testcase"):
        bad = case.find("failure")
        bad = bad if bad is not None else case.find("error")
        if bad is not None:
            failed.append(f"{case.get('name')}: {(bad.get('message') or '')[:300]}")
    return counts, failed


def pytest_gpu(ctx: Ctx, check: Check) -> dict:
    junit_path = ctx.work / "pytest-gpu.xml"
    code, out = ctx.run(
        pytest_argv(ctx, "-q", f"--junitxml={junit_path}"), pytest_env(ctx), check.timeout
    )
    if code is None or not junit_path.exists():
        return result("fail", f"exit {code}: {short(out)}")
    counts, failed = junit(junit_path)
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = code == 0 and passed > 0 and not failed
    return result(
        "pass" if ok else "fail",
        f"{passed} passed, {counts['skipped']} skipped"
        if ok
        else f"exit {code}; {len(failed)} failed: " + " | ".join(failed)[:2500],
        passed=passed,
        **counts,
    )


def sanitizer(ctx: Ctx, check: Check) -> dict:
    tool = ctx.probe.get("compute_sanitizer")
    if not tool:
        return result("not-run", "compute-sanitizer is not installed")
    argv = [
        tool, "--tool", "memcheck", "--error-exitcode", "99", "--print-limit", "20",
        ctx.python, str(HERE / "checks_gpu.py"), "sanitizer_load", str(ctx.work),
    ]  # fmt: skip
    code, out = ctx.run(argv, ctx.env, check.timeout)
    summary = re.search(r"ERROR SUMMARY: (\d+) error", out)
    if "Device not supported" in out:
        return result("not-run", f"compute-sanitizer does not support this device: {short(out)}")
    inner = parse_result(code, out, check.timeout)
    errors = int(summary.group(1)) if summary else None
    ok = code == 0 and errors == 0 and inner["status"] == "pass"
    return result(
        "pass" if ok else "fail",
        "memcheck: 0 errors over a small load"
        if ok
        else f"exit {code}, {errors} errors; load: {inner['details'][:300]}; {short(out, 2500)}",
        errors=errors,
    )


def gpu_bench(ctx: Ctx, check: Check) -> dict:
    out_json = ctx.work / "gpu_bench.json"
    argv = [
        ctx.python, str(ctx.root / "benches" / "gpu_bench.py"), "--size", "2GiB", "--reps", "2",
        "--cache", "warm,cold", "--ckpt-dir", str(ctx.work / "gpu_bench_ckpt"),
        "--json", str(out_json), "--timeout", "240",
    ]  # fmt: skip
    code, out = ctx.run(argv, ctx.env, check.timeout)
    if code != 0 or not out_json.exists():
        return result("fail", f"exit {code}: {short(out)}")
    bench = json.loads(out_json.read_text())
    fast = [r for r in bench["rows"] if r["row"] == "fastload"]
    return result(
        "pass" if fast else "fail",
        "; ".join(f"{r['cache']} {r['row']} {r['gb_per_s']:.2f} GB/s" for r in bench["rows"])
        if fast
        else f"no fastload row: {bench.get('notes')}",
        **bench,
    )


def tp_gpu_bench(ctx: Ctx, check: Check) -> dict:
    """benches/tp_gpu_bench.py: rank 0's weights of TP 2 and 8 into GPU parameters, sliced
    (page-locked chunks, and torch's pageable copy) beside whole tensors and safetensors; fails
    if a row errs or the rows' parameters differ."""
    out_json = ctx.work / "tp_gpu_bench.json"
    argv = [
        ctx.python, str(ctx.root / "benches" / "tp_gpu_bench.py"), "--size", "2GiB",
        "--tp", "2,8", "--reps", "1", "--cache", "warm",
        "--rows", "whole,sliced,sliced-pageable,safetensors",
        "--ckpt-dir", str(ctx.work / "gpu_bench_ckpt"), "--json", str(out_json),
        "--timeout", "120",
    ]  # fmt: skip
    code, out = ctx.run(argv, ctx.env, check.timeout)
    if code != 0 or not out_json.exists():
        return result("fail", f"exit {code}: {short(out)}")
    bench = json.loads(out_json.read_text())
    ok = bool(bench["rows"]) and not bench["errors"] and not bench["disagree"]
    rows = "; ".join(f"TP {r['tp']} {r['row']} {r['seconds']:.3f} s" for r in bench["rows"])
    why = "" if ok else f" (errors: {bench['errors']}; rows disagree: {bench['disagree']})"
    return result("pass" if ok else "fail", rows + why, **bench)


def profile_load(ctx: Ctx, check: Check) -> dict:
    """profile_load.py: where the time of load(device="cuda") goes, beside safetensors; its JSON
    (and a torch.profiler trace) go to the report folder. On the simulated driver, a small
    checkpoint and fastload's rows only."""
    env = ctx.driver_env(check.name)
    argv = [
        ctx.python, str(HERE / "profile_load.py"), "--work", str(ctx.work),
        "--out", str(ctx.out or ctx.work), "--timeout", str(min(60.0, check.timeout / 3)),
    ]  # fmt: skip
    code, out = ctx.run(argv, env, check.timeout)
    res = parse_result(code, out, check.timeout)
    if ctx.sim is not None:
        simulated(ctx, check.name, res)
    return res


def install_peers(ctx: Ctx) -> tuple[Path | None, str]:
    """The peers' wheels the kit carries (``peers/``, beside ``wheels/``: never installed with
    fastload's, they are only benches' rows), installed offline into a folder of their own; the
    folder (None if none) and what happened."""
    wheels = sorted((ctx.root / "peers").glob("*.whl"))
    if not wheels:
        return None, "the kit carries no peer wheels (peers/)"
    target = ctx.work / "peers"
    has_pip = ctx.run([ctx.python, "-m", "pip", "--version"], ctx.env, 60)[0] == 0
    done = []
    for w in wheels:  # one at a time: a wheel this Python cannot take leaves the others in
        if has_pip:
            code, out = ctx.run(pip_install(ctx.python, target, [w]), ctx.env, 300)
            done.append(w.name if code == 0 else f"{w.name}: pip exit {code}: {short(out, 300)}")
        else:  # no pip: the wheel unpacked imports the same
            with zipfile.ZipFile(w) as z:
                z.extractall(target)
            done.append(f"{w.name} (unzipped)")
    return target, "; ".join(done)


def cold_start(ctx: Ctx, check: Check) -> dict:
    """benches/gpu_cold_start.py: a process's first load of Llama-3-8B's shapes (4 shards, 16 GB)
    beside the page-locked copy rate, the disk's O_DIRECT rate and the peers, warm and cold, its
    second load, TP 2 and 8 slices, and the memory it holds. Fails if fastload's rows did not run
    or held more page-locked memory than memory_limit; the targets' verdicts are in the details
    (a target not met is a finding of the run, not a broken check)."""
    out_json = (ctx.out or ctx.work) / "gpu_cold_start.json"
    peers, installed = install_peers(ctx)
    argv = [
        ctx.python, str(ctx.root / "benches" / "gpu_cold_start.py"),
        "--ckpt-dir", str(ctx.work / "cold_start_ckpt"), "--json", str(out_json),
        "--timeout", "150", *(["--peers", str(peers)] if peers else []),
    ]  # fmt: skip
    code, out = ctx.run(argv, ctx.env, check.timeout)
    if not out_json.exists():
        return result("fail", f"exit {code}: {short(out)}", peers=installed)
    bench = json.loads(out_json.read_text())
    if code != 0 or not bench.get("complete"):  # stopped midway: what it measured, and why
        return result("fail", f"exit {code} (incomplete): {short(out)}", peers=installed, **bench)
    fast = [r for r in bench["rows"] if r["row"] == "fastload"]
    pinned_ok = all(m.get("pinned_within_limit", True) for m in bench["memory"])
    verdicts = "; ".join(_verdict(v) for v in bench["verdicts"])
    rates = ", ".join(f"{k} {v:.2f}" for k, v in bench["rates"].items() if v is not None)
    notes = "; ".join(f"{k}: {v[:200]}" for k, v in bench["notes"].items())
    ok = bool(fast) and pinned_ok
    why = "" if ok else " (no fastload row)" if not fast else " (page-locked memory over the limit)"
    return result(
        "pass" if ok else "fail",
        f"GB/s: {rates}. Targets: {verdicts}. Not run: {notes or 'none'}{why}",
        peers=installed,
        **bench,
    )


def _verdict(v: dict) -> str:
    """A cold-start target in the details: its ratio, met or not, and for a peer target out of
    the hardware's reach, how far it lets fastload go."""
    met = "met" if v["met"] else "not met" if v["met"] is False else "not measured"
    if v.get("out_of_reach"):
        met += f"; the hardware allows at most {v['bound']:.2f}"
    return f"{v['target']} {'-' if v['ratio'] is None else format(v['ratio'], '.2f')} ({met})"


_D, _G = "checks_driver.py", "checks_gpu.py"
CHECKS = [
    Check("wheels_offline", "The kit's wheels install offline; dependencies import alone",
          "always", wheels_offline, 300),
    Check("import_fastload", "fastload imports from the kit's wheel", "always",
          import_fastload, 60),
    Check("pytest_collect", "The shipped gpu tests are collected", "always", pytest_collect,
          300),
    Check("no_driver_load", "device='cuda' without a driver: clear error, CPU loads go on",
          "no-driver", script_check(_D, "no_driver_load"), 180),
    Check("cli_no_driver", "fastload bench --device cuda without a driver: clear error",
          "no-driver", script_check(_D, "cli_no_driver"), 180),
    Check("pytest_gpu", "gpu-marked tests (tests/test_gpu.py, ...)", "gpu", pytest_gpu, 480),
    Check("busy_stream", "Ordering under a busy stream (native allocator)", "gpu",
          script_check(_G, "busy_stream"), 180),
    Check("busy_stream_async", "Ordering under a busy stream, backend:cudaMallocAsync", "gpu",
          script_check(_G, "busy_stream", PYTORCH_CUDA_ALLOC_CONF="backend:cudaMallocAsync"),
          180),
    Check("busy_stream_expandable", "Ordering under a busy stream, expandable_segments:True",
          "gpu", script_check(_G, "busy_stream",
                              PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True"), 180),
    Check("context_threads", "Current device and context kept across loads and "
          "release_memory(), fresh threads", "gpu", script_check(_G, "context_threads"), 180),
    Check("run_ahead", "Run-ahead peak with a consumer sleeping 20 ms per tensor", "gpu",
          script_check(_G, "run_ahead"), 300),
    Check("stats_thread", "stats() every millisecond from a thread during a load; close() "
          "from a thread", "gpu", script_check(_G, "stats_thread"), 300),
    Check("cancellations", "50 cancellations: memory back to baseline, page-locked within the "
          "limit", "gpu", script_check(_G, "cancellations"), 300),
    Check("block_size_change", "Block-size change: no page-locked churn", "gpu",
          script_check(_G, "block_size_change"), 300),
    Check("fork_child", "A child forked after a GPU load gets a clear error", "driver",
          script_check(_D, "fork_child"), 180),
    Check("no_visible_device", "CUDA_VISIBLE_DEVICES='': a clear error, not a driver code",
          "driver", script_check(_D, "no_visible_device"), 180),
    Check("sanitizer_memcheck", "compute-sanitizer memcheck over a small load", "gpu",
          sanitizer, 540),
    Check("pinned_h2d", "Page-locked host-to-device copy rate (1 GiB, CUDA events)", "gpu",
          script_check(_G, "pinned_h2d"), 180),
    Check("cli_bench_cuda", "fastload bench --device cuda", "driver",
          script_check(_D, "cli_bench_cuda"), 420),
    Check("gpu_bench", "benches/gpu_bench.py: storage to GPU beside its peers", "gpu",
          gpu_bench, 570),
    Check("tp_gpu_bench", "benches/tp_gpu_bench.py: a TP rank's weights into GPU parameters, "
          "sliced and whole", "gpu", tp_gpu_bench, 240),
    Check("profile_load", "Where load(device='cuda') spends its time: first and later loads, "
          "pinning, torch allocations, copies; beside safetensors", "driver", profile_load, 300),
    Check("cold_start", "benches/gpu_cold_start.py: Llama-3-8B's shapes (16 GB, 4 shards) warm "
          "and cold beside the copy and disk rates and the peers; TP slices", "gpu", cold_start,
          570),
]  # fmt: skip


def why_not(check: Check, ctx: Ctx) -> str | None:
    """None when the check can run here, else the reason it cannot."""
    p = ctx.probe
    plain, sim = p.get("driver", {}), p.get("sim_driver", {})
    if check.name in ("wheels_offline", "import_fastload"):
        return None
    if "error" in p.get("fastload", {}):
        return "fastload does not import"
    if "error" in p.get("torch", {}):  # every check writes or reads tensors
        return f"torch does not import ({p['torch']['error']})"
    if check.needs == "no-driver":
        if "count" in plain:
            return f"a CUDA driver is present ({plain['count']} device(s))"
        return None
    if check.needs == "driver":
        drv = sim if ctx.sim is not None else plain
        if drv.get("count", 0) < 1:
            return f"no CUDA driver with a device ({drv.get('error', '0 devices')})"
        return None
    if check.needs == "gpu":
        torch = p.get("torch", {})
        if not torch.get("cuda_available"):
            why = "simulated driver: " if ctx.sim is not None else ""
            return f"{why}no CUDA device for torch (torch {torch.get('version')})"
        if "count" not in plain:
            return f"fastload finds no driver ({plain.get('error')})"
    return None


# ---------------------------------------------------------------------------------------------
# Setup: installs, the machine's description

PROBE = r"""
import json, os, shutil, subprocess, sys
out = {"python": sys.version.split()[0], "executable": sys.executable}
try:
    import fastload
    from fastload import _fastload
    out["fastload"] = {"file": fastload.__file__, "native": _fastload.__file__,
                       "version": getattr(fastload, "__version__", None)}
    try:
        out["driver"] = {"count": _fastload.cuda_device_count()}
    except Exception as e:
        out["driver"] = {"error": f"{type(e).__name__}: {e}"}
except Exception as e:
    out["fastload"] = {"error": f"{type(e).__name__}: {e}"}
if os.environ.get("GPU_KIT_PROBE_TORCH") == "1":
    try:
        import torch
        t = {"version": torch.__version__, "cuda": torch.version.cuda,
             "cuda_available": torch.cuda.is_available()}
        if t["cuda_available"]:
            t["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        out["torch"] = t
    except Exception as e:
        out["torch"] = {"error": f"{type(e).__name__}: {e}"}
    tool = shutil.which("compute-sanitizer") or next(
        (p for p in ("/usr/local/cuda/bin/compute-sanitizer",) if os.path.exists(p)), None)
    out["compute_sanitizer"] = tool
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                              "--format=csv,noheader"], capture_output=True, text=True, timeout=30)
        out["nvidia_smi"] = smi.stdout.strip() or smi.stderr.strip()
    except FileNotFoundError:
        out["nvidia_smi"] = None
    except Exception as e:
        out["nvidia_smi"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def probe(ctx: Ctx, env: dict, with_torch: bool) -> dict:
    env = {**env, "GPU_KIT_PROBE_TORCH": "1" if with_torch else "0"}
    code, out = ctx.run([ctx.python, "-c", PROBE], env, 180)
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    if code != 0 or not lines:
        return {"fastload": {"error": f"probe exit {code}: {short(out)}"}}
    return json.loads(lines[-1])


def dist_name(wheel: Path) -> str:
    return wheel.name.split("-")[0].lower()


def pip_install(python: str, target: Path, wheels: list[Path]) -> list[str]:
    return [
        python, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
        "--disable-pip-version-check", "--no-warn-script-location", "--target", str(target),
        *map(str, wheels),
    ]  # fmt: skip


def install(ctx: Ctx, site: Path) -> dict:
    """fastload's wheel always; a dependency's only where the machine's Python lacks it, so the
    machine's own packages (and their plugins) stay as they are."""
    assert ctx.wheels is not None
    wheels = sorted(ctx.wheels.glob("*.whl"))
    chosen, present = [], []
    for w in wheels:
        name = dist_name(w)
        if name != "fastload":
            code, _ = ctx.run([ctx.python, "-c", f"import {name}"], ctx.env, 60)
            if code == 0:
                present.append(name)
                continue
        chosen.append(w)
    how = "pip"
    if ctx.run([ctx.python, "-m", "pip", "--version"], ctx.env, 60)[0] == 0:
        code, out = ctx.run(pip_install(ctx.python, site, chosen), ctx.env, 300)
    else:  # no pip: pure and abi3 wheels import the same once unpacked
        how, code, out = "unzip (no pip)", 0, ""
        for w in chosen:
            with zipfile.ZipFile(w) as z:
                z.extractall(site)
    return {
        "installed": [w.name for w in chosen],
        "from_machine": present,
        "how": how,
        "status": "ok" if code == 0 else f"pip exit {code}: {short(out)}",
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--root", default=str(HERE.parent), help="folder with tests/ and benches/")
    ap.add_argument("--wheels", help="folder of wheels [ROOT/wheels]")
    ap.add_argument("--out", help="report folder [$OUT, else ROOT]")
    ap.add_argument("--work", help="scratch folder kept after the run [a temporary one]")
    ap.add_argument("--no-install", action="store_true", help="use the environment's fastload")
    ap.add_argument("--sim", help="folder of a simulated libcuda for the driver-level checks")
    ap.add_argument("--only", default="", help="comma-separated check names")
    ap.add_argument("--skip", default="", help="comma-separated check names")
    ap.add_argument(
        "--budget", type=float, help="seconds after which no further check starts (not run)"
    )
    ap.add_argument("--timeout", type=float, help="at most this many seconds for any one check")
    args = ap.parse_args(argv)
    unknown = {n for n in f"{args.only},{args.skip}".split(",") if n} - {c.name for c in CHECKS}
    if unknown:
        ap.error(f"unknown checks {sorted(unknown)}; the checks: {[c.name for c in CHECKS]}")

    root = Path(args.root).resolve()
    out_dir = Path(args.out or os.environ.get("OUT") or root).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="gpu-kit."))
    work = Path(args.work).resolve() if args.work else tmp / "work"
    work.mkdir(parents=True, exist_ok=True)
    # Tests and checks start from fastload's defaults, whatever this shell's FASTLOAD_* say.
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    env.update(PYTHONUNBUFFERED="1", FASTLOAD_CACHE_DIR=str(work / "cache"))
    ctx = Ctx(root=root, work=work, python=sys.executable, env=env,
              sim=Path(args.sim).resolve() if args.sim else None, out=out_dir)  # fmt: skip
    started = time.time()
    try:
        if not args.no_install:
            ctx.wheels = Path(args.wheels).resolve() if args.wheels else root / "wheels"
            site = tmp / "site"
            ctx.setup = install(ctx, site) if ctx.wheels.is_dir() else {"status": "no wheels"}
            path = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
            ctx.env = {**env, "PYTHONPATH": path, "GPU_KIT_SITE": str(site)}
        ctx.probe = probe(ctx, ctx.env, with_torch=True)
        if ctx.sim is not None:
            ctx.probe["sim_driver"] = probe(ctx, ctx.driver_env("probe"), False).get("driver", {})
        mode = "sim" if ctx.sim else ("gpu" if ctx.probe.get("torch", {}).get("cuda_available")
                                      else ("driver" if "count" in ctx.probe.get("driver", {})
                                            else "dry"))  # fmt: skip
        kit = root / "BUILD.json"
        report: dict[str, Any] = {
            "kit": json.loads(kit.read_text()) if kit.exists() else None,
            "mode": mode,
            "complete": False,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
            "seconds": 0.0,
            "setup": ctx.setup,
            "environment": ctx.probe,
            "checks": [],
        }
        only = {n for n in args.only.split(",") if n}
        skip = {n for n in args.skip.split(",") if n}
        for check in CHECKS:
            if (only and check.name not in only) or check.name in skip:
                continue
            if args.timeout:
                check = dataclasses.replace(check, timeout=min(check.timeout, args.timeout))
            t0 = time.perf_counter()
            reason = why_not(check, ctx)
            if reason is None and args.budget and time.time() - started > args.budget:
                reason = f"the run's time budget ({args.budget:.0f} s, --budget) was spent"
            if reason is not None:
                res = result("not-run", reason)
            else:
                print(f"gpu-kit: {check.name} ...", file=sys.stderr, flush=True)
                try:
                    res = check.run(ctx, check)
                except Exception as e:  # the runner's own bug: this check fails, others go on
                    res = result("fail", f"runner error: {type(e).__name__}: {e}")
            res = {"name": check.name, "title": check.title, "needs": check.needs, **res}
            res["seconds"] = round(time.perf_counter() - t0, 2)
            print(f"gpu-kit: {check.name}: {res['status']}", file=sys.stderr, flush=True)
            report["checks"].append(res)
            # Written after every check: a run killed from outside still leaves its report.
            report["seconds"] = round(time.time() - started, 1)
            write_report(report, out_dir / REPORT_NAME)
            (out_dir / "gpu-kit.log").write_text("\n".join(ctx.log))
        report["complete"] = True
        report["seconds"] = round(time.time() - started, 1)
        write_report(report, out_dir / REPORT_NAME)
        (out_dir / "gpu-kit.log").write_text("\n".join(ctx.log))
    finally:
        if not args.work:
            shutil.rmtree(tmp, ignore_errors=True)
    summary = report["summary"]
    print(
        f"gpu-kit: {summary['pass']} passed, {summary['fail']} failed, {summary['not-run']} not "
        f"run ({mode}); report: {out_dir / REPORT_NAME}.md",
        file=sys.stderr,
    )
    return 1 if summary["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
