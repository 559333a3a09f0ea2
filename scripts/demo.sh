#!/usr/bin/env bash
# The main job on the bundled model: baseline perplexity, quantize with qtk's default recipe (AWQ
# then GPTQ, int4 asymmetric groups), the checkpoint's perplexity and size, and a short chat
# generation from the quantized checkpoint. Every step runs in the dtype the machine is fast in
# (--dtype auto: bf16 on CPUs with bf16 units, float32 elsewhere; the log says which).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-out/smollm2-135m-awq-gptq-w4a16}
LIMIT=${LIMIT:-4}
SAMPLES=${SAMPLES:-32}
mkdir -p out
echo "== baseline perplexity (the bundled model's weights, built-in eval split, $LIMIT windows x 2048)"
qtk eval smollm2-135m --task ppl --limit "$LIMIT" --json out/baseline-ppl.json
echo "== quantize: the default recipe (AWQ, then GPTQ; W4A16 asymmetric; group 64, the largest that divides"
echo "   hidden size 576), $SAMPLES calibration samples of 512 tokens (a few minutes on 2 CPU cores)"
qtk quantize smollm2-135m --num-samples "$SAMPLES" --output "$OUT" --force
echo "== quantized perplexity"
qtk eval "$OUT" --task ppl --limit "$LIMIT" --json out/quantized-ppl.json
echo "== size"
qtk inspect "$OUT" | tail -n 1
echo "== chat generation from the quantized checkpoint"
qtk generate "$OUT" --chat --max-tokens 48 --prompt "Give me three tips for writing clear code."
