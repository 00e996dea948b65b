#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv, install gpumem with the given extras and
# build the Cython extensions in place, so both the installed package and the checkout import.
# Usage: source ci/setup_env.sh "test,pocl,plot,cli"
set -euo pipefail
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
VENV="${GPUMEM_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip setuptools wheel "Cython>=3.0" numpy 2>&1 | grep -v "^WARNING: Location" || true
# gpumem's CUDA fast path compiles cuda-python's .pxd files against the CUDA headers found
# here, so both must come from one CUDA release: pin cuda-bindings to the headers' version.
CONSTRAINTS=()
CUDA_H="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}/include/cuda.h"
if [[ ",$EXTRAS," == *",cuda,"* && -f "$CUDA_H" ]]; then
    v=$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$CUDA_H")
    if [ -n "$v" ]; then
        echo "cuda-bindings==$((v / 1000)).$(((v % 1000) / 10)).*" > "$VENV/cuda-constraint.txt"
        CONSTRAINTS=(-c "$VENV/cuda-constraint.txt")
    fi
fi
if [ -n "$EXTRAS" ]; then
    python -m pip install -q "${CONSTRAINTS[@]}" ".[$EXTRAS]" 2>&1 \
        | grep -v "^WARNING: Location" || true
else
    python -m pip install -q . 2>&1 | grep -v "^WARNING: Location" || true
fi
python setup.py -q build_ext --inplace >/dev/null
