#!/usr/bin/env bash
# The main job: set up, then replay a real PyTorch allocation trace on a simulated device and
# print what the allocator did (segments, hits, misses, peak, fragmentation).
set -euo pipefail
cd "$(dirname "$0")/.."
echo "ci/demo.sh: setting up .venv (a few minutes the first time, one line per step), then the demo"
source ci/setup_env.sh "plot,cli"
python -m gpumem demo "$@"
