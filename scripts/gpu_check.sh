#!/usr/bin/env bash
# Everything that waits for a GPU (on the device machine: `bash scripts/gpu_check.sh PART`; its
# image has torch, triton and transformers, nothing needs installing). PART, one per call to stay
# inside a call's 10 minutes:
#   tests    the tests marked gpu: kernels on the device, CUDA-graph capture of quantized layers
#            and of the engine's decode steps (greedy tokens with graphs == eager)      ~2 min
#   kernels  `qtk bench kernels --device cuda`: Triton GEMMs on Llama-3-8B shapes vs cuBLAS  ~4 min
#   engine   benchmarks/gpu_engine.py: the runtime's GPU bars, Llama-3-8B-shaped random weights ~8 min
# Results go to $OUT when set (the device machine's return folder), else benchmarks/results.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
out=${OUT:-benchmarks/results}
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
case "${1:-}" in
    tests) python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_cuda_graphs.py \
               2>&1 | tee "$out/gpu_tests.log" ;;
    kernels) python3 -m qtk.cli bench kernels --device cuda --out "$out" ;;
    engine) python3 benchmarks/gpu_engine.py --out "$out" 2>&1 | tee "$out/gpu_engine.log" | grep -v "^Loading" ;;
    *) echo "usage: bash scripts/gpu_check.sh tests|kernels|engine" >&2; exit 2 ;;
esac
