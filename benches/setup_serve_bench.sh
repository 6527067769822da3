#!/usr/bin/env bash
# Makes .venv-serve-bench for benches/serve_bench.py: .venv-vllm (bash scripts/setup_vllm.sh)
# seen through a .pth line, plus runai-model-streamer and its S3 backend, which vLLM's
# runai_streamer load format needs. The test venv itself stays without them (the tests check
# that fastload serves s3:// model paths with runai-model-streamer absent).
#
#   bash benches/setup_serve_bench.sh      # seconds once .venv-vllm exists
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VENV=$(realpath -m "${FASTLOAD_VLLM_VENV:-.venv-vllm}")
VENV=$(realpath -m "${FASTLOAD_SERVE_BENCH_VENV:-.venv-serve-bench}")
[ -x "$VLLM_VENV/bin/python" ] || bash scripts/setup_vllm.sh
if [ ! -x "$VENV/bin/python" ]; then
    "$VLLM_VENV/bin/python" -m venv --without-pip "$VENV"
    echo '*' >"$VENV/.gitignore"
fi
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
site "$VLLM_VENV" >"$(site "$VENV")/_vllm_venv.pth"
# .pth files of a folder a .pth line adds are not read: fastload's editable install, again.
cp "$(site "$VLLM_VENV")/fastload.pth" "$(site "$VENV")/"
# pip from the vLLM venv, installing into this one (--prefix keeps .venv-vllm untouched).
"$VLLM_VENV/bin/python" -m pip install -q --disable-pip-version-check --prefix "$VENV" \
    --no-warn-script-location "runai-model-streamer>=0.15" "runai-model-streamer-s3>=0.15" boto3
"$VENV/bin/python" -c 'import runai_model_streamer, vllm, fastload; print("== serve bench venv ready:", "vllm", vllm.__version__, "runai-model-streamer", getattr(runai_model_streamer, "__version__", "?"))'
