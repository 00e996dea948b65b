#!/usr/bin/env bash
# A C or C++ compiler (and linker) for setuptools that builds for an older glibc than this
# machine's: zig's clang (the `ziglang` package from PyPI) with `-target x86_64-linux-gnu.2.28`
# links against glibc 2.28's symbol versions, so the objects run on any glibc >= 2.28 (RHEL 8
# and newer), without a manylinux container. C++ gets zig's libc++ linked in statically (its
# symbols hidden but operator new/delete), so the wheel needs no libstdc++ of the user's.
#
#   ZIG=/path/to/zig bash ci/zig_cc.sh cc|c++ ARGS...     (ci/package.sh sets CC, CXX and
#                                                          LDSHARED to wrappers that call this)
# Environment: ZIG, the zig binary (required).
#
# setuptools passes the interpreter's own build flags (sysconfig CFLAGS, LDSHARED) and the
# user's CFLAGS/LDFLAGS. The few GCC spellings that zig 0.17's clang driver stops on (each
# tried) are mapped or dropped here; everything else goes through unchanged.
set -euo pipefail
mode="${1:?usage: zig_cc.sh cc|c++ ARGS...}"; shift
case "$mode" in
    cc|c++) ;;
    *) echo "zig_cc.sh: the first argument must be cc or c++, not '$mode'" >&2; exit 2 ;;
esac
: "${ZIG:?zig_cc.sh: set ZIG to the zig binary (pip install ziglang)}"
args=()
for arg in "$@"; do
    case "$arg" in
        # GCC's parallel LTO ("invalid -flto mode"): the same optimisation is plain -flto
        -flto=auto|-flto=jobserver|-flto=[0-9]*) args+=(-flto) ;;
        # Debian's and Ubuntu's Python LDFLAGS: "unsupported linker arg"; an optimisation only
        -Wl,-Bsymbolic-functions) ;;
        # tuning only; zig takes a tuning name as the CPU, and "generic" lacks SSE
        -mtune=*) ;;
        # GCC names CPUs x86-64, x86-64-v2; zig x86_64, x86_64_v2
        -march=*) cpu="${arg#-march=}"; args+=("-march=${cpu//-/_}") ;;
        # a -target is ours to set
        -target|--target=*) echo "zig_cc.sh: a -target argument is not allowed here" >&2; exit 2 ;;
        *) args+=("$arg") ;;
    esac
done
# glibc 2.28: RHEL 8, the oldest system the wheels are for (docs/install.md)
exec "$ZIG" "$mode" -target x86_64-linux-gnu.2.28 "${args[@]}"
