#!/usr/bin/env bash
# The main job on the bundled model: baseline perplexity, RTN W4A16 quantize, the checkpoint's
# perplexity and size, and a short chat generation from the quantized checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-out/smollm2-135m-rtn-w4a16-g64}
LIMIT=${LIMIT:-8}
mkdir -p out
echo "== baseline perplexity (bf16 weights, built-in eval split, $LIMIT windows x 2048)"
qtk eval smollm2-135m --task ppl --limit "$LIMIT" --json out/baseline-ppl.json
echo "== quantize: RTN W4A16, group 64 (128 does not divide hidden size 576)"
qtk quantize smollm2-135m --method rtn --scheme w4a16 --group-size 64 --output "$OUT" --force
echo "== quantized perplexity"
qtk eval "$OUT" --task ppl --limit "$LIMIT" --json out/rtn-w4a16-ppl.json
echo "== size"
qtk inspect "$OUT" | tail -n 1
echo "== chat generation from the quantized checkpoint"
qtk generate "$OUT" --chat --max-tokens 48 --prompt "Give me three tips for writing clear code."
