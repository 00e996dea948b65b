#!/usr/bin/env bash
# The stress test of tests/manager/test_stress.py at scale (not part of the default test run):
# 8 threads on one manager of a host-backed simulated GPU, patterns checked before every
# free, in four configurations: driver faults with CPU fallback on and off, and near-100 %
# pressure with fallback on and off, with the default segment policy (auto: large handles while
# there is room, compaction with holes, stitching and page faults near the limits, which the
# 192 MiB runs live in); twice with one page per handle (tight); twice more with 6 MiB physical
# handles (whole-handle moves and trims) and twice with one handle per growth (fast); then the
# faults and pressure runs again with plain segments.
# Usage: bash ci/soak.sh [SECONDS]   (default: 1,000,000 operations per configuration;
#                                     with SECONDS, each configuration runs that long instead)
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/setup_env.sh "test"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the checkout's gpumem, built in place
if [ $# -ge 1 ]; then
    limit=(--ops 1000000000 --seconds "$1")
else
    limit=(--ops 1000000)
fi
status=0
run() { python tests/stress_harness.py "${limit[@]}" "$@" 2>/dev/null || status=1; }
run --capacity 1GiB --fail-rate 0.02 --cpu-fallback --seed 1
run --capacity 1GiB --fail-rate 0.02 --seed 2
run --capacity 192MiB --fail-rate 0.01 --cpu-fallback --seed 3
run --capacity 192MiB --fail-rate 0.01 --seed 4
run --capacity 1GiB --fail-rate 0.02 --cpu-fallback --seed 11 --handle-size 0
run --capacity 192MiB --fail-rate 0.01 --seed 12 --handle-size 0
run --capacity 1GiB --fail-rate 0.02 --cpu-fallback --seed 7 --handle-size 6MiB
run --capacity 192MiB --fail-rate 0.01 --seed 8 --handle-size 6MiB
run --capacity 1GiB --fail-rate 0.02 --cpu-fallback --seed 9 --handle-size growth
run --capacity 192MiB --fail-rate 0.01 --seed 10 --handle-size growth
run --capacity 1GiB --fail-rate 0.02 --cpu-fallback --seed 5 --no-expandable
run --capacity 192MiB --fail-rate 0.01 --cpu-fallback --seed 6 --no-expandable
run --capacity 1GiB --fail-rate 0.02 --cpu-fallback --seed 13 --sleep
run --capacity 192MiB --fail-rate 0.01 --cpu-fallback --seed 14 --sleep --no-expandable
exit $status
