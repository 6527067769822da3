#!/usr/bin/env bash
# The GPU verification kit (docs/development.md, "Checking on a real GPU").
#
#   bash scripts/gpu_kit.sh build   # here: the abi3 wheel, the kit's scripts and gpu tests, and the
#                                   # wheels they need offline, into gpu-kit/ (git-ignored)
#   bash gpu-kit/run.sh             # on the GPU machine (Python + CUDA torch + driver; no Rust,
#                                   # no network): every check, one report
#   bash scripts/gpu_kit.sh run [options]   # the same from here: a dry run without a GPU
#
# GPU_KIT_DIR moves the kit folder; PYTHON picks the interpreter (build: the one whose package
# versions the kit ships, default .venv/bin/python; run: default python3).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
KIT="${GPU_KIT_DIR:-$REPO/gpu-kit}"
cmd="${1:-}"
[ $# -gt 0 ] && shift

build() {
    local py="${PYTHON:-$REPO/.venv/bin/python}"
    local maturin="$REPO/.venv/bin/maturin"
    [ -x "$maturin" ] || maturin="maturin"
    mkdir -p "$KIT/wheels"
    rm -rf "$KIT/kit" "$KIT/tests" "$KIT/benches" "$KIT"/wheels/fastload-*.whl
    # The release build `maturin develop --release` made is reused: same profile and features.
    (cd "$REPO" && VIRTUAL_ENV="$REPO/.venv" "$maturin" build --release --quiet -o "$KIT/wheels")

    # The tests' own needs, at the versions this environment runs them with; pure or abi3
    # wheels for CPython 3.12 on x86-64 Linux. Downloaded once, kept between builds.
    local want
    want="$("$py" - <<'PY'
from importlib.metadata import version
print(" ".join(f"{n}=={version(n)}" for n in
               ["pytest", "iniconfig", "packaging", "pluggy", "pygments", "safetensors"]))
PY
)"
    local missing=() spec name ver whl base found
    for spec in $want; do
        name="${spec%%==*}" ver="${spec##*==}" found=""
        for whl in "$KIT"/wheels/*.whl; do
            base="$(basename "$whl")"
            case "${base,,}" in
            "${name,,}-${ver}-"*) found=1 ;;
            "${name,,}-"*) rm -f "$whl" ;; # one version of each: pip refuses two in one install
            esac
        done
        [ -n "$found" ] || missing+=("$spec")
    done
    if [ ${#missing[@]} -gt 0 ]; then
        local links=()
        [ -d /opt/wheels ] && links=(--find-links /opt/wheels)
        "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --python-version 3.12 --implementation cp --platform manylinux_2_17_x86_64 \
            --platform manylinux2014_x86_64 "${links[@]}" -d "$KIT/wheels" "${missing[@]}"
    fi

    peers

    mkdir -p "$KIT/kit" "$KIT/tests" "$KIT/benches"
    cp "$REPO"/scripts/gpu_kit/*.py "$KIT/kit/"
    cp "$REPO/scripts/gpu_kit/run.sh" "$KIT/run.sh"
    # The test files with gpu-marked tests and what they import (conftest and its helpers need
    # only the standard library, pytest, torch and safetensors).
    for f in "$REPO"/tests/*.py; do
        case "$(basename "$f")" in
        test_*) if grep -q "pytest.mark.gpu" "$f"; then cp "$f" "$KIT/tests/"; fi ;;
        *) cp "$f" "$KIT/tests/" ;;
        esac
    done
    cp -r "$REPO/tests/fake_cuda" "$KIT/tests/"
    # The test servers the shared fixtures import (tests/stores.py, conftest.py).
    mkdir -p "$KIT/tests/servers"
    cp "$REPO"/tests/servers/*.py "$KIT/tests/servers/"
    cp "$REPO"/benches/{gpu_bench.py,tp_gpu_bench.py,gpu_cold_start.py,limits.py,make_checkpoint.py} \
        "$KIT/benches/"
    cat >"$KIT/README.txt" <<'TXT'
fastload GPU verification kit (built by scripts/gpu_kit.sh build; see docs/development.md,
"Checking on a real GPU"). On a GPU machine (Python with a CUDA torch, an NVIDIA driver; no Rust, no network):

    bash run.sh                 # every check; report in $OUT if set, else here
    bash run.sh --only a,b      # some checks; --skip a,b; --budget SECONDS; --help

Writes gpu-kit-report.json, gpu-kit-report.md (its "Storage -> GPU" table fills docs/benchmarks.md's)
and gpu-kit.log. Exit status 1 if a check failed.
TXT
    cat >"$KIT/pytest.ini" <<'INI'
[pytest]
testpaths = tests
markers =
    gpu: needs a CUDA driver and device (skipped otherwise)
    slow: takes more than a few seconds
INI
    local commit wheel
    commit="$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)"
    git -C "$REPO" diff --quiet HEAD 2>/dev/null || commit="$commit+dirty"
    wheel="$(cd "$KIT/wheels" && ls fastload-*.whl)"
    printf '{"commit": "%s", "built": "%s", "wheel": "%s", "deps": "%s"}\n' \
        "$commit" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$wheel" "$want" >"$KIT/BUILD.json"
    echo "gpu-kit: $(du -sh "$KIT" | cut -f1) in $KIT ($wheel); on a GPU machine: bash $(basename "$KIT")/run.sh" >&2
}

# The peers benches/gpu_cold_start.py runs beside fastload (the GPU machine has no network), for
# the machine's Python (3.12, x86-64; PEERS_PYTHON_VERSION changes it): in peers/, apart from the
# wheels the kit installs, with their own needs (typer, humanize, numpy, torch) left to the
# machine's image. Downloaded once, kept between builds; a peer that cannot be downloaded is
# left out (benches/gpu_cold_start.py then reports it as not run, with why).
PEERS="fastsafetensors==0.5.0 instanttensor==0.2.2 runai-model-streamer==0.17.1"
peers() {
    local py="${PYTHON:-$REPO/.venv/bin/python}" spec name found whl
    mkdir -p "$KIT/peers"
    for spec in $PEERS; do
        name="${spec%%==*}" found=""
        for whl in "$KIT"/peers/*.whl; do
            case "$(basename "$whl")" in "${name//-/_}-${spec##*==}-"* | "$name-${spec##*==}-"*) found=1 ;; esac
        done
        [ -n "$found" ] && continue
        "$py" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
            --retries 1 --timeout 20 --python-version "${PEERS_PYTHON_VERSION:-3.12}" --implementation cp \
            --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
            -d "$KIT/peers" "$spec" || echo "gpu-kit: $spec not downloaded: left out" >&2
    done
}

case "$cmd" in
build) build ;;
run)
    if [ ! -f "$KIT/run.sh" ]; then
        echo "gpu-kit: no kit in $KIT: run 'bash scripts/gpu_kit.sh build' first" >&2
        exit 2
    fi
    exec bash "$KIT/run.sh" "$@"
    ;;
*)
    sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
    exit 2
    ;;
esac
