#!/usr/bin/env bash
# Runs the fastload GPU verification kit from this folder (built by `scripts/gpu_kit.sh build`):
# installs its wheels offline into a temporary target, runs every check, writes
# gpu-kit-report.{json,md} to $OUT when set, else here. Needs Python >= 3.9 (PYTHON, default
# python3) with torch; no Rust, no network. Options: kit/runner.py --help.
set -uo pipefail
KIT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
exec "${PYTHON:-python3}" "$KIT/kit/runner.py" --root "$KIT" "$@"
