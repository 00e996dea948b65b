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
set -euo pipefail
cd "$(dirname "$0")/.."
source ci/setup_env.sh "test,pocl,plot,cli,cuda,numba,dask"
python -m gpumem info || true
python -m pytest -n auto tests "$@"

# Expandable segments off in the shared base test configs (tests/invariants.py): the plain
# segments every device without virtual memory uses; tests of plain-segment mechanics pin them
# off in both passes. The sim backend is the one that models virtual memory.
printf '\n=== sim with expandable segments off ===\n'
GPUMEM_TEST_SEGMENTS=plain GPUMEM_TEST_BACKENDS=sim \
    python -m pytest -n auto tests "$@"

if python -c "from gpumem.backends.cuda import BACKEND as b; import sys; \
              sys.exit(0 if 'libcuda' in b.availability()[1] else 1)"; then
    if fake_dir=$(python -c "import sys; sys.path.insert(0, 'tests'); import fake_cuda; \
                             print(fake_cuda.build('build/fake_cuda').parent)"); then
        printf '\n=== the cuda backend on the fake libcuda.so.1 (no GPU here; expandable on) ===\n'
        LD_LIBRARY_PATH="$fake_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            GPUMEM_TEST_BACKENDS=cuda python -m pytest -n auto tests "$@"
        printf '\n=== the same with expandable segments off (cuMemAlloc segments) ===\n'
        LD_LIBRARY_PATH="$fake_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
            GPUMEM_TEST_SEGMENTS=plain GPUMEM_TEST_BACKENDS=cuda \
            python -m pytest -n auto tests "$@"
    else
        echo "skipped the cuda run on the fake driver: it could not be built (see above)"
    fi
fi
