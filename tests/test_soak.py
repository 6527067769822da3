"""The soak (benches/soak.py), small: loads against a server of ours that injects faults at random,
a local file changed under load, and saves and copies failed at random points. Every load ends
bitwise equal or with a clear error in bounded time; none hangs, crashes or returns wrong data.
Hostile index entries and small-file names are each refused naming them (or stay inside), with
nothing read or written outside."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_soak_has_no_hangs_crashes_or_wrong_data(tmp_path):
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(REPO / "benches" / "soak.py"), "--remote", "40", "--local", "40"]
    cmd += ["--shared", "20", "--swap", "40", "--hostile", "60", "--writes", "8"]
    proc = subprocess.run([*cmd, "--json", str(out)], capture_output=True, text=True, timeout=480)
    summary = json.loads(out.read_text())
    assert summary["bad"] == [], summary["bad"]
    assert proc.returncode == 0, proc.stderr[-2000:]
    for kind, loads in (
        ("remote", 40),
        ("local", 40),
        ("shared", 20),
        ("shared_local", 20),
        ("swap", 40),
        ("hostile", 60),
    ):
        assert summary[kind]["loads"] == loads, summary
    # Loads come back whole, not only as clear errors: every kind of the server's, and the
    # loads of the changing local file taken together (a file replaced every 0 to 0.2 s can fail
    # 20 short streams in a row by chance on a loaded machine; all 60 failing would be a fault).
    for kind in ("remote", "shared", "swap"):
        assert summary[kind]["outcomes"].get("equal", 0) > 0, summary
    changing = [summary[k]["outcomes"].get("equal", 0) for k in ("local", "shared_local")]
    assert sum(changing) > 0, summary
    # Every kind of fault was injected at least once, and the loads still came back right.
    assert set(summary["faults_injected"]) == {"503", "reset", "truncate", "stall", "trickle"}
    # Hostile names: each refused by every path naming it, or inside the folder; nothing asked
    # for outside the checkpoints' folders, nothing written outside the destinations.
    hostile = summary["hostile"]["outcomes"]
    assert hostile.get("refused", 0) >= 13 and set(hostile) <= {"refused", "inside"}, summary
    audits = summary["hostile_audits"]
    assert audits["requests"] > 0 and not audits["outside_requests"], audits
    assert not audits["outside_writes"], audits
    # Saves and copies failed at random points: each load after one found the earlier
    # checkpoint or the new one whole, or raised (a partial or mixed load is in `bad`).
    assert summary["writes"]["rounds"] == 8 and summary["writes"]["partial_or_mixed"] == 0
    assert {case.split()[1] for case in summary["writes"]["by_case"]} == {"save", "copy"}
    # The object was overwritten under the swap loads: each came back one version whole, or
    # failed saying it changed (a clear error), never a mix.
    assert summary["swaps"] > 0, summary
