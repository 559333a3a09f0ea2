#!/usr/bin/env bash
# The test suite on CPU: installs qtk[dev], builds the llm-compressor fixtures in their own
# environment (llmcompressor pins an older transformers), then runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev
if [ -f scripts/peer_env.sh ]; then
    bash scripts/peer_env.sh fixtures
    export QTK_REQUIRE_PEER=1  # the fixtures are built: the peer tests must run, not skip
fi
exec python3 -m pytest -q --durations=20 "$@"  # the slowest tests named in every CI log
