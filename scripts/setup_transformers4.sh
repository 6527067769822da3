#!/usr/bin/env bash
# Sets up .venv-tf4: transformers' last 4.x release (4.57) beside the main .venv's torch, for
# tests/test_transformers4.py (which runs tests/test_transformers.py there).
#
#   bash scripts/setup_transformers4.sh     # about a minute the first time, instant once set up
#
# transformers 4.57 needs huggingface_hub<1.0 (and tokenizers<=0.23.0), which the main .venv has
# newer. So .venv-tf4 is a small venv holding just those packages; a .pth line adds the main
# .venv's site-packages (torch, safetensors, pytest, fastload's editable install, ...) *after* its
# own, so its transformers, huggingface_hub and tokenizers shadow the main ones and everything
# else comes from .venv. Run scripts/test.sh's setup (or setup-venv) first: .venv must exist.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=$(realpath -m "${FASTLOAD_TF4_VENV:-.venv-tf4}")
MAIN=$(realpath -m "${FASTLOAD_MAIN_VENV:-.venv}")
TRANSFORMERS_SPEC=${FASTLOAD_TF4_SPEC:-transformers==4.57.*}
PYTHON=${PYTHON:-python3}
site() { "$1/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }

[ -x "$MAIN/bin/python" ] || { echo "setup_transformers4: $MAIN is not a venv" >&2; exit 1; }
main_site=$(site "$MAIN")
STAMP="$VENV/.setup-$(echo "$TRANSFORMERS_SPEC" | tr -c 'A-Za-z0-9.=\n' _)"

check() {
    "$VENV/bin/python" - "$(site "$VENV")" <<'PY'
import sys

import huggingface_hub
import tokenizers
import torch
import transformers

import fastload

own_site = sys.argv[1]
assert transformers.__version__.startswith("4."), transformers.__version__
for mod in (transformers, huggingface_hub, tokenizers):
    # Shadowing: these three from .venv-tf4 itself, never from the main .venv.
    assert mod.__file__.startswith(own_site), f"{mod.__name__} from {mod.__file__}"
for mod in (torch, fastload):
    assert not mod.__file__.startswith(own_site), f"{mod.__name__} from {mod.__file__}"
print(f"== setup_transformers4: transformers {transformers.__version__}, huggingface_hub "
      f"{huggingface_hub.__version__}, tokenizers {tokenizers.__version__}; torch "
      f"{torch.__version__} and fastload {fastload.__version__} from the main venv")
PY
}

quick_check() {
    "$VENV/bin/python" -c 'import importlib.metadata as m, fastload
assert m.version("transformers").startswith("4.")' 2>/dev/null
}
if [ -f "$STAMP" ] && quick_check; then
    exit 0
fi
echo "== setup_transformers4: creating $VENV with $TRANSFORMERS_SPEC"
start=$SECONDS
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo '*' >"$VENV/.gitignore"
own_site=$(site "$VENV")
# addsitedir (not a bare path line) so that the main venv's own .pth files (fastload's editable
# install, a venv it sees in turn) are read too; it appends, so our site-packages stays first.
echo "import site; site.addsitedir('$main_site')" >"$own_site/zz_fastload_main_venv.pth"
# pip sees the main venv's packages through that line and installs only what is missing or
# must differ; it never touches the main venv ("outside environment").
# (Its resolver then lists the main venv's packages that want the newer ones: expected.)
if ! "$VENV/bin/python" -m pip install -q --disable-pip-version-check \
    "$TRANSFORMERS_SPEC" "huggingface_hub<1.0" "tokenizers<=0.23.0" >"$VENV/pip.log" 2>&1; then
    cat "$VENV/pip.log"
    exit 1
fi
check
touch "$STAMP"
echo "== setup_transformers4: ready in $((SECONDS - start)) s"
