#!/usr/bin/env bash
# The test command: sets everything up on a fresh machine, then runs the suite with xdist.
# Backends under test: GPUMEM_TEST_BACKENDS (default: sim plus every available one; CI: sim,cpu,opencl).
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/setup_env.sh "test,pocl,plot,cli"
python -m gpumem info || true
python -m pytest -n auto tests "$@"
