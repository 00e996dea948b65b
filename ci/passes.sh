# Named passes that all run, then one report (sourced by ci/test.sh and .ci/run).
# A failing pass does not stop the next one (under `set -e` the first failure used to end the
# script and skip the other passes without a word); the report names each failed pass.
#
#   run_pass "sim, expandable segments off" env GPUMEM_TEST_SEGMENTS=plain python -m pytest ...
#   skip_pass "cuda on the fake driver" "it could not be built"
#   passes_report || exit 1      # one line per pass; the last: "passes: N passed, M failed"
PASSES_LINES=()
PASSES_FAILED=()
PASSES_OK=0

run_pass() {    # run_pass NAME COMMAND...: run it to the end and record how it ended
    local name=$1 rc=0 start=$SECONDS
    shift
    printf '\n=== %s ===\n' "$name"
    "$@" || rc=$?
    local took=$((SECONDS - start))
    if [ "$rc" -eq 0 ]; then
        PASSES_OK=$((PASSES_OK + 1))
        PASSES_LINES+=("ok       $name (${took} s)")
    else
        PASSES_FAILED+=("$name")
        PASSES_LINES+=("FAILED   $name (exit $rc, ${took} s)")
    fi
    return 0
}

skip_pass() {   # skip_pass NAME WHY: a pass that could not run here, and why (not a failure)
    printf '\n=== %s: skipped, %s ===\n' "$1" "$2"
    PASSES_LINES+=("skipped  $1 ($2)")
}

passes_report() {   # print one line per pass; return 1 when any failed, naming each
    local label=${1:-passes} name
    printf '\n=== %s: summary ===\n' "$label"
    printf '%s\n' "${PASSES_LINES[@]}"
    if [ "${#PASSES_FAILED[@]}" -gt 0 ]; then
        for name in "${PASSES_FAILED[@]}"; do
            printf 'failed pass: %s\n' "$name"
        done
    fi
    printf '%s: %d passed, %d failed\n' "$label" "$PASSES_OK" "${#PASSES_FAILED[@]}"
    [ "${#PASSES_FAILED[@]}" -eq 0 ]
}
