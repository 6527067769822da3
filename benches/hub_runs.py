"""What the benches against the mock Hub share (hub_bench.py, transformers_bench.py): a run in a
fresh process whose last line of output is its JSON result, the environment those runs start
from, and the mock Hub (tests/servers/hub.py) serving a folder in its own process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def clean_env() -> dict[str, str]:
    """This process's environment without its Hugging Face and fastload settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "FASTLOAD_"))}


def run(script: str, *args: str, env: dict) -> dict:
    """``script`` (Python source) in a fresh interpreter with ``args``; the JSON it printed last."""
    out = subprocess.run(
        [sys.executable, "-c", script, *args], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextmanager
def mock_hub(folder: Path, repo: str, rate: float) -> Iterator[str]:
    """The mock Hub serving ``folder`` as ``repo`` at ``rate`` bytes/s (0: unlimited), in its own
    process; yields its address (for ``HF_ENDPOINT``) and stops it after."""
    server = subprocess.Popen(
        [sys.executable, "-m", "servers.hub", "--dir", str(folder.resolve()),
         "--repo", repo, "--rate", str(rate)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT / "tests",
    )  # fmt: skip
    try:
        assert server.stdout is not None
        yield server.stdout.readline().strip()
    finally:
        assert server.stdin is not None
        server.stdin.close()
        server.wait(timeout=30)


def link_name(rate: float) -> str:
    """A storage link's rate as the tables name it."""
    return "unlimited" if rate == 0 else f"{rate / 1e6:.0f} MB/s"
