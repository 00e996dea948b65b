#!/usr/bin/env bash
# The asv benchmarks as asv's users run them: set up .venv (with asv and PoCL), register this
# machine, run the suite on the current commit in .venv (asv's "existing" environment: the
# checkout's editable install, no per-commit build) with the commit's hash, so the results
# are saved, and publish the HTML to .asv/html.
#
#   bash ci/bench.sh                      # the whole suite
#   bash ci/bench.sh --bench HitPair      # any `asv run` options (a subset, -a repeat=3, ...)
#
# Other commits: see docs/benchmarks.md ("Tracking a range of commits").
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/setup_env.sh "bench,pocl"
cd asv_benchmarks
asv machine --yes >/dev/null            # this machine's description, once (~/.asv-machine.json)
commit="$(git rev-parse HEAD)"
printf '=== asv run on %s (%s) ===\n' "$commit" "$(git log -1 --format=%s | cut -c1-60)"
asv run --environment "existing:$(command -v python)" --set-commit-hash "$commit" \
    --show-stderr "$@"
asv publish
printf '\nHTML: %s/.asv/html/index.html (serve it with: cd asv_benchmarks && asv preview)\n' \
    "$(cd .. && pwd)"
