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
# cuda-bindings must suit the installed NVIDIA driver (13.x needs a CUDA 13 driver), and gpumem's
# CUDA fast path compiles cuda-python's .pxd files against the CUDA headers found here, which
# must be of the same release. Pin cuda-bindings to the headers' version when the driver (if
# any) can run it; else to the driver's major version (the fast path is then skipped and the
# Python-level cuda.bindings.driver is used).
CONSTRAINTS=()
if [[ ",$EXTRAS," == *",cuda,"* ]]; then
    CUDA_H="${CUDA_HOME:-${CUDA_PATH:-/usr/local/cuda}}/include/cuda.h"
    hv=""
    [ -f "$CUDA_H" ] && hv=$(sed -n 's/^#define CUDA_VERSION \([0-9]*\).*/\1/p' "$CUDA_H")
    dv=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\)\.\([0-9]*\).*/\1 \2/p' \
         | head -n 1 || true)
    pin=""
    if [ -n "$hv" ]; then
        pin="cuda-bindings==$((hv / 1000)).$(((hv % 1000) / 10)).*"
    fi
    if [ -n "$dv" ]; then
        read -r dmaj dmin <<< "$dv"
        if [ -z "$hv" ] || (( hv / 1000 != dmaj || (hv % 1000) / 10 > dmin )); then
            pin="cuda-bindings>=$dmaj.0,<$((dmaj + 1))"
        fi
    fi
    if [ -n "$pin" ]; then
        echo "$pin" > "$VENV/cuda-constraint.txt"
        CONSTRAINTS=(-c "$VENV/cuda-constraint.txt")
        echo "cuda-python constrained: $pin (headers: ${hv:-none}, driver CUDA: ${dv:-none})"
    fi
fi
if [ -n "$EXTRAS" ]; then
    python -m pip install -q "${CONSTRAINTS[@]}" ".[$EXTRAS]" 2>&1 \
        | grep -v "^WARNING: Location" || true
else
    python -m pip install -q . 2>&1 | grep -v "^WARNING: Location" || true
fi
python setup.py -q build_ext --inplace >/dev/null
