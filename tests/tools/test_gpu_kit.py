"""The GPU verification kit (scripts/gpu_kit/) run here: its dry mode (no driver: the GPU checks
are reported as not run, the no-driver checks run) and its driver-level checks against the
simulated driver, so that the code a GPU machine runs is exercised for real. The runner uses this
environment's fastload (``--no-install``); `scripts/test.sh` runs the built kit itself, wheels and
all."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
RUNNER = REPO / "scripts" / "gpu_kit" / "runner.py"
sys.path.insert(0, str(RUNNER.parent))

import runner  # noqa: E402

GPU_CHECKS = [c.name for c in runner.CHECKS if c.needs == "gpu"]
DRIVER_CHECKS = [c.name for c in runner.CHECKS if c.needs == "driver"]
NO_DRIVER_CHECKS = [c.name for c in runner.CHECKS if c.needs == "no-driver"]


def run_kit(out: Path, *args: str, env: dict | None = None) -> tuple[int, dict, str]:
    proc = subprocess.run(
        [
            sys.executable,
            str(RUNNER),
            "--root",
            str(REPO),
            "--no-install",
            "--out",
            str(out),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    report = json.loads((out / "gpu-kit-report.json").read_text())
    markdown = (out / "gpu-kit-report.md").read_text()
    return proc.returncode, report, markdown + proc.stderr


def by_name(report: dict) -> dict[str, dict]:
    return {c["name"]: c for c in report["checks"]}


def test_dry_mode_reports_every_check(tmp_path):
    code, report, text = run_kit(tmp_path)
    assert code == 0, text
    assert report["mode"] == "dry" and report["complete"]
    checks = by_name(report)
    # Every check of the kit is in the report, in order, each with a status and a reason.
    assert [c["name"] for c in report["checks"]] == [c.name for c in runner.CHECKS]
    for c in report["checks"]:
        assert c["status"] in ("pass", "fail", "not-run"), c
        assert c["details"] and isinstance(c["numbers"], dict), c
        assert isinstance(c["seconds"], float), c
    # Each check's own time: pytest's collection (a process of its own) took some; all of them
    # fit in the run's time (rounded to 0.1 s, each check's to 0.01 s).
    assert checks["pytest_collect"]["seconds"] > 0, checks["pytest_collect"]
    assert sum(c["seconds"] for c in report["checks"]) <= report["seconds"] + 0.1, report
    for name in GPU_CHECKS:
        assert checks[name]["status"] == "not-run", checks[name]
        assert "no CUDA device" in checks[name]["details"], checks[name]
    for name in DRIVER_CHECKS:
        assert checks[name]["status"] == "not-run", checks[name]
        assert "CUDA driver not found" in checks[name]["details"], checks[name]
    # What runs without a GPU ran, and passed.
    for name in [*NO_DRIVER_CHECKS, "import_fastload", "pytest_collect"]:
        assert checks[name]["status"] == "pass", checks[name]
    assert checks["pytest_collect"]["numbers"]["collected"] >= 5
    assert checks["wheels_offline"]["status"] == "not-run"  # --no-install
    assert report["summary"] == {"pass": 4, "fail": 0, "not-run": len(runner.CHECKS) - 4}
    assert report["storage_to_gpu"] == []
    assert "## Storage → GPU" in text and "Not measured in this run" in text
    for name in checks:
        assert f"`{name}`" in text


def test_driver_checks_on_the_simulated_driver(fake_cuda, tmp_path):
    only = ",".join([*DRIVER_CHECKS, "pytest_gpu"])
    code, report, text = run_kit(tmp_path, "--sim", str(fake_cuda), "--only", only)
    assert report["mode"] == "sim"
    checks = by_name(report)
    assert sorted(checks) == sorted(only.split(","))
    # torch has no CUDA here: the torch-level checks say so; the driver-level ones ran.
    assert checks["pytest_gpu"]["status"] == "not-run"
    assert "simulated driver" in checks["pytest_gpu"]["details"]
    for name in DRIVER_CHECKS:
        assert checks[name]["status"] == "pass", checks[name]
        sim = checks[name]["numbers"].get("simulator")
        if name != "no_visible_device":  # that one's processes never initialise a device
            assert sim is not None and sim["violations"] == 0, checks[name]
    assert code == 0, text
    bench = checks["cli_bench_cuda"]["numbers"]
    # Two runs' bytes, plus the copies that measured the host-to-device rate.
    assert bench["bytes"] == 8 << 20 and bench["host_to_device_gb_per_s"] > 0
    assert bench["simulator"]["bytes"] == 2 * bench["bytes"] + bench["host_to_device_bytes"]
    child = checks["fork_child"]["numbers"]["child"]
    assert child["error"]["fastload"] and "fork" in child["error"]["message"]
    assert checks["fork_child"]["numbers"]["parent_pinned"] > 0
    assert child["released"]["pinned"] == 0
    rows = report["storage_to_gpu"]  # the CLI's row, without a copy rate to compare it with
    assert [r["cache"] for r in rows] == ["warm"] and rows[0]["of_pinned_copy"] is None
    # profile_load's fastload rows: the first load of a process pins its ring (2 x concurrency
    # blocks at most, not memory_limit), the second reuses it, and after release_memory() a load
    # pins again; its JSON lands in the report folder.
    profile = json.loads((tmp_path / "profile_load.json").read_text())
    first, second, again = profile["rows"]["fastload"]["loads"]
    block = first["block_size"]
    assert first["memory_limit"] == 1 << 30 and first["concurrency"] == 16
    assert 0 < first["pinned_bytes"] <= min(32 * block, profile["bytes"] + block), first
    assert first["staging_peak_bytes"] <= 32 * block, first
    # The second reuses what the first left cached: it pins only what it holds beyond that
    # (how far reads run ahead of the copies differs from load to load, so the second may hold
    # more than the first ever did; a CI run saw one block more).
    cached = first["cached_after"]["pinned"]
    beyond = max(0, second["staging_peak_bytes"] - cached)
    assert cached > 0 and second["pinned_bytes"] <= beyond, (first, second)
    assert second["cached_after"]["pinned"] > 0, second
    assert again["pinned_bytes"] > 0, again
    assert first["bytes"] == second["bytes"] == again["bytes"] > 0
    # Where each load's time went (stats()["phases_ms"]), and the stage it waited on most: the
    # kit's details say it for every first load.
    for load in (first, second, again):
        where = load["where_ms"]
        assert abs(where["wall"] - load["seconds"] * 1e3) < 1e-6, where
        assert where["consumer_wait"] <= where["wall"] and where["copies_on_device"] > 0, where
        stages = ("pinning", "reads (host side)", "torch allocations", "device copies",
                  "consumer (wrapping tensors)")  # fmt: skip
        assert where["limit"] in stages, where
    assert first["where_ms"]["pinning"] == first["pinned_ms"] > 0, first
    assert "fastload first: " in checks["profile_load"]["details"]
    assert "waited most on" in checks["profile_load"]["details"]
    assert checks["profile_load"]["numbers"]["rows"]["fastload"]["loads"] == [first, second, again]
    # method="mmap": every block's pages lent to the device, no staging buffer pinned.
    for row in ("fastload_mmap", "fastload_mmap_b32"):
        for load in profile["rows"][row]["loads"]:
            assert load["lent_bytes"] == load["bytes"] > 0 and load["lend_refused"] is None, load
            assert load["pinned_bytes"] == 0 and load["where_ms"]["lending_per_read"] > 0, load
    assert "fastload_mmap first: " in checks["profile_load"]["details"]
    # copy_streams=2: the same loads with blocks on two streams in turn.
    for load in profile["rows"]["fastload_s2"]["loads"]:
        assert load["copy_streams"] == 2 and load["bytes"] == first["bytes"], load
    assert "fastload_s2 first: " in checks["profile_load"]["details"]
    # block_size="16MiB" beside the default 4 MiB (the default GPU block for local files).
    assert block == 4 << 20
    for load in profile["rows"]["fastload_b16"]["loads"]:
        assert load["block_size"] == 16 << 20 and load["bytes"] == first["bytes"], load
    assert "fastload_b16 first: " in checks["profile_load"]["details"]
    # Every load of the file got its bytes, lent or staged, on one copy stream or two.
    assert profile["checksums_agree"] and first["checksum"] > 0, profile


def test_a_failing_check_does_not_stop_the_others(fake_cuda, tmp_path):
    # The simulator fails the first asynchronous copy of every process: the CLI's bench fails,
    # the checks after it still run and the report says which failed and why.
    code, report, text = run_kit(
        tmp_path,
        "--sim",
        str(fake_cuda),
        "--only",
        "cli_no_driver,cli_bench_cuda,fork_child",
        env={"FAKE_CUDA_FAIL": "cuMemcpyHtoDAsync:1"},
    )
    assert code == 1, text
    checks = by_name(report)
    assert checks["cli_bench_cuda"]["status"] == "fail"
    assert "CUDA_ERROR_UNKNOWN" in checks["cli_bench_cuda"]["details"]
    assert checks["cli_no_driver"]["status"] == "pass"  # before it: no driver on its path
    assert checks["fork_child"]["status"] in ("pass", "fail")  # after it: ran
    assert "fork_child" in checks and report["summary"]["fail"] >= 1
    assert "**FAIL**" in text


def test_every_script_check_exists():
    # The GPU checks cannot run here: at least each function the runner calls must exist.
    import checks_driver
    import checks_gpu

    modules = {"checks_driver.py": checks_driver.CHECKS, "checks_gpu.py": checks_gpu.CHECKS}
    called = {(c.run.script, c.run.function) for c in runner.CHECKS if hasattr(c.run, "script")}
    defined = {(script, name) for script, checks in modules.items() for name in checks}
    # sanitizer_load runs under compute-sanitizer, from the runner's own sanitizer check.
    assert called == defined - {("checks_gpu.py", "sanitizer_load")}


def test_time_budget(tmp_path):
    # Past --budget no check starts; each says why. (The report is written after every check, so
    # a run stopped from outside leaves one too.)
    code, report, _ = run_kit(
        tmp_path, "--budget", "0.001", "--only", "no_driver_load,cli_no_driver"
    )
    assert code == 0
    for c in report["checks"]:
        assert c["status"] == "not-run" and "--budget" in c["details"], c


def test_a_check_past_its_time_fails_and_the_run_goes_on(tmp_path):
    # Each check within 0.5 s: both time out (the CLI the second one starts, a grandchild, is
    # killed with it), each is reported as such, and the run ends with a report.
    only = "no_driver_load,cli_no_driver"
    code, report, _ = run_kit(tmp_path, "--timeout", "0.5", "--only", only)
    assert code == 1
    assert [c["name"] for c in report["checks"]] == only.split(",")
    for c in report["checks"]:
        assert c["status"] == "fail" and c["details"].startswith("timed out after 0.5 s"), c
        assert c["seconds"] < 30, c


def test_pytest_results_are_read_from_junit(tmp_path):
    # How the kit reads the gpu-marked tests' outcome on the GPU machine: a real pytest run's
    # JUnit XML, with a pass, a failure (its message kept), an error and a skip.
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "@pytest.fixture\n"
        "def broken():\n"
        "    raise RuntimeError('no fixture')\n"
        "def test_ok():\n"
        "    print('output')\n"
        "def test_bad():\n"
        "    assert 1 == 2, 'bytes differ'\n"
        "def test_error(broken):\n"
        "    pass\n"
        "@pytest.mark.skip(reason='no GPU')\n"
        "def test_skipped():\n"
        "    pass\n"
    )
    xml = tmp_path / "out.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path),
         f"--junitxml={xml}", "-o", "junit_logging=all"],
        capture_output=True,
        timeout=120,
        cwd=tmp_path,
    )  # fmt: skip
    counts, failed = runner.junit(xml)
    assert counts == {"tests": 4, "failures": 1, "errors": 1, "skipped": 1}
    assert len(failed) == 2
    assert failed[0].startswith("test_bad: ") and "bytes differ" in failed[0]
    assert failed[1].startswith("test_error: ")


def test_storage_to_gpu_table_from_a_gpu_report(tmp_path):
    # The table docs/benchmarks.md's is filled from: each throughput as a fraction of the
    # page-locked copy rate, from the numbers the checks report on a GPU (benches/gpu_bench.py's
    # JSON rows).
    import kit_report

    def check(name, status, **numbers):
        return {"name": name, "title": name, "status": status, "details": "d", "seconds": 1.0,
                "numbers": numbers}  # fmt: skip

    bench_rows = [
        {"cache": "warm", "row": "fastload", "seconds": 0.1, "gb_per_s": 20.0},
        {"cache": "cold", "row": "safetensors", "seconds": 0.4, "gb_per_s": 5.0},
    ]
    report = {
        "mode": "gpu",
        "complete": True,
        "seconds": 9.0,
        "started": "now",
        "kit": None,
        "environment": {"torch": {"version": "2.11", "devices": ["NVIDIA H100"]}},
        "checks": [
            check("pinned_h2d", "pass", gb_per_s=40.0),
            check("cli_bench_cuda", "pass", best_gb_per_s=30.0, file_bytes=2 << 30),
            check("gpu_bench", "pass", rows=bench_rows, notes={}),
            check("fork_child", "fail"),
        ],
    }
    kit_report.write_report(report, tmp_path / "r")
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["summary"] == {"pass": 3, "fail": 1, "not-run": 0}
    rows = [(r["cache"], r["gb_per_s"], r["of_pinned_copy"]) for r in saved["storage_to_gpu"]]
    assert rows == [
        ("-", 40.0, 1.0),
        ("warm", 30.0, 0.75),
        ("warm", 20.0, 0.5),
        ("cold", 5.0, 0.125),
    ]
    text = (tmp_path / "r.md").read_text()
    assert (
        "| `fastload bench --device cuda` (2.0 GiB, driver memory) | warm | 30.00 | 0.75 |" in text
    )
    assert "| fastload `load(device=...)` (benches/gpu_bench.py) | warm | 20.00 | 0.50 |" in text
    assert "NVIDIA H100" in text and "**FAIL**" in text


def test_cold_start_bench_runs_without_a_gpu(tmp_path):
    # benches/gpu_cold_start.py, the kit's cold_start check, on CPU: Llama-3-8B's structure
    # scaled down, every row in a fresh process, the targets' verdicts (those measured against
    # the device's copy rate say they were not measured), the second load and the memory checks.
    sys.path.insert(0, str(REPO / "benches"))
    from make_checkpoint import llama3_layout

    full = llama3_layout(16 << 30, 2)
    shapes = dict(full)
    assert sum(math.prod(s) for _, s in full) == 8_030_261_248  # Llama-3-8B's parameters
    assert shapes["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert shapes["lm_head.weight"] == (128256, 4096)
    out = tmp_path / "cold.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benches" / "gpu_cold_start.py"), "--device", "cpu",
         "--size", "4MiB", "--cache", "warm", "--reps", "1", "--rows",
         "fastload,fastload-mmap,safetensors,instanttensor,parts-tp2,lazy-tp8", "--ckpt-dir",
         str(tmp_path),
         "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert report["files"] == 4 and report["tensors"] == len(full)
    rows = {r["row"]: r for r in report["rows"]}
    assert sorted(rows) == ["fastload", "fastload-mmap", "lazy-tp8", "parts-tp2", "safetensors"]
    assert rows["fastload"]["bytes"] == rows["safetensors"]["bytes"] == report["bytes"]
    assert rows["fastload"]["second"]["bytes"] == report["bytes"]
    assert rows["fastload-mmap"]["second"]["bytes"] == report["bytes"]
    assert rows["fastload-mmap"]["stats"]["method"] == "mmap"
    assert report["rates"]["warm fastload-mmap second"] > 0
    # A rank's slices read less than the whole checkpoint.
    assert 0 < rows["parts-tp2"]["bytes"] < report["bytes"]
    assert 0 < rows["lazy-tp8"]["bytes"] < rows["parts-tp2"]["bytes"]
    assert "no CUDA device" in report["notes"]["copy"]
    assert report["notes"]["instanttensor"]  # not installed here, or no CUDA device: why
    verdicts = {v["target"]: v for v in report["verdicts"]}
    assert verdicts["warm first load / page-locked copy rate"]["met"] is None
    assert verdicts["TP 2 parts / whole load"]["ratio"] > 0
    assert report["memory"] == [{"pinned_cached": 0, "pinned_within_limit": True}] * 2
    assert verdicts["warm first load, mmap / page-locked copy rate"]["met"] is None
    assert "targets:" in proc.stdout


def test_cold_start_runs_method_direct_cold_only_and_copy_streams_warm_only(tmp_path):
    # The fastload-direct row runs cold (warm, its blocks are cached and it reads as the
    # fastload row does); on the harness without a device it loads to the CPU, directly too.
    # The two-copy-stream rows run warm (cold, the disk is the limit, not the copies), once; the
    # 16 MiB-block row once warm, and cold.
    out = tmp_path / "cold.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benches" / "gpu_cold_start.py"), "--device", "cpu",
         "--size", "4MiB", "--cache", "warm,cold", "--reps", "2", "--rows",
         "fastload,fastload-direct,fastload-direct-b16,fastload-streams2,fastload-b16",
         "--ckpt-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    runs = sorted((r["cache"], r["row"]) for r in report["rows"])
    assert runs == [("cold", "fastload"), ("cold", "fastload-b16"), ("cold", "fastload-direct"),
                    ("cold", "fastload-direct-b16"), ("warm", "fastload"), ("warm", "fastload"),
                    ("warm", "fastload-b16"), ("warm", "fastload-streams2")]  # fmt: skip
    streams = next(r for r in report["rows"] if r["row"] == "fastload-streams2")
    assert streams["bytes"] == streams["second"]["bytes"] == report["bytes"]
    assert streams["stats"]["copy_streams"] is None  # to the CPU: nothing is copied
    direct = next(r for r in report["rows"] if r["row"] == "fastload-direct")
    assert direct["bytes"] == report["bytes"]
    assert direct["stats"]["method"] == "direct" and direct["stats"]["direct_bytes"] > 0
    for row in ("fastload-direct-b16", "fastload-b16"):
        got = [r for r in report["rows"] if r["row"] == row]
        assert {r["stats"]["block_size"] for r in got} == {16 << 20}, row
        assert all(r["bytes"] == report["bytes"] for r in got)
    verdicts = {v["target"]: v for v in report["verdicts"]}
    assert verdicts["cold load, direct / disk O_DIRECT rate"]["ratio"] is not None
    assert verdicts["cold load, 16 MiB blocks / disk O_DIRECT rate"]["ratio"] is not None
    assert "cold load, direct / disk O_DIRECT rate" in proc.stdout
    # The fastest cold way is one of the rows that ran cold, named in its verdict.
    fastest = [t for t in verdicts if t.startswith("fastest cold load (")]
    assert len(fastest) == 2
    assert fastest[0].split("(")[1].split(")")[0] in {r for c, r in runs if c == "cold"}


def test_cold_start_verdicts_name_the_fastest_way_and_the_hardware_bound():
    # Rates as a run would give them: the fastest of fastload's rows per target, whichever
    # method it was; a peer target out of reach says how far the hardware lets it go.
    sys.path.insert(0, str(REPO / "benches"))
    import gpu_cold_start

    rates = {"copy": 50.0, "disk O_DIRECT": 6.0, "disk buffered x8": 5.0,
             "warm fastload": 30.0, "warm fastload second": 40.0,
             "warm fastload-mmap": 44.0, "warm fastload-mmap second": 38.0,
             "warm fastload-b16": 31.0, "warm fastload-b16 second": 46.0,
             "warm parts-tp2": 60.0,  # slices: never "the fastest whole load"
             "warm instanttensor": 45.0, "warm safetensors": 5.0,
             "cold fastload": 4.0, "cold fastload-direct": 5.9, "cold fastload-b16 second": 9.0,
             "cold instanttensor": 5.5, "cold runai": None}  # fmt: skip
    got = {v["target"]: v for v in gpu_cold_start.verdicts(rates)}
    first = got["fastest warm first load (fastload-mmap) / page-locked copy rate"]
    assert first["ratio"] == 44.0 / 50.0 and first["met"] is True
    second = got["fastest warm second load (fastload-b16) / page-locked copy rate"]
    assert second["ratio"] == 46.0 / 50.0 and second["met"] is True
    peer = got["fastest warm first load (fastload-mmap) / best warm peer"]
    assert peer["ratio"] == 44.0 / 45.0 and peer["met"] is False
    # 1.2x of a peer at 45 GB/s is beyond a 50 GB/s copy rate: the report says so.
    assert peer["bound"] == 50.0 / 45.0 and peer["out_of_reach"] is True
    assert got["warm load / best warm peer"]["bound"] == 50.0 / 45.0
    assert runner._verdict(peer) == (
        "fastest warm first load (fastload-mmap) / best warm peer 0.98 "
        "(not met; the hardware allows at most 1.11)"
    )
    cold = got["fastest cold load (fastload-direct) / disk O_DIRECT rate"]
    assert cold["ratio"] == 5.9 / 6.0 and cold["met"] is True
    assert got["fastest cold load (fastload-direct) / best cold peer"]["bound"] == 6.0 / 5.5
    assert "bound" not in got["warm first load / page-locked copy rate"]
    # A peer faster than the disk's measured rate: the disk reaches at least the peer's rate,
    # so no bound below 1 (fastload may yet match the peer).
    fast_peer = gpu_cold_start.verdicts({**rates, "cold instanttensor": 6.5})
    assert {v["target"]: v for v in fast_peer}["cold load / best cold peer"]["bound"] == 1.0
    # Nothing measured cold: no fastest cold row, and the peer targets' bound is unknown.
    warm_only = {k: v for k, v in rates.items() if not k.startswith("cold")}
    got = {v["target"]: v for v in gpu_cold_start.verdicts(warm_only)}
    assert not [t for t in got if t.startswith("fastest cold")]
    assert got["cold load / best cold peer"] == {"target": "cold load / best cold peer",
                                                 "ratio": None, "needs": 1.0, "met": None,
                                                 "bound": None,
                                                 "out_of_reach": False}  # fmt: skip


def test_cold_start_fastest_way_is_picked_on_first_runs():
    # fastload-mmap runs twice warm, fastload-b16 once: picked on their best, mmap's second draw
    # would win although b16's one run beat mmap's first. The pick takes each row's first run;
    # the rating is still the row's best, as every row's is.
    sys.path.insert(0, str(REPO / "benches"))
    import gpu_cold_start

    def row(cache, name, rate, second=None):
        r = {"cache": cache, "row": name, "gb_per_s": rate}
        if second is not None:
            r["second"] = {"bytes": 1e9, "seconds": 1.0 / second}
        return r

    report = {"limits": {"cold": {"disk O_DIRECT": {"gb_per_s": 6.0}}},
              "rows": [row("warm", "copy", 50.0),
                       row("warm", "fastload-mmap", 30.0, second=35.0),
                       row("warm", "fastload-b16", 40.0, second=39.0),
                       row("warm", "fastload-mmap", 44.0, second=45.0),
                       row("cold", "fastload", 5.0),
                       row("cold", "fastload-direct", 5.5)]}  # fmt: skip
    got = {v["target"]: v for v in gpu_cold_start.summarise(report)["verdicts"]}
    first = got["fastest warm first load (fastload-b16) / page-locked copy rate"]
    assert first["ratio"] == 40.0 / 50.0
    second = got["fastest warm second load (fastload-b16) / page-locked copy rate"]
    assert abs(second["ratio"] - 39.0 / 50.0) < 1e-9
    assert got["warm first load, mmap / page-locked copy rate"]["ratio"] == 44.0 / 50.0
    assert "fastest cold load (fastload-direct) / disk O_DIRECT rate" in got
    # Picked on the best runs instead, the twice-run row wins both.
    rates = gpu_cold_start.summarise(report)["rates"]
    assert "fastest warm first load (fastload-mmap) / page-locked copy rate" in {
        v["target"] for v in gpu_cold_start.verdicts(rates)
    }


def test_storage_to_gpu_table_takes_the_cold_start_rates(tmp_path):
    # Without pinned_h2d, the cold_start check's own copy rate is what the rows are a fraction
    # of; the disk's rate is a cold row, rows not measured are left out.
    import kit_report

    numbers = {"bytes": 16_060_522_496, "files": 4,
               "rates": {"copy": 50.0, "warm fastload": 40.0, "disk O_DIRECT": 5.0,
                         "warm lazy-tp2": None}}  # fmt: skip
    report = {"mode": "gpu", "complete": True, "seconds": 1.0, "started": "now", "kit": None,
              "environment": {}, "checks": [{"name": "cold_start", "title": "t", "status": "pass",
                                             "details": "d", "seconds": 1.0,
                                             "numbers": numbers}]}  # fmt: skip
    kit_report.write_report(report, tmp_path / "r")
    rows = json.loads((tmp_path / "r.json").read_text())["storage_to_gpu"]
    assert [(r["cache"], r["row"].split(" (")[0], r["of_pinned_copy"]) for r in rows] == [
        ("-", "copy", 1.0),
        ("warm", "fastload", 0.8),
        ("cold", "disk O_DIRECT", 0.1),
    ]
    assert "16.1 GB in 4 files" in rows[0]["row"]
