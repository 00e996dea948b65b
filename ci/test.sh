#!/usr/bin/env bash
# The test command: sets everything up on a fresh machine, then runs the suite with xdist.
# Backends under test: GPUMEM_TEST_BACKENDS (default: sim plus every available one; CI: sim,cpu,opencl).
#
# Where no NVIDIA driver is present but gcc and the CUDA headers are, a second run puts the
# cuda backend through the whole suite against tests/fake_cuda: a C test double of libcuda.so.1
# under the real cuda-python and gpumem's Cython fast path. It proves the code paths and the
# bindings' calling conventions, not a GPU; GPU results are in docs/hardware.md.
# Expandable segments are on by default where the device has virtual memory (sim, cuda); sim
# and the fake driver run once more with them off (about a minute each).
#
# Every pass runs even when an earlier one fails (ci/passes.sh); the script ends with one line
# per pass and exits non-zero naming each failed pass. Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/setup_env.sh "test,pocl,plot,cli,cuda,numba,dask,docs"
source ci/passes.sh
python -m gpumem info || true

run_pass "the suite (backends: ${GPUMEM_TEST_BACKENDS:-sim and every available one})" \
    python -m pytest -n auto tests "$@"

# Expandable segments off in the shared base test configs (tests/invariants.py): the plain
# segments every device without virtual memory uses; tests of plain-segment mechanics pin them
# off in both passes. The sim backend is the one that models virtual memory.
run_pass "sim with expandable segments off" \
    env GPUMEM_TEST_SEGMENTS=plain GPUMEM_TEST_BACKENDS=sim python -m pytest -n auto tests "$@"

FAKE_PASS="the cuda backend on the fake libcuda.so.1 (no GPU here; expandable on)"
FAKE_PLAIN_PASS="the cuda backend on the fake libcuda.so.1, expandable segments off (cuMemAlloc segments)"
if python -c "from gpumem.backends.cuda import BACKEND as b; import sys; \
              sys.exit(0 if 'libcuda' in b.availability()[1] else 1)"; then
    if fake_dir=$(python -c "import sys; sys.path.insert(0, 'tests'); import fake_cuda; \
                             print(fake_cuda.build('build/fake_cuda').parent.resolve())"); then
        # absolute: tests start interpreters in other folders (the doc examples, pasted alone)
        fake_path="$fake_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        run_pass "$FAKE_PASS" env LD_LIBRARY_PATH="$fake_path" GPUMEM_TEST_BACKENDS=cuda \
            python -m pytest -n auto tests "$@"
        run_pass "$FAKE_PLAIN_PASS" env LD_LIBRARY_PATH="$fake_path" GPUMEM_TEST_SEGMENTS=plain \
            GPUMEM_TEST_BACKENDS=cuda python -m pytest -n auto tests "$@"
    else
        why="the fake libcuda.so.1 could not be built (gcc or the CUDA headers; see above)"
        skip_pass "$FAKE_PASS" "$why"
        skip_pass "$FAKE_PLAIN_PASS" "$why"
    fi
else
    why="a CUDA driver is here, or cuda-python is not installed"
    skip_pass "$FAKE_PASS" "$why"
    skip_pass "$FAKE_PLAIN_PASS" "$why"
fi

passes_report "passes"
