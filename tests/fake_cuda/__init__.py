"""A fake NVIDIA driver library (``libcuda.so.1``) for running cuda-python without a GPU.

``build(dest_dir)`` compiles ``fake_libcuda.c`` into ``dest_dir/libcuda.so.1``; ``env(dest_dir)``
is the environment for a subprocess that should load it instead of a real driver::

    lib = build(tmp_path)
    subprocess.run([sys.executable, "-c", "..."], env=env(lib.parent), check=True)

How cuda-python finds it: cuda-bindings 13.0.x ``dlopen("libcuda.so.1")``; 13.5.x asks
``cuda.pathfinder``, which for driver libraries only tries an already loaded ``libcuda.so.1``
and then a plain ``dlopen("libcuda.so.1")``. Both therefore honour ``LD_LIBRARY_PATH``, which
the dynamic loader reads once at process start: that is why this is an environment for a new
process. (Within a running process, ``ctypes.CDLL(path, mode=os.RTLD_GLOBAL)`` before the first
driver call works too: a later ``dlopen("libcuda.so.1")`` finds the loaded library by its
soname.) 13.5.x also requires ``cuGetProcAddress_v2``, which the fake implements.

The fake's own knobs (FAKE_CUDA_DEVICE_COUNT, FAKE_CUDA_TOTAL_MEM, FAKE_CUDA_NO_DEVICE, ...)
are described at the top of fake_libcuda.c and can be passed through ``env(..., **extra)``.
"""
from __future__ import annotations

import ctypes
import os
import shlex
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

__all__ = ["SOURCE", "SONAME", "FakeCudaBuildError", "cuda_include_dir", "build", "env",
           "helpers"]

SOURCE = Path(__file__).with_name("fake_libcuda.c")
SONAME = "libcuda.so.1"


class FakeCudaBuildError(RuntimeError):
    """gcc or the CUDA headers are missing, or the compilation failed."""


def cuda_include_dir() -> Path:
    """``$CUDA_HOME/include``, else ``$CUDA_PATH/include``, else ``/usr/local/cuda/include``
    (the variables the CUDA toolkit installers and cuda.pathfinder use)."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        root = os.environ.get(var)
        if root:
            return Path(root) / "include"
    return Path("/usr/local/cuda/include")


def build(dest_dir: str | os.PathLike[str], *, get_proc_address: bool = True) -> Path:
    """Compile the fake into ``dest_dir/libcuda.so.1`` and return that path.

    ``get_proc_address=False`` leaves out ``cuGetProcAddress_v2`` so that cuda-bindings 13.0.x
    takes its dlsym() fallback (13.5.x cannot load such a library).
    """
    gcc = shutil.which("gcc")
    if gcc is None:
        raise FakeCudaBuildError("gcc is not on PATH; it is needed to build the fake libcuda")
    include = cuda_include_dir()
    for header in ("cuda.h", "cudaTypedefs.h"):   # the real headers give the exact ABI
        if not (include / header).is_file():
            raise FakeCudaBuildError(
                f"{include / header} not found; install the CUDA toolkit headers or set "
                f"CUDA_HOME to the toolkit root")
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / SONAME
    # Compile to a private name and rename: parallel test workers may build into one folder,
    # and a process that already mapped the old file keeps its copy.
    tmp = dest / f".{SONAME}.{os.getpid()}.tmp"
    cmd = [gcc, "-std=gnu11", "-O2", "-g", "-Wall", "-Wextra", "-Werror", "-fPIC", "-shared",
           "-pthread", f"-I{include}", f"-Wl,-soname,{SONAME}", "-Wl,-z,defs",
           "-o", str(tmp), str(SOURCE)]
    if not get_proc_address:
        cmd.insert(1, "-DFAKE_CUDA_NO_GET_PROC_ADDRESS")
    # the build tools' usual variables, after the fixed flags so they can add to them
    # (ci/sanitize.sh builds the fake with -fsanitize=... this way)
    cmd[-3:-3] = shlex.split(os.environ.get("CFLAGS", "")) + \
        shlex.split(os.environ.get("LDFLAGS", ""))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise FakeCudaBuildError(f"building the fake libcuda failed:\n{' '.join(cmd)}\n"
                                 f"{proc.stderr}")
    os.replace(tmp, out)
    return out


def env(lib_dir: str | os.PathLike[str], base: Mapping[str, str] | None = None,
        **extra: str) -> dict[str, str]:
    """Environment (``base``, default os.environ, plus ``extra``) for a subprocess that loads
    the fake from ``lib_dir`` ahead of any real driver."""
    result = dict(os.environ if base is None else base)
    old = result.get("LD_LIBRARY_PATH")
    result["LD_LIBRARY_PATH"] = str(Path(lib_dir).resolve()) + (f":{old}" if old else "")
    result.update(extra)
    return result


def helpers(name_or_path: str = SONAME) -> ctypes.CDLL:
    """The fake's test helpers through ctypes, from the library this process has loaded
    (``"libcuda.so.1"`` resolves to it by soname once cuda-python has loaded it)."""
    lib = ctypes.CDLL(name_or_path, mode=os.RTLD_GLOBAL)
    for fn in ("fake_cuda_live_allocations", "fake_cuda_live_host_allocations",
               "fake_cuda_live_streams", "fake_cuda_live_events", "fake_cuda_live_vmm_handles",
               "fake_cuda_live_vmm_mappings", "fake_cuda_live_vmm_reservations"):
        getattr(lib, fn).argtypes = []
        getattr(lib, fn).restype = ctypes.c_int
    lib.fake_cuda_primary_ctx_refcount.argtypes = [ctypes.c_int]
    lib.fake_cuda_primary_ctx_refcount.restype = ctypes.c_int
    lib.fake_cuda_set_stream_busy.argtypes = [ctypes.c_void_p, ctypes.c_int]
    lib.fake_cuda_set_stream_busy.restype = ctypes.c_int   # a CUresult
    return lib
