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
    for peer in ("runai-model-streamer", "tensorizer"):
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


BENCH = [sys.executable, "-m", "fastload._cli", "bench"]


def _driver(job: dict) -> dict:
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._peers", json.dumps(job)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_no_row_times_an_import_another_row_made_before_its_clock(tmp_path):
    # issue 41: fastload's process imported `fastload` (which does not import torch) before the
    # clock, a peer's imported safetensors.torch (and torch): fastload's first load paid torch's
    # import inside its clock. Every row's process imports the same things first.
    model = str(_sample(tmp_path / "model.safetensors"))
    rows = {}
    for loader in ("fastload", "safetensors"):
        job = {"loader": loader, "workload": "load", "uri": [model], "files": [model]}
        rows[loader] = _driver(job)
    for loader, row in rows.items():
        assert row["bytes"] == 300_000 * 4 + 64 * 64 * 2, row
        before = set(row["modules_before_clock"])
        assert {"torch", "numpy"} <= before, loader
        for other, theirs in rows.items():
            paid = set(row["modules_in_clock"]) & set(theirs["modules_before_clock"])
            assert other == loader or not paid, (loader, other, sorted(paid))

    # The bench reports the same and finds nothing unfair, for every row it ran.
    proc = subprocess.run(
        [*BENCH, model, "--compare=safetensors", "--warm", "--repeat", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    compare = json.loads(proc.stdout)["compare"]
    assert compare["unfair_imports"] == [], compare["unfair_imports"]
    for loader in ("fastload", "safetensors"):
        assert isinstance(compare["loaders"][loader]["warm"]["imported_in_clock"], list), compare
    # One progress line per load on stderr while the fresh processes run.
    progress = [ln for ln in proc.stderr.splitlines() if ln.startswith("fastload: compare: ")]
    assert progress == [
        "fastload: compare: load 1/4: fastload, warm",
        "fastload: compare: load 2/4: safetensors, warm",
        "fastload: compare: load 3/4: fastload, warm",
        "fastload: compare: load 4/4: safetensors, warm",
    ], proc.stderr


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
    assert set(reasons) == {
        "fastload",
        "safetensors",
        "runai-model-streamer",
        "fastsafetensors",
        "tensorizer",
    }
    assert all("cannot run /nonexistent/py" in r for r in reasons.values()), reasons


def _bench(*args, env=None):
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "bench", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_bench_shows_an_installed_peer_by_default_and_compare_none_turns_it_off(tmp_path):
    # issue 33: without --compare, the first installed peer (safetensors here) is one more row
    # beside fastload's own runs, run by the interpreter the script runs in; --compare none: none.
    model = str(_sample(tmp_path / "model.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "FASTLOAD_PYTHON"}
    report = json.loads(_bench(model, "--repeat", "1", "--json", env=env))
    compare = report["compare"]
    assert (compare["python"], compare["peers"], compare["fastload_from"]) == (
        sys.executable,
        "default",
        "runs",
    )
    assert set(compare["loaders"]) == {"fastload", "safetensors"}, compare
    mine = compare["loaders"]["fastload"]["warm"]
    assert mine["best_gb_per_s"] == report["modes"]["warm"]["best_gb_per_s"]
    assert mine["seconds"] == [r["seconds"] for r in report["runs"]]
    peer = compare["loaders"]["safetensors"]["warm"]
    assert len(peer["seconds"]) == 1 and peer["bytes"] == report["bytes"], compare
    ratio = compare["ratio_to_best_peer"]["warm"]
    assert abs(ratio - mine["best_gb_per_s"] / peer["best_gb_per_s"]) < 1e-9
    # Only peers that could have run but did not are named.
    assert all(not n["reason"].startswith("not installed") for n in compare["not_run"]), compare

    table = _bench(model, "--repeat", "1", env=env)
    tail = table[table.index("\nbeside safetensors, each of its loads") :].splitlines()
    assert tail[3].split()[:3] == ["fastload", "(runs", "above)"], table
    assert tail[4].split()[0] == "safetensors" and tail[5].startswith("fastload / safetensors")

    off = _bench(model, "--repeat", "1", "--compare", "none", env=env)
    assert "beside" not in off and "compare" not in off, off
    assert "compare" not in json.loads(_bench(model, "--repeat", "1", "--compare=none", "--json"))


def test_bench_in_a_python_without_torch_says_what_to_install(tmp_path):
    # issue 41: README's first command installs fastload alone; its bench then showed no peer
    # row and never said what would make one appear. A real venv with fastload but no torch.
    import fastload

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "fastload").symlink_to(os.path.dirname(fastload.__file__))
    python = str(venv / "bin" / "python")
    model = str(_sample(tmp_path / "model.safetensors"))
    env = {k: v for k, v in os.environ.items() if k not in ("FASTLOAD_PYTHON", "PYTHONPATH")}
    table = _bench(model, "--repeat", "1", "--python", python, env=env)
    tail = table[table.index("\nno peer beside it: ") :].splitlines()[1:]
    assert tail == [
        f"no peer beside it: torch is not installed in {python} (--python PATH picks another "
        "Python, --compare none drops this line)",
        "  to see safetensors beside fastload, install it into that Python and run again:",
        f"    {python} -m pip install torch safetensors",
        f"  (or torch's CPU build: {python} -m pip install torch --index-url "
        f"https://download.pytorch.org/whl/cpu, then {python} -m pip install safetensors)",
    ], table


def test_bench_compare_takes_the_peers_to_run(tmp_path):
    model = str(_sample(tmp_path / "model.safetensors"))
    # `--compare PEERS` (or `--compare=PEERS`): those, and fastload through the same driver.
    report = json.loads(_bench("--compare", "safetensors", model, "--repeat", "1", "--json"))
    compare = report["compare"]
    assert (compare["peers"], compare["fastload_from"]) == ("safetensors", "driver")
    assert set(compare["loaders"]) == {"fastload", "safetensors"} and compare["not_run"] == []
    # A word after --compare that names no peer stays a URI, as before --compare took a value.
    report = json.loads(_bench("--compare", model, "--repeat", "1", "--json"))
    assert report["uris"] == [model] and report["compare"]["peers"] == ",".join(
        ["safetensors", "runai-model-streamer", "fastsafetensors", "tensorizer"]
    )
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "bench", model, "--compare=runai"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert '"runai" is not a peer' in proc.stderr and "runai-model-streamer" in proc.stderr


def test_inspect_has_one_shape_in_python_and_on_the_command_line(tmp_path):
    # issue 33: fastload.inspect returns the object `fastload inspect --json` prints.
    import fastload

    model = str(_sample(tmp_path / "model.safetensors"))
    proc = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "inspect", model, "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    report = fastload.inspect(model)
    assert report == json.loads(proc.stdout)
    assert report["total"] == {"files": 1, "tensors": 2, "bytes": 300_000 * 4 + 64 * 64 * 2}
    a = next(t for t in report["tensors"] if t["name"] == "a")
    assert a == {
        "name": "a",
        "dtype": "F32",
        "shape": [300_000],
        "bytes": 1_200_000,
        "file": model,
        "data_offsets": a["data_offsets"],
    }
    assert a["data_offsets"][1] - a["data_offsets"][0] == 1_200_000
    (f,) = report["files"]
    assert set(f) == {"file", "size", "header_bytes", "tensors", "bytes", "metadata"}
    assert f["size"] == os.path.getsize(model) == f["header_bytes"] + f["bytes"]
    assert f["metadata"] == {}, f  # no __metadata__: an empty object, as the CLI prints it
    # Its help names the remote forms it reads too.
    help_text = subprocess.run(
        [sys.executable, "-m", "fastload._cli", "inspect", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    for form in ("s3://", "gs://", "az://", "http(s)://", "hf://"):
        assert form in help_text, help_text


def _fastload(*args: str) -> subprocess.CompletedProcess[str]:
    """`fastload ARGS` through the wheel's script, FASTLOAD_* variables cleared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FASTLOAD_")}
    cli = [sys.executable, "-m", "fastload._cli", *args]
    return subprocess.run(cli, capture_output=True, text=True, env=env, timeout=120)


def test_command_line_errors_name_flags_and_python_errors_name_arguments(tmp_path):
    """One table names each argument for both front ends: the command line's errors say
    `--overwrite`, `--part-size`, `--block-size`, Python's `overwrite=True`, `part_size`,
    `block_size`; and `--part-size` is checked as `part_size=` is (it was taken silently)."""
    import fastload
    import pytest

    src = str(_sample(tmp_path / "m.safetensors"))
    taken = tmp_path / "taken.safetensors"
    taken.write_bytes(b"another file")
    out = _fastload("copy", src, str(taken))
    assert out.returncode == 1 and "(pass --overwrite to replace it)" in out.stderr, out.stderr
    assert "overwrite=True" not in out.stderr
    with pytest.raises(fastload.DestinationExistsError) as e:
        fastload.copy(src, taken, progress=False)
    assert "(pass overwrite=True to replace it)" in str(e.value) and "--" not in str(e.value)
    assert taken.read_bytes() == b"another file"

    dst = tmp_path / "small-parts.safetensors"
    out = _fastload("copy", src, str(dst), "--part-size", "1MiB")
    assert out.returncode == 1, out.stderr
    assert "invalid option --part-size: 1MiB is not between 5MiB and 5GiB" in out.stderr
    for call in (
        lambda: fastload.copy(src, dst, part_size="1MiB", progress=False),
        lambda: fastload.save_file({}, dst, part_size=1 << 20),
    ):
        with pytest.raises(fastload.ConfigError) as e:
            call()
        assert e.value.option == "part_size", e.value
        assert "invalid option part_size: 1MiB is not between 5MiB and 5GiB" in str(e.value)
    assert not dst.exists()
    assert _fastload("copy", src, str(dst), "--part-size", "5MiB").returncode == 0

    out = _fastload("bench", src, "--block-size", "1KiB", "--compare=none")
    assert out.returncode == 1 and "invalid option --block-size: 1KiB" in out.stderr, out.stderr
    with pytest.raises(fastload.ConfigError, match="invalid option block_size: 1KiB"):
        fastload.load(src, block_size="1KiB")
    # A misspelt storage option (checked before any request): `--option KEY`, as given.
    out = _fastload("copy", src, "s3://bucket/m.safetensors", "--option", "endpiont=http://x")
    assert out.returncode == 1 and "invalid option --option endpiont:" in out.stderr, out.stderr
    assert "storage_options" not in out.stderr
    with pytest.raises(fastload.ConfigError) as e:
        fastload.copy(src, "s3://bucket/m.safetensors", storage_options={"endpiont": "http://x"})
    assert e.value.option == 'storage_options["endpiont"]' and "--option" not in str(e.value)
