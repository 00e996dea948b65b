"""gpumem as Numba's External Memory Management plugin (gpumem/integrations/numba.py).

Level **fake driver**: Numba's own CUDA layer (numba-cuda over cuda.core / cuda.bindings) runs in
a child process on tests/fake_cuda (tests/fake_cuda/numba_checks.py): context creation, the
plugin plumbing, device arrays, host<->device copies, finalizers, defer_cleanup, reset and
get_memory_info all go through Numba's code and the plugin into gpumem's pool. No kernel runs
there (the fake has no module loader); a Numba kernel on a GPU is in ci/gpu.sh.
Level **real**: argument checks and the lazy import.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

import fake_cuda
from gpumem.errors import InvalidInputError
from gpumem.integrations import numba as gm_numba
from invariants import sim_manager

HERE = Path(__file__).resolve().parents[1]   # tests/


@pytest.fixture
def numba_on_fake(tmp_path):
    """(environment, command) for a child running numba_checks.py on the fake; skips where
    numba-cuda, cuda-python, gcc or cuda.h is missing."""
    for mod in ("numba", "numba.cuda", "cuda.bindings"):
        try:
            found = importlib.util.find_spec(mod) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            pytest.skip(f"{mod} is not installed (the 'numba' and 'cuda' extras)")
    try:
        lib_dir = fake_cuda.build(tmp_path).parent
    except fake_cuda.FakeCudaBuildError as exc:
        pytest.skip(str(exc).splitlines()[0])
    env = fake_cuda.env(lib_dir, PYTHONPATH=str(HERE.parent))
    env.pop("NUMBA_CUDA_MEMORY_MANAGER", None)
    return env, [sys.executable, str(HERE / "fake_cuda" / "numba_checks.py")]


def run(cmd, env) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env,
                          cwd=HERE.parent)


def test_numba_arrays_allocate_through_gpumem_on_the_fake_driver(numba_on_fake):
    """Every check in numba_checks.main passes: arrays land in gpumem's pool (tracked, tagged
    "numba", reused on a second allocation), data round-trips through the fake's memory,
    finalizers and defer_cleanup return memory, OOM is gpumem's error, reset empties all."""
    env, cmd = numba_on_fake
    out = run(cmd, env)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    passed = {line.split()[1] for line in out.stdout.splitlines() if line.startswith("PASS")}
    assert passed == {"plugin_is_numbas_memory_manager", "to_device_and_back",
                      "device_array_is_pooled", "defer_cleanup_holds_frees_back",
                      "memory_info_comes_from_the_manager", "out_of_memory_is_gpumems_error",
                      "reset_returns_everything_and_empties_the_cache"}, out.stdout


def test_numba_cuda_memory_manager_environment_variable(numba_on_fake):
    """NUMBA_CUDA_MEMORY_MANAGER=gpumem.integrations.numba: Numba imports the plugin itself and
    allocates from gpumem.get_manager("cuda:0")."""
    env, cmd = numba_on_fake
    env["NUMBA_CUDA_MEMORY_MANAGER"] = "gpumem.integrations.numba"
    out = run(cmd, env)
    assert out.returncode == 0 and "PASS env_var" in out.stdout, out.stdout + out.stderr[-3000:]


def test_use_gpumem_refuses_a_non_cuda_manager(sim_device):
    """Numba arrays are CUDA memory: a manager on another backend is refused by name, before
    Numba is touched (real)."""
    _, mm = sim_manager("64MiB")
    try:
        with pytest.raises(InvalidInputError, match="needs a cuda manager.*'sim:0'"):
            gm_numba.use_gpumem(mm)
    finally:
        mm.close()


def test_integrations_import_no_framework():
    """Importing gpumem and the three integration modules imports neither numba, cupy nor
    torch (a fresh interpreter, real); the frameworks load on first use."""
    code = ("import sys, gpumem, gpumem.integrations.numba, gpumem.integrations.cupy, "
            "gpumem.integrations.torch\n"
            "bad = sorted(m for m in ('numba', 'cupy', 'torch', 'numba.cuda') if m in sys.modules)\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=HERE.parent)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
