#!/usr/bin/env bash
# CI's quality gate: quantize the bundled model with qtk's default recipe, then gate the
# checkpoint against the unquantized model with the CI gates (evals/gates/ci.yaml: perplexity,
# KL divergence, needle in a haystack, structured JSON, sized for a 2-core CPU). Exit 1 when a gate regresses; the report lands in build/ci-gate/report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
OUT=${OUT:-build/ci-gate/smollm2-135m-awq-gptq-w4a16}
# the default recipe as a user runs it (128 calibration samples; SAMPLES=N overrides): 32 samples
# saved 45 s but moved the KL divergence from the baseline from 0.071 to 0.076 (benchmarks/results/gates.md)
qtk quantize smollm2-135m ${SAMPLES:+--num-samples "$SAMPLES"} --output "$OUT" --force
qtk eval "$OUT" --baseline smollm2-135m --gates ci --report build/ci-gate/report
