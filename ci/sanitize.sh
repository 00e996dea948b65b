#!/usr/bin/env bash
# gpumem's C code under the sanitizers (issue 24; too long for .ci/run: see docs/testing.md).
#
#  1. ASan + UBSan: the Cython extensions, the torch allocator library and the fake libcuda
#     (tests/fake_cuda) built with -fsanitize=address,undefined in a copy of the checkout
#     (build/sanitize/asan: the checkout's own in-place build is left alone); the whole suite
#     runs there on the simulated device, then on the fake driver (the cuda backend through
#     the real cuda-python), with the runtimes preloaded into the uninstrumented CPython.
#  2. TSan: the same extensions built with -fsanitize=thread (build/sanitize/tsan); the test
#     modules that start threads (found with grep, so new ones join) run under it, among them
#     tests/test_nogil_stress.py: C threads (pthreads, no Python) on the pool's nogil API while
#     Python calls every cold path of the same pool.
#
# Every sanitizer report goes to build/sanitize/reports/ (one file per process, children and
# compilers included); the script ends with
#     sanitizers: N tests under ASan+UBSan, M under TSan, R reports
# (N, M: tests that ran, skips not counted; R: sanitizer reports in all processes) and exits
# non-zero when a test failed or R > 0. Usage: bash ci/sanitize.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# the venv of ci/setup_env.sh, set up (which also builds the checkout in place, unused here)
# only when it lacks what this script needs
VENV="${GPUMEM_VENV:-.venv}"
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c \
        "import pytest, xdist, hypothesis, Cython, setuptools, numpy, cuda.bindings" 2>/dev/null; then
    . "$VENV/bin/activate"
else
    source ci/setup_env.sh "test,cuda"
fi
ROOT=$PWD
OUT=$ROOT/build/sanitize
REPORTS=$OUT/reports
started=$(date +%s)
rm -rf "$REPORTS"
mkdir -p "$REPORTS"

# --- the sanitizer runtimes (Debian: gcc's libasan/libubsan/libtsan packages) -----------------
runtime() { gcc -print-file-name="$1"; }
if [ ! -e "$(runtime libasan.so)" ] || [ ! -e "$(runtime libubsan.so)" ] \
        || [ ! -e "$(runtime libtsan.so)" ]; then
    v=$(gcc -dumpversion | cut -d. -f1)
    apt-get update -q >/dev/null
    apt-get install -y -q "libasan$((v < 12 ? 6 : 8))" libubsan1 "libtsan$((v < 12 ? 0 : 2))" \
        "libgcc-$v-dev" >/dev/null
fi
LIBASAN=$(readlink -f "$(runtime libasan.so)")
LIBUBSAN=$(readlink -f "$(runtime libubsan.so)")
LIBTSAN=$(readlink -f "$(runtime libtsan.so)")

# --- a copy of the checkout (tracked and untracked, not ignored: no .so, no build/) ----------
stage() {       # stage DEST: the checkout's files, without compiled modules
    rm -rf "$1"
    mkdir -p "$1"
    git ls-files -z --cached --others --exclude-standard \
        | tar --null -T - --ignore-failed-read -cf - 2>/dev/null | tar -xf - -C "$1"
}
# compiler flags: the interpreter's own (setuptools replaces them by CFLAGS/CXXFLAGS when those
# are set) plus the sanitizer's; what tests compile at run time gets them too
PY_CFLAGS=$(python -c "import sysconfig; print(sysconfig.get_config_var('CFLAGS') or '')")
build() {       # build TREE SANITIZER_FLAGS: the extensions in place in TREE
    (cd "$1" && env "CFLAGS=$PY_CFLAGS $2" "CXXFLAGS=$PY_CFLAGS $2" "LDFLAGS=$2" \
        python setup.py -q build_ext --inplace -j 2 >"$OUT/build-$(basename "$1").log" 2>&1) \
        || { tail -30 "$OUT/build-$(basename "$1").log"; exit 1; }
}
# the extension a test imports must be the sanitized one
assert_built() {   # assert_built TREE ENV...: import the pool with that environment
    local tree=$1
    shift
    (cd "$tree" && "$@" python - "$tree" <<'EOF'
import sys
import gpumem._core.pool as pool
assert pool.__file__.startswith(sys.argv[1]), f"{pool.__file__} is not under {sys.argv[1]}"
EOF
    )
}
# every compiled module of TREE calls into the sanitizer's runtime (it was really instrumented)
instrumented() {   # instrumented TREE SYMBOL...
    local tree=$1 so sym syms
    shift
    for so in "$tree"/gpumem/*/*.so; do
        syms=$(nm -D --undefined-only "$so")
        for sym in "$@"; do
            [[ $syms == *"$sym"* ]] || { echo "$so: no $sym: not instrumented"; exit 1; }
        done
    done
}
elapsed() { printf '(%d s so far)\n' "$(( $(date +%s) - started ))"; }
# tests that ran (not skipped) in a pytest junit file
ran() { python - "$1" <<'EOF'
import sys
import xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError):
    print(0)
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
print(sum(int(s.get("tests", 0)) - int(s.get("skipped", 0)) for s in suites))
EOF
}
status=0

# ============================================================================================
# 1. ASan + UBSan
# -fno-omit-frame-pointer and -g: whole stacks with file:line in reports. setup.py's -O3 comes
# later on the command line and wins; the sanitizers work at any level.
ASAN_FLAGS="-fsanitize=address,undefined -fno-omit-frame-pointer -g"
A=$OUT/asan
printf '=== building with %s (%s) ===\n' "$ASAN_FLAGS" "$A"
stage "$A"
build "$A" "$ASAN_FLAGS"
instrumented "$A" __asan_report_ __ubsan_handle_
elapsed
FAKE_A=$(cd "$A" && env "CFLAGS=$PY_CFLAGS $ASAN_FLAGS" "LDFLAGS=$ASAN_FLAGS" python -c \
    "import sys; sys.path.insert(0, 'tests'); import fake_cuda; \
     print(fake_cuda.build('$OUT/fake-asan').parent)") || FAKE_A=""

# ASan's options (ASAN_OPTIONS), each for a reason:
#  detect_leaks=0        CPython frees nothing at exit on purpose (interned strings, modules,
#                        numpy's caches): LeakSanitizer would list thousands of its blocks, and
#                        a suppression naming libpython matches every stack through the
#                        interpreter, ours included. Host leaks of the pool are tested without a
#                        sanitizer (tests/test_nogil_stress.py: mallinfo2 around pool churn),
#                        driver leaks by the fake's and the simulator's live counters.
#  allocator_may_return_null=1
#                        malloc returning NULL is C's answer to "too much" and the pool handles
#                        it (tests ask for 1 TiB on purpose); ASan would otherwise stop there.
#  halt_on_error=1       the first report ends the process (its pytest worker: the test fails).
# PYTHONMALLOC=malloc: CPython's small-object allocator hands out memory ASan cannot see; with
# plain malloc a Python object freed too early by Cython code is a use-after-free report.
# GPUMEM_TEST_SANITIZED=1: tests with timing bounds (tests/test_history_clock.py) widen them.
# CFLAGS/LDFLAGS: what tests compile at run time (the fake libcuda, the downstream Cython
# module of test_cython_api.py and test_nogil_stress.py) is sanitized too.
asan_env=(env "LD_PRELOAD=$LIBASAN $LIBUBSAN" PYTHONMALLOC=malloc GPUMEM_TEST_SANITIZED=1
          "ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:halt_on_error=1:log_path=$REPORTS/asan"
          "UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1:log_path=$REPORTS/ubsan"
          "CFLAGS=$PY_CFLAGS $ASAN_FLAGS" "CXXFLAGS=$PY_CFLAGS $ASAN_FLAGS"
          "LDFLAGS=$ASAN_FLAGS" "PYTHONPATH=$A")
pytest_args=(-q -p no:cacheprovider -n auto)
assert_built "$A" "${asan_env[@]}"

printf '\n=== ASan+UBSan: the suite on sim ===\n'
(cd "$A" && "${asan_env[@]}" GPUMEM_TEST_BACKENDS=sim python -m pytest "${pytest_args[@]}" \
    --junitxml="$REPORTS/asan-sim.xml" tests "$@") || status=1
elapsed
if [ -n "$FAKE_A" ]; then
    printf '\n=== ASan+UBSan: the suite on the fake libcuda (cuda backend, no GPU) ===\n'
    (cd "$A" && "${asan_env[@]}" "LD_LIBRARY_PATH=$FAKE_A${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        GPUMEM_TEST_BACKENDS=cuda python -m pytest "${pytest_args[@]}" \
        --junitxml="$REPORTS/asan-cuda.xml" tests "$@") || status=1
    elapsed
else
    echo "the fake libcuda could not be built (gcc or the CUDA headers missing): no cuda pass"
    status=1
fi

# ============================================================================================
# 2. TSan
# CPython is not instrumented, but its GIL is a pthread mutex and condition variable, which
# TSan intercepts: two accesses ordered by the GIL are ordered for TSan too (no report). What
# TSan checks is gpumem's own C: the pool's spin locks and atomics, the front caches, the
# history clock's ticker thread, the torch table, against the nogil callers.
# die_after_fork=0: tests fork while threads run (the fork-safety tests) and the child starts
# a thread again (the history ticker); TSan's default kills such a child.
TSAN_FLAGS="-fsanitize=thread -fno-omit-frame-pointer -g"
T=$OUT/tsan
printf '\n=== building with %s (%s) ===\n' "$TSAN_FLAGS" "$T"
stage "$T"
# the C++ that Cython generated for the ASan build (newer than its .pyx: not generated again)
(cd "$A" && find gpumem \( -name "*.cpp" -o -name "*.h" \) | tar -cf - -T -) \
    | tar -xf - -C "$T"
build "$T" "$TSAN_FLAGS"
instrumented "$T" __tsan_read __tsan_write
elapsed
tsan_env=(env "LD_PRELOAD=$LIBTSAN" GPUMEM_TEST_SANITIZED=1
          "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:die_after_fork=0:log_path=$REPORTS/tsan"
          "CFLAGS=$PY_CFLAGS $TSAN_FLAGS" "CXXFLAGS=$PY_CFLAGS $TSAN_FLAGS"
          "LDFLAGS=$TSAN_FLAGS" "PYTHONPATH=$T")
assert_built "$T" "${tsan_env[@]}"
mapfile -t threaded < <(cd "$T" && grep -rl --include="test_*.py" \
                           -E "threading|ThreadPoolExecutor|pthread|stress_harness" tests | sort)
printf '\n=== TSan: %d test modules that start threads, on sim ===\n%s\n' "${#threaded[@]}" \
    "${threaded[*]}"
(cd "$T" && "${tsan_env[@]}" GPUMEM_TEST_BACKENDS=sim python -m pytest "${pytest_args[@]}" \
    --junitxml="$REPORTS/tsan-sim.xml" "${threaded[@]}" "$@") || status=1

# ============================================================================================
n_asan=$(( $(ran "$REPORTS/asan-sim.xml") + $(ran "$REPORTS/asan-cuda.xml") ))
n_tsan=$(ran "$REPORTS/tsan-sim.xml")
# a report: ASan's "ERROR: AddressSanitizer", UBSan's "runtime error:", TSan's "WARNING:
# ThreadSanitizer:"; a log file holding none of them still counts as one (it is unexplained
# sanitizer output)
reports=0
shopt -s nullglob
for f in "$REPORTS"/asan.* "$REPORTS"/ubsan.* "$REPORTS"/tsan.*; do
    k=$(grep -c -E "ERROR: AddressSanitizer|ERROR: LeakSanitizer|runtime error:|WARNING: ThreadSanitizer:" "$f" || true)
    reports=$((reports + (k > 0 ? k : 1)))
    printf '\n--- %s ---\n' "$f"
    head -60 "$f"
done
[ "$reports" -eq 0 ] || status=1
printf '\n(%d s; reports and junit files in %s)\n' "$(( $(date +%s) - started ))" "$REPORTS"
echo "sanitizers: $n_asan tests under ASan+UBSan, $n_tsan under TSan, $reports reports"
exit $status
