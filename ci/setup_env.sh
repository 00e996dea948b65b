#!/usr/bin/env bash
# Create (or reuse) the virtual environment .venv and install this checkout into it, editable,
# with the given extras: one installed copy, whose Cython extensions are built in place, so the
# `gpumem` command, `import gpumem` and the checkout agree. A failed pip install stops here.
# Usage: source ci/setup_env.sh "test,pocl,plot,cli"
# After editing a .pyx: python setup.py -q build_ext --inplace
# It prints one line per step ("[1/4] creating .venv", ...); on a terminal pip shows its own
# progress too (elsewhere, as in CI logs, pip runs with -q and the step lines are the progress).
set -euo pipefail
EXTRAS="${1:-}"
PYTHON="${PYTHON:-python3}"
VENV="${GPUMEM_VENV:-.venv}"
# GPUMEM_OFFLINE=1: a machine that reaches no package index but has everything installed (a lent
# GPU machine's image): nothing is downloaded, gpumem is installed into $PYTHON's own
# environment (GPUMEM_VENV=none) or a venv, with no dependency resolution.
OFFLINE="${GPUMEM_OFFLINE:-0}"
WITH_CUDA=0
[[ ",$EXTRAS," == *",cuda,"* && "$OFFLINE" != 1 ]] && WITH_CUDA=1
SETUP_STEPS=$((2 + WITH_CUDA + (OFFLINE == 1 ? 0 : 1)))
SETUP_STEP=0
setup_step() {  # setup_step WHAT: one line per step, so a long set-up never looks hung
    SETUP_STEP=$((SETUP_STEP + 1))
    printf '[%d/%d] %s\n' "$SETUP_STEP" "$SETUP_STEPS" "$1"
}
if [ "$VENV" = none ]; then
    setup_step "using $PYTHON's own environment (GPUMEM_VENV=none)"
    # `python` names $PYTHON from here on (a wrapper, not a link: a venv's interpreter finds its
    # environment from the path it was started by)
    shim="$(mktemp -d)"
    printf '#!/bin/sh\nexec %q "$@"\n' "$(command -v "$PYTHON")" > "$shim/python"
    chmod +x "$shim/python"
    export PATH="$shim:$PATH"
else
    if [ ! -x "$VENV/bin/python" ]; then
        setup_step "creating $VENV ($PYTHON -m venv)"
        "$PYTHON" -m venv "$VENV"
    else
        setup_step "using $VENV"
    fi
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
fi
# pip's exit status is the function's; only this machine's notes about absent local package
# folders are dropped from its stderr. Its stdout is left alone, so that on a terminal pip draws
# its progress bars; -q only where stdout is not a terminal (a log).
pip_install() {
    local opts=()
    [ -t 1 ] || opts+=(-q)
    [ "$OFFLINE" = 1 ] && opts+=(--no-index --no-deps)
    python -m pip install "${opts[@]}" "$@" \
        2> >(grep -v "^WARNING: Location '.*' is ignored" >&2 || true)
}
# the build runs in this venv (--no-build-isolation below), so its requirements come first
if [ "$OFFLINE" != 1 ]; then
    setup_step "installing the build requirements (pip, setuptools, wheel, Cython, numpy)"
    pip_install --upgrade pip "setuptools>=77" wheel "Cython>=3.0" numpy
fi
# cuda-bindings must suit the installed NVIDIA driver (13.x needs a CUDA 13 driver), and gpumem's
# CUDA fast path compiles cuda-python's .pxd files against the CUDA headers found here, which
# must be of the same release. Pin cuda-bindings to the headers' version when the driver (if
# any) can run it; else to the driver's major version (the fast path is then skipped and the
# Python-level cuda.bindings.driver is used).
CONSTRAINTS=()
if [ "$WITH_CUDA" = 1 ]; then
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
if [ "$WITH_CUDA" = 1 ]; then
    # before gpumem's build: its CUDA fast path compiles against cuda-python's .pxd files
    setup_step "installing cuda-python (its .pxd files are needed by gpumem's CUDA fast path)"
    pip_install "${CONSTRAINTS[@]}" "cuda-python>=12"
fi
# a venv made before the distribution was renamed holds a second, non-editable copy under the
# old name `gpumem`: remove it, or the `gpumem` command would import that stale copy
if python -m pip show -q gpumem >/dev/null 2>&1; then
    python -m pip uninstall -y -q gpumem
fi
setup_step "installing gpumem-pool from this checkout, editable${EXTRAS:+, with [$EXTRAS]}: \
compiles the Cython core (1-3 minutes on 2 cores)"
pip_install "${CONSTRAINTS[@]}" --no-build-isolation -e ".${EXTRAS:+[$EXTRAS]}"
printf 'set-up done: gpumem is installed in %s\n' "${VIRTUAL_ENV:-the environment of $PYTHON}"
