"""The console script's entry point runs the CLI in-process (issue 14, item 10: its usage error
went to the test run's own stderr)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

from fastload._peers import IMPORTS


def test_usage_errors_return_instead_of_exiting():
    code = textwrap.dedent(
        """
        from fastload import _fastload

        print("returned", _fastload.cli_main(["fastload", "frobnicate"]))
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "returned 2"
    assert "unrecognized subcommand 'frobnicate'" in proc.stderr


def _sample(path):
    import torch
    from safetensors.torch import save_file

    save_file(
        {
            "a": torch.arange(300_000, dtype=torch.float32),
            "b": torch.ones(64, 64, dtype=torch.bfloat16),
        },
        str(path),
    )
    return path


def test_bench_compare_runs_the_installed_peers_and_names_the_others(tmp_path):
    # issue 16: each loader in a fresh process of the wheel script's own Python, cold and warm;
    # the peers that are not installed (or broken) are named with the reason.
    model = _sample(tmp_path / "model.safetensors")
    broken = tmp_path / "site"
    (broken / "fastsafetensors").mkdir(parents=True)
    (broken / "fastsafetensors" / "__init__.py").write_text("raise RuntimeError('broken build')\n")
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_PYTHON"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(broken), env.get("PYTHONPATH")] if p)
    args = ["bench", str(model), "--compare", "--cold", "--warm", "--repeat", "1"]
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", *args, "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    compare = report["compare"]
    assert compare["python"] == sys.executable
    for loader in ("fastload", "safetensors"):
        for mode in ("cold", "warm"):
            runs = compare["loaders"][loader][mode]
            assert len(runs["seconds"]) == 1 and runs["seconds"][0] > 0, compare
            assert runs["bytes"] == report["bytes"], compare
    for mode in ("cold", "warm"):
        ratio = compare["ratio_to_best_peer"][mode]
        fastload_rate = compare["loaders"]["fastload"][mode]["best_gb_per_s"]
        peers = [r[mode]["best_gb_per_s"] for n, r in compare["loaders"].items() if n != "fastload"]
        assert abs(ratio - fastload_rate / max(peers)) < 1e-9, compare
    reasons = {n["loader"]: n["reason"] for n in compare["not_run"]}
    assert reasons["fastsafetensors"].startswith("failed: import fastsafetensors failed"), reasons
    assert "broken build" in reasons["fastsafetensors"]
    for peer in ("runai", "tensorizer"):
        if importlib.util.find_spec(IMPORTS[peer]) is None:
            assert reasons[peer].startswith("not installed"), reasons
        else:
            assert peer in compare["loaders"] or peer in reasons, compare

    # The table: side by side, the ratio, the reasons.
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    for want in ("cold GB/s", "warm GB/s", "fastload / best peer", "not run: fastsafetensors"):
        assert want in proc.stdout, proc.stdout


def test_bench_compare_without_fastload_in_that_python(tmp_path):
    # The bare binary's default python3 may not have fastload: every loader is named, not a crash.
    model = _sample(tmp_path / "model.safetensors")
    args = ["bench", str(model), "--compare", "--repeat", "1", "--json"]
    args += ["--python", "/nonexistent/py"]
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    compare = json.loads(proc.stdout)["compare"]
    assert compare["loaders"] == {}
    reasons = {n["loader"]: n["reason"] for n in compare["not_run"]}
    assert set(reasons) == {"fastload", "safetensors", "runai", "fastsafetensors", "tensorizer"}
    assert all("cannot run /nonexistent/py" in r for r in reasons.values()), reasons
