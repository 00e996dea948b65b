"""The pytest plug-in users get with gpumem (gpumem.testing): options, fixtures, marker, faults
and leak checks, each proven by running a small user test suite through pytest's own
``pytester`` (level: **real** - real pytest, the plug-in loaded through its installed
``pytest11`` entry point, real gpumem managers on simulated devices, PoCL for the opencl run).
"""
from __future__ import annotations

import numpy  # noqa: F401  (imported before pytester's in-process runs, which unload what
#                          they import: numpy cannot be loaded twice in one process)
import pytest

try:        # likewise pyopencl: its nanobind extension aborts the process when loaded twice
    import pyopencl  # noqa: F401  (the plug-in's device listing imports it in the inner run)
except ImportError:
    pass

import gpumem_sim
from gpumem.errors import InvalidInputError
from gpumem.testing import parse_device_specs, map_to_backend

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow       # each test runs whole pytest sessions in-process


@pytest.fixture
def suite(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """Write a user's test file and run it in-process; GPUMEM_TEST_DEVICES unset."""
    monkeypatch.delenv("GPUMEM_TEST_DEVICES", raising=False)

    def run(source: str, *args: str) -> pytest.RunResult:
        pytester.makepyfile(test_user=source)
        return pytester.runpytest(*args)

    return run


def test_entry_point_registers_options_and_marker(pytester: pytest.Pytester):
    """Installing gpumem is enough: the options and the marker are there without -p."""
    result = pytester.runpytest("--help")
    result.stdout.fnmatch_lines(["*--gpumem-devices=SPECS*", "*--gpumem-backend=NAME*"])
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpumem(devices=None, faults=None, config=None)*"])


def test_off_unless_asked(suite, monkeypatch):
    """A test that uses none of the fixtures sees the simulated devices of its environment,
    even with --gpumem-devices given: the plug-in installs nothing behind its back."""
    monkeypatch.setenv("GPUMEM_SIM_DEVICES", "3GiB")
    gpumem_sim.uninstall()
    result = suite("""
        import gpumem_sim
        def test_plain():
            assert [d.capacity for d in gpumem_sim.installed()] == [3 << 30]
    """, "--gpumem-devices", "sim:1GiB")
    result.assert_outcomes(passed=1)
    gpumem_sim.uninstall()


def test_devices_option_env_and_marker(suite, monkeypatch):
    """--gpumem-devices wins over GPUMEM_TEST_DEVICES; the marker wins over both; each test
    gets fresh devices (what one test allocated is gone for the next); the default is one
    16 GiB device; the registry is as before afterwards."""
    before = gpumem_sim.installed()
    monkeypatch.setenv("GPUMEM_TEST_DEVICES", "sim:2GiB")
    source = """
        import pytest, gpumem_sim
        def test_a(gpumem_devices):
            assert list(gpumem_devices) == ["sim:0", "sim:1"]
            assert [d.capacity for d in gpumem_devices.sim] == [1 << 30, 512 << 20]
            assert gpumem_sim.installed() == gpumem_devices.sim
            gpumem_devices.sim[0].alloc_segment(1 << 20)          # not freed: gone with the device
        def test_b(gpumem_devices):
            assert gpumem_devices.sim[0].live_bytes == 0
        @pytest.mark.gpumem(devices="sim:64MiB")
        def test_marker(gpumem_devices):
            assert list(gpumem_devices) == ["sim:0"]
            assert gpumem_devices.sim[0].capacity == 64 << 20
    """
    suite(source, "--gpumem-devices", "sim:1GiB, sim:512MiB").assert_outcomes(passed=3)
    env_run = suite("""
        def test_env(gpumem_devices):
            assert [d.capacity for d in gpumem_devices.sim] == [2 << 30]
    """)
    env_run.assert_outcomes(passed=1)
    monkeypatch.delenv("GPUMEM_TEST_DEVICES")
    suite("""
        def test_default(gpumem_devices):
            assert [d.capacity for d in gpumem_devices.sim] == [16 << 30]
    """).assert_outcomes(passed=1)
    assert gpumem_sim.installed() == before


def test_manager_fixture_passes_clean_tests_and_fails_leaks(suite):
    """gpumem_manager is a fresh manager on the first device; a test that leaves a buffer
    alive fails (reported at teardown) with the buffer's tag and size; a clean one passes."""
    result = suite("""
        def test_clean(gpumem_manager):
            assert gpumem_manager.device_string == "sim:0"
            with gpumem_manager.malloc(4096, tag="ok"):
                pass
        kept = []
        def test_leaky(gpumem_manager):
            kept.append(gpumem_manager.malloc(3 << 20, tag="forgotten-activations"))
        def test_after(gpumem_manager):
            assert gpumem_manager.stats().active_buffers == 0
    """)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaky*",
                                 "*gpumem: the test leaked:*", "*forgotten-activations*"])


def test_shared_managers_start_fresh_and_are_leak_checked(suite):
    """Code under test that allocates through gpumem.get_manager() gets a shared manager on the
    test's own device; one left holding buffers fails the test; the next test starts fresh."""
    result = suite("""
        import gpumem
        kept = []
        def test_leaks_through_library_code(gpumem_devices):
            mm = gpumem.get_manager("sim:0")
            assert mm.device is gpumem_devices.sim[0]
            kept.append(mm.malloc(1 << 20, tag="kv-cache"))
        def test_leaks_after_configure(gpumem_devices):
            mm = gpumem.configure("sim:0", max_pool_size="64MiB")
            kept.append(mm.malloc(3 << 20, tag="reconfigured"))
        def test_next_is_fresh(gpumem_devices):
            mm = gpumem.get_manager("sim:0")
            assert mm.device is gpumem_devices.sim[0] and mm.stats().active_buffers == 0
            with mm.malloc(1 << 20):
                pass
    """)
    result.assert_outcomes(passed=3, errors=2)
    # docs/testing.md promises the tags and sizes of what a shared manager still holds
    result.stdout.fnmatch_lines(["*ERROR at teardown of test_leaks_through_library_code*",
                                 "*left buffers alive on a shared manager*",
                                 "*1 buffer(s) still live on sim:0*",
                                 "*1.00 MiB on sim:0 tag='kv-cache'*",
                                 "*ERROR at teardown of test_leaks_after_configure*",
                                 "*3.00 MiB on sim:0 tag='reconfigured'*"])


def test_marker_faults_and_config_reach_the_oom_ladder(suite):
    """faults={'fail_after': 0} makes the first device's driver refuse every segment: with CPU
    fallback off (the marker's config) malloc raises OutOfMemoryError; with it on, the buffer
    comes from the host."""
    result = suite("""
        import pytest
        from gpumem import MemoryConfig, OutOfMemoryError, FallbackBuffer
        @pytest.mark.gpumem(faults={"fail_after": 0},
                            config=MemoryConfig(cpu_fallback_enabled=False, min_free_bytes=0))
        def test_oom(gpumem_manager, gpumem_devices):
            with pytest.raises(OutOfMemoryError):
                gpumem_manager.malloc(1 << 20)
            assert gpumem_devices.sim[0].injected_failures >= 1
        @pytest.mark.gpumem(faults={"fail_after": 0})
        def test_fallback(gpumem_manager):
            buf = gpumem_manager.malloc(1 << 20)
            assert isinstance(buf, FallbackBuffer)
            buf.free()
    """)
    result.assert_outcomes(passed=2)


def test_faults_fixture(suite):
    """gpumem_faults: after=n lets n segments through; a seeded rate fails the same calls on
    every run; failing frees keep the segment cached; clear() heals the device."""
    result = suite("""
        import pytest, warnings
        from gpumem import DriverOutOfMemory
        def test_after(gpumem_devices, gpumem_faults):
            dev = gpumem_devices.sim[0]
            gpumem_faults.fail_allocations(after=2)
            dev.alloc_segment(1 << 20); dev.alloc_segment(1 << 20)
            with pytest.raises(DriverOutOfMemory):
                dev.alloc_segment(1 << 20)
            assert gpumem_faults.injected() == 1
            gpumem_faults.clear()
            dev.alloc_segment(1 << 20)
        def outcomes(dev):
            out = []
            for _ in range(40):
                try:
                    dev.alloc_segment(4096); out.append(True)
                except DriverOutOfMemory:
                    out.append(False)
            return out
        @pytest.mark.gpumem(devices="sim:1GiB,sim:1GiB")
        def test_rate(gpumem_devices, gpumem_faults):
            gpumem_faults.fail_rate(0.5, seed=3, device="sim:0")
            gpumem_faults.fail_rate(0.5, seed=3, device=1)
            first, second = outcomes(gpumem_devices.sim[0]), outcomes(gpumem_devices.sim[1])
            assert first == second and 5 < first.count(False) < 35
        def test_frees(gpumem_manager, gpumem_devices, gpumem_faults):
            gpumem_manager.malloc(8 << 20).free()
            used = gpumem_devices.sim[0].live_bytes
            gpumem_faults.fail_frees()
            with pytest.warns(RuntimeWarning, match="refused to free"):
                assert gpumem_manager.empty_cache() == 0
            assert gpumem_devices.sim[0].live_bytes == used      # the driver kept it
            gpumem_faults.clear()
            assert gpumem_manager.empty_cache() > 0
    """)
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize("backend", ["opencl", "cuda"])
def test_same_tests_on_a_real_backend(suite, backend):
    """--gpumem-backend opencl (cuda) runs the same user test on opencl:0 (cuda:0) instead of
    sim:0; where the backend is absent, the test is skipped with the reason. Fault tests are
    skipped on real devices, never run without their faults. Levels: opencl on PoCL is real;
    cuda runs in ci/test.sh's fake-driver pass (tests/fake_cuda under the real cuda-python) and
    is skipped in the first pass, where libcuda is absent."""
    from gpumem.backends import open_device
    try:
        open_device(f"{backend}:0")
        available = True
    except Exception:
        available = False
    result = suite(f"""
        def test_alloc(gpumem_manager, gpumem_devices):
            assert list(gpumem_devices) == ["{backend}:0"]
            assert gpumem_manager.device_string == "{backend}:0"
            with gpumem_manager.malloc(1 << 20) as buf:
                assert buf.nbytes == 1 << 20
        def test_faults(gpumem_faults):
            raise AssertionError("must not run on a real device")
    """, "--gpumem-backend", backend, "-rs")
    if available:
        result.assert_outcomes(passed=1, skipped=1)
        result.stdout.fnmatch_lines(["*gpumem_faults needs simulated devices*"])
    else:
        result.assert_outcomes(skipped=2)
        result.stdout.fnmatch_lines([f"*{backend}:0 is not available here*"])


def test_bad_input_is_a_usage_error(suite):
    """Malformed options stop the run with a message naming the option and what is allowed;
    a malformed marker errors the test that carries it."""
    result = suite("def test_x(): pass", "--gpumem-devices", "sim:0")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpumem-devices='sim:0': item 0 'sim:0' has no capacity*"])
    result = suite("def test_x(): pass", "--gpumem-backend", "rocm")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--gpumem-backend must be one of sim, cuda, opencl, cpu*"])
    result = suite("""
        import pytest
        @pytest.mark.gpumem(faults={"fail_after": 0, "fail_sometimes": 1})
        def test_x(gpumem_faults): pass
    """)
    result.assert_outcomes(errors=1)
    result.stdout.re_match_lines([r".*unknown key\(s\) \['fail_sometimes'\].*"])


def test_parse_and_map_specs():
    """The spec grammar and the sim -> backend mapping (plain functions, no pytest run)."""
    specs = parse_device_specs("sim:16GiB, opencl:1 ,sim:8GiB,cpu")
    assert [str(s) for s in specs] == ["sim:16.00 GiB", "opencl:1", "sim:8.00 GiB", "cpu"]
    assert [s.device for s in map_to_backend(specs, "cuda")] == ["cuda:0", "opencl:1", "cuda:1",
                                                                 "cpu"]
    assert map_to_backend(specs, "sim") == specs
    for bad in ("sim", "sim:lots", "gpu:0", "cuda:x", "", "sim:1GiB,,sim:1GiB"):
        with pytest.raises(InvalidInputError, match="--gpumem-devices"):
            parse_device_specs(bad)


def test_docs_example(suite):
    """The user's test file of docs/testing.md, as it stands there, passes on two simulated
    GPUs; dropping one sequence fewer makes its leak check fail it, as the page says."""
    import os
    import re
    from invariants import require_checkout
    root = str(require_checkout("docs/testing.md"))
    with open(os.path.join(root, "docs", "testing.md")) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    suite(code, "--gpumem-devices", "sim:16GiB,sim:8GiB").assert_outcomes(passed=3)
    leaky = code.replace("    for seq in range(8):\n        cache.drop(seq)",
                         "    for seq in range(7):\n        cache.drop(seq)")
    assert leaky != code
    result = suite(leaky)
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*1 buffer(s) still live on sim:0*"])


XDIST_SOURCE = """
    import os
    import pytest

    @pytest.mark.parametrize("i", range(8))
    def test_joins_the_run_group(gpumem_manager, i):
        shared = gpumem_manager._growth.shared
        assert shared is not None and shared.group.startswith("pytest-xdist-")
        assert gpumem_manager.device.shared_card is not None       # one card for all workers
        buf = gpumem_manager.malloc(64 << 20)
        pids = sorted({m.pid for m in shared.members()})
        with open(os.path.join(os.environ["OUT"], f"{os.getpid()}-{i}"), "w") as f:
            f.write(f"{shared.group} {shared.path} {os.getpid() in pids}")
        buf.free()
"""


def test_xdist_workers_share_one_group_and_leaks_are_still_reported(suite, tmp_path,
                                                                    monkeypatch, request):
    """Under pytest-xdist with 4 workers the plug-in's managers join one shared group per
    device (one ledger, one simulated card for every worker); the docs example still passes and
    its planted leak is still reported; --gpumem-shared-budget off leaves each worker alone."""
    import os
    import re
    import tempfile
    from invariants import require_checkout
    pytest.importorskip("xdist")
    import shutil
    shared_dir = tempfile.mkdtemp(prefix="gmx", dir="/tmp")
    request.addfinalizer(lambda: shutil.rmtree(shared_dir, ignore_errors=True))
    monkeypatch.setenv("GPUMEM_SHARED_DIR", shared_dir)
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("OUT", str(out))
    suite(XDIST_SOURCE, "-n", "4", "-p", "no:cacheprovider").assert_outcomes(passed=8)
    seen = [(name.split("-")[0], (out / name).read_text().split()) for name in os.listdir(out)]
    assert len(seen) == 8 and len({pid for pid, _ in seen}) >= 2    # several workers
    assert len({tuple(fields[:2]) for _, fields in seen}) == 1        # one group, one ledger
    assert all(fields[2] == "True" for _, fields in seen)
    root = str(require_checkout("docs/testing.md"))
    with open(os.path.join(root, "docs", "testing.md")) as f:
        code = re.search(r"```python\n(.*?)```", f.read(), re.S).group(1)
    suite(code, "-n", "4", "--gpumem-devices", "sim:16GiB,sim:8GiB").assert_outcomes(passed=3)
    leaky = code.replace("    for seq in range(8):\n        cache.drop(seq)",
                         "    for seq in range(7):\n        cache.drop(seq)")
    result = suite(leaky, "-n", "4")
    result.assert_outcomes(passed=3, errors=1)
    result.stdout.fnmatch_lines(["*1 buffer(s) still live on sim:0*"])
    off = suite("def test_alone(gpumem_manager):\n"
                "    assert gpumem_manager._growth.shared is None\n",
                "-n", "2", "--gpumem-shared-budget", "off")
    off.assert_outcomes(passed=1)
    bad = suite("def test_x(): pass", "-n", "2", "--gpumem-shared-budget", "lots")
    assert bad.ret != 0
