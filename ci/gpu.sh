#!/usr/bin/env bash
# Run gpumem's tests and the CUDA benchmark comparison on a machine with an NVIDIA GPU.
#
#   ci/gpu.sh                    # from anywhere; works in the repository root
#
# Environment knobs:
#   PYTHON=python3.11            interpreter used to create the venv (default: python3)
#   VENV=.venv-gpu               venv directory (default: .venv-gpu in the repository root)
#   PYTEST_WORKERS=4             pytest-xdist workers (default: 4)
#   GPUMEM_TEST_BACKENDS=...     backends under test (default: sim,cpu,cuda)
#   ALLOW_NO_CUDA=1              run anyway when the CUDA backend reports itself unavailable
#   GPUMEM_FRAMEWORK_EXTRAS="numba cupy torch"   frameworks installed for gpumem.integrations
#   RMM_PACKAGE=rmm-cu12         RAPIDS RMM wheel for the seed table (rmm-cu13 on CUDA 13)
#   GPUMEM_OFFLINE=1             the machine reaches no package index (a lent, pre-provisioned
#                                GPU machine): install nothing, use what $PYTHON has
#   VENV=none                    install gpumem into $PYTHON's own environment (no new venv)
#   STEP_TIMEOUT=300             stop any one step (a pytest pass, a benchmark) after N seconds
#   QUICK=1                      the benchmarks' --quick (fewer, shorter repeats; segments_gpu.py:
#                                one run of the shipped traces only)
#   PYTEST_ARGS="..."            more pytest arguments (e.g. --timeout=120)
#
# Exit status: non-zero if the tests fail (or CUDA is unavailable without ALLOW_NO_CUDA=1).
# The benchmark comparison is informative only; its failure is reported, not fatal.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv-gpu}"
WORKERS="${PYTEST_WORKERS:-4}"
BACKENDS="${GPUMEM_TEST_BACKENDS:-sim,cpu,cuda}"
REPORT_DIR="${REPORT_DIR:-$ROOT/ci-reports}"
mkdir -p "$REPORT_DIR"

log() { printf '\n=== %s ===\n' "$*"; }
# one step, stopped after STEP_TIMEOUT seconds when that is set (exit 124 then)
step() {
    if [ -n "${STEP_TIMEOUT:-}" ]; then timeout -s INT --kill-after=20 "$STEP_TIMEOUT" "$@"; else "$@"; fi
}
QUICK_ARG=()
[ "${QUICK:-0}" = 1 ] && QUICK_ARG=(--quick)
read -r -a EXTRA_PYTEST <<< "${PYTEST_ARGS:-}"

# --- 1. GPU present? ------------------------------------------------------------------------
log "GPU"
if command -v nvidia-smi >/dev/null 2>&1; then
    GPU_MODEL="$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
                 2>/dev/null | head -n 1 || true)"
    nvidia-smi || true
else
    GPU_MODEL=""
    echo "nvidia-smi not found"
fi
GPU_MODEL="${GPU_MODEL:-unknown (nvidia-smi unavailable)}"

# --- 2. venv, install, Cython build (incl. the CUDA fast path where cuda.h is found) ---------
log "venv $VENV"
GPUMEM_VENV="$VENV" source ci/setup_env.sh "cuda,test"
python -c "import cuda.bindings, sys; print('cuda-bindings', cuda.bindings.__version__)" || true
# The frameworks gpumem plugs into (gpumem.integrations), each on its own so that one that
# cannot be installed here only skips its own tests and checks.
for extra in ${GPUMEM_FRAMEWORK_EXTRAS:-numba cupy torch}; do
    if [ "${GPUMEM_OFFLINE:-0}" = 1 ]; then
        python -c "import $extra; print('$extra', $extra.__version__, '(preinstalled)')" \
            || echo "'$extra' is not installed here (offline): its tests and checks skip"
        continue
    fi
    constraint=()
    [ -f "$VENV/cuda-constraint.txt" ] && constraint=(-c "$VENV/cuda-constraint.txt")
    if python -m pip install -q "${constraint[@]}" ".[$extra]" > "$REPORT_DIR/pip-$extra.log" 2>&1; then
        echo "installed the '$extra' extra"
    else
        echo "could not install the '$extra' extra (see $REPORT_DIR/pip-$extra.log): skipped"
    fi
done

# RAPIDS RMM, a peer of the seed table (asv_benchmarks/seed_table.py); best effort as above
if [ "${GPUMEM_OFFLINE:-0}" = 1 ]; then
    python -c "import rmm; print('rmm', rmm.__version__, '(preinstalled)')" \
        || echo "rmm is not installed here (offline): its seed-table rows are skipped"
elif python -m pip install -q "${RMM_PACKAGE:-rmm-cu12}" > "$REPORT_DIR/pip-rmm.log" 2>&1; then
    echo "installed ${RMM_PACKAGE:-rmm-cu12}"
else
    echo "could not install ${RMM_PACKAGE:-rmm-cu12} (see $REPORT_DIR/pip-rmm.log): its seed-table rows are skipped"
fi

# --- 3. CUDA backend available? ---------------------------------------------------------------
log "CUDA backend"
set +e
python - <<'EOF'
import sys
from gpumem.backends.cuda import BACKEND
ok, reason = BACKEND.availability()
if not ok:
    print(f"CUDA backend unavailable: {reason}")
    sys.exit(3)
for i in range(BACKEND.device_count()):
    dev = BACKEND.open(i)
    p = dev.properties()
    free, total = dev.mem_get_info()
    print(f"cuda:{i}  {p.name}  cc {p.extra.get('compute_capability')}  "
          f"driver {p.extra.get('driver_version')}  "
          f"free {free / 2**30:.2f} GiB of {total / 2**30:.2f} GiB")
    dev.close()
print("calls through gpumem's Cython module (cydriver, no GIL):", BACKEND.native)
EOF
cuda_rc=$?
set -e
if [[ $cuda_rc -ne 0 && "${ALLOW_NO_CUDA:-0}" != "1" ]]; then
    echo "Refusing to run GPU CI without a working CUDA backend (set ALLOW_NO_CUDA=1 to override)."
    exit 1
fi

# --- 4. tests ---------------------------------------------------------------------------------
log "pytest (GPUMEM_TEST_BACKENDS=$BACKENDS, $WORKERS workers)"
JUNIT="$REPORT_DIR/pytest-gpu.xml"
test_rc=0
# expandable segments are on by default where the device has virtual memory (cuMem* on cuda)
GPUMEM_TEST_BACKENDS="$BACKENDS" step python -m pytest -n "$WORKERS" tests \
    --junitxml="$JUNIT" "${EXTRA_PYTEST[@]}" || test_rc=$?

log "pytest on cuda again with expandable segments off (cuMemAlloc segments)"
GPUMEM_TEST_EXPANDABLE_SEGMENTS=0 GPUMEM_EXPANDABLE_SEGMENTS=0 GPUMEM_TEST_BACKENDS=cuda \
    step python -m pytest -n "$WORKERS" tests --junitxml="$REPORT_DIR/pytest-gpu-plain.xml" \
    "${EXTRA_PYTEST[@]}" || test_rc=$?

log "the shared traces replayed on the GPU, expandable segments on and off (ratio, events/s)"
for trace in gpumem/data/traces/*.csv.gz; do
    step python -m gpumem replay "$trace" --device cuda:0 --no-progress || true
    step python -m gpumem replay "$trace" --device cuda:0 --no-progress \
        --no-expandable-segments || true
done

# --- 5. benchmark comparison ------------------------------------------------------------------
log "benchmark comparison (cuda)"
bench_status="skipped"
if [[ -f asv_benchmarks/compare.py ]]; then
    if step python asv_benchmarks/compare.py --backend cuda "${QUICK_ARG[@]}" \
            --json "$REPORT_DIR/compare-cuda.json"; then
        bench_status="ok"
    else
        bench_status="failed (exit $?)"
    fi
else
    echo "asv_benchmarks/compare.py not found; skipping the comparison"
    bench_status="missing compare.py"
fi

log "the seed table: five scenarios vs torch, CuPy, RMM and cuMemAlloc per allocation"
seed_status="ok"
step python asv_benchmarks/compare.py --backend cuda --seed-table "${QUICK_ARG[@]}" \
    --json "$REPORT_DIR/seed-table-cuda.json" || seed_status="failed (exit $?)"

log "CUDA call cost: gpumem's Cython module vs cuda.bindings.driver"
step python asv_benchmarks/cuda_calls.py || echo "cuda_calls.py failed (exit $?)"

log "driver call costs against the sim's model; traces replayed on the card and priced on sim"
step python asv_benchmarks/driver_costs_gpu.py --json "$REPORT_DIR/driver-costs.json" \
    || echo "driver_costs_gpu.py failed (exit $?)"

log "segment settings (auto, tight, fast, plain) against PyTorch's allocator, trace by trace"
# exit 2: no torch (or no usable CUDA) here, reported as skipped; QUICK: one run, shipped traces
segments_status="ok"
SEGMENTS_ARGS=(--repeat 3)
[ "${QUICK:-0}" = 1 ] && SEGMENTS_ARGS=(--repeat 1 --no-synthetic)
step python asv_benchmarks/segments_gpu.py --device cuda:0 "${SEGMENTS_ARGS[@]}" \
    --out "$REPORT_DIR/segments-gpu.json" || {
    rc=$?; [ "$rc" = 2 ] && segments_status="skipped (no torch or CUDA)" \
        || segments_status="failed (exit $rc)"; }

log "CuPy, Numba, PyTorch through gpumem: real work, hit latency against their own pools"
frameworks_status="ok"
step python asv_benchmarks/frameworks_gpu.py || frameworks_status="failed (exit $?)"

# --- 6. summary -------------------------------------------------------------------------------
log "summary"
python - "$JUNIT" "$GPU_MODEL" "$BACKENDS" "$bench_status" "$test_rc" "$frameworks_status" \
    "$seed_status" "$segments_status" <<'EOF'
import sys
import xml.etree.ElementTree as ET

junit, gpu, backends, bench, rc, frameworks, seed, segments = sys.argv[1:]
counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
try:
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    for s in suites:
        for k in counts:
            counts[k] += int(s.get(k, 0))
except (OSError, ET.ParseError) as exc:
    print(f"(no junit report: {exc})")
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
rows = [
    ("GPU", gpu),
    ("backends", backends),
    ("passed", passed),
    ("failed", counts["failures"]),
    ("errors", counts["errors"]),
    ("skipped", counts["skipped"]),
    ("pytest exit", rc),
    ("benchmark compare", bench),
    ("seed table", seed),
    ("frameworks", frameworks),
    ("segments vs torch", segments),
]
width = max(len(k) for k, _ in rows)
print("+" + "-" * (width + 2) + "+" + "-" * 62 + "+")
for k, v in rows:
    print(f"| {k:<{width}} | {str(v)[:60]:<60} |")
print("+" + "-" * (width + 2) + "+" + "-" * 62 + "+")
EOF

exit "$test_rc"
