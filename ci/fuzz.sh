#!/usr/bin/env bash
# Coverage-guided fuzzing (atheris, libFuzzer) of what gpumem parses from its users (issue 24;
# too long for .ci/run: see docs/testing.md): trace files and their JSON sidecars, PyTorch
# memory snapshots, byte sizes, device strings, GPUMEM_* variables, view/DLPack arguments.
# The harnesses are tests/fuzz/<name>.py (what each allows and asserts is in its docstring).
#
# Each harness runs SECONDS (default 80: ~10 minutes for the seven) from its seed corpus (the
# shipped traces; $GPUMEM_TRACES adds more) plus what earlier runs found (build/fuzz/corpus).
# An input taking over 10 s is a hang, one growing the process past 2 GiB a memory finding:
# libFuzzer reports both as crashes. A crashing input is kept in tests/fuzz/crashes/<name>/,
# where tests/test_fuzz_regressions.py replays it in every test run (commit it with the fix);
# the harness then goes on for the rest of its time. Ends with one line
#     fuzz: N executions in S s, C crashes
# and exits non-zero when C > 0.   Usage: bash ci/fuzz.sh [SECONDS] [harness ...]
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/setup_env.sh "test"
python -m pip install -q "atheris>=2.3"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"   # the checkout's gpumem, built in place
SECONDS_EACH=${1:-80}
shift || true
HARNESSES=("$@")
[ ${#HARNESSES[@]} -gt 0 ] || HARNESSES=(trace_csv trace_sidecar torch_snapshot sizes devices
                                        env_config views)
OUT=build/fuzz
mkdir -p "$OUT"
total_runs=0
total_crashes=0
started=$(date +%s)
for name in "${HARNESSES[@]}"; do
    corpus=$OUT/corpus/$name
    crashes=tests/fuzz/crashes/$name
    mkdir -p "$corpus" "$crashes"
    python tests/fuzz/run.py "$name" --seeds "$corpus"
    before=$(find "$crashes" -type f | wc -l)
    end=$(( $(date +%s) + SECONDS_EACH ))
    runs=0
    attempts=0
    # libFuzzer stops at a crash: start again for the time left (at most 5 times)
    while left=$(( end - $(date +%s) )); [ "$left" -gt 0 ] && [ "$attempts" -lt 5 ]; do
        attempts=$((attempts + 1))
        log=$OUT/$name.$attempts.log
        python tests/fuzz/run.py "$name" -max_total_time="$left" -timeout=10 \
            -rss_limit_mb=2048 -artifact_prefix="$crashes/" -print_final_stats=1 \
            "$corpus" >"$log" 2>&1 || true
        # executions: the final statistics, or after a crash the last status line ("#N ...")
        n=$(sed -n 's/^stat::number_of_executed_units: *\([0-9]*\).*/\1/p' "$log" | tail -1)
        [ -n "$n" ] || n=$(grep -o -E '^#[0-9]+' "$log" | tail -1 | tr -d '#')
        runs=$((runs + ${n:-0}))
        if grep -q -E "^(==[0-9]+== ERROR: libFuzzer|SUMMARY: libFuzzer)" "$log"; then
            echo "--- $name: a crash ---"
            grep -E -A12 "Uncaught Python exception|ERROR: libFuzzer" "$log" | head -40
        elif [ -z "$n" ]; then
            echo "--- $name: the fuzzer did not run ---"
            tail -20 "$log"
            total_crashes=$((total_crashes + 1))
            break
        fi
    done
    found=$(( $(find "$crashes" -type f | wc -l) - before ))
    total_runs=$((total_runs + runs))
    total_crashes=$((total_crashes + found))
    printf '%-15s %10d executions  %d crash(es)\n' "$name" "$runs" "$found"
done
echo "fuzz: $total_runs executions in $(( $(date +%s) - started )) s, $total_crashes crashes"
[ "$total_crashes" -eq 0 ]
