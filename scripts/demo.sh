#!/usr/bin/env bash
# The main job on the bundled model: baseline perplexity, quantize with qtk's default recipe (AWQ
# then GPTQ, int4 asymmetric groups), the checkpoint's perplexity and size, and a short chat
# generation from the quantized checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-out/smollm2-135m-awq-gptq-w4a16-g64}
LIMIT=${LIMIT:-8}
mkdir -p out
echo "== baseline perplexity (bf16 weights, built-in eval split, $LIMIT windows x 2048)"
qtk eval smollm2-135m --task ppl --limit "$LIMIT" --json out/baseline-ppl.json
echo "== quantize: the default recipe (AWQ, then GPTQ; W4A16 asymmetric), group 64 (128 does not divide"
echo "   hidden size 576), 64 calibration samples of 512 tokens (about 3 minutes on 2 CPU cores)"
qtk quantize smollm2-135m --group-size 64 --num-samples 64 --output "$OUT" --force
echo "== quantized perplexity"
qtk eval "$OUT" --task ppl --limit "$LIMIT" --json out/quantized-ppl.json
echo "== size"
qtk inspect "$OUT" | tail -n 1
echo "== chat generation from the quantized checkpoint"
qtk generate "$OUT" --chat --max-tokens 48 --prompt "Give me three tips for writing clear code."
