#!/usr/bin/env bash
# Rebuild tests/data/hub_formats with AutoGPTQ's and AutoAWQ's own packers (scripts/hub_fixtures.py).
# Only their sources are used (no install): pip download, unpack, load the packing modules by file.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=build/hub_tools
rm -rf "$tools" && mkdir -p "$tools"
python -m pip download -q --no-deps -d "$tools" auto-gptq==0.7.1 autoawq==0.2.9
python - "$tools" <<'EOF'
import sys, tarfile, zipfile
from pathlib import Path
d = Path(sys.argv[1])
zipfile.ZipFile(next(d.glob("auto_gptq-*.whl"))).extract("auto_gptq/nn_modules/qlinear/qlinear_cuda.py", d)
tarfile.open(next(d.glob("autoawq-*.tar.gz"))).extractall(d, filter="data")
EOF
python scripts/hub_fixtures.py tests/data/hub_formats "$tools/auto_gptq/nn_modules/qlinear/qlinear_cuda.py" \
    "$(ls -d "$tools"/autoawq-*/ | head -1)"
