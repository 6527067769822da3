"""The console script's entry point runs the CLI in-process (issue 14, item 10: its usage error
went to the test run's own stderr)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


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
