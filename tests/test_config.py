"""MemoryConfig: presets, builder methods, the environment, and validation at construction."""
from __future__ import annotations

import dataclasses
import math
import re

import pytest

from gpumem import InvalidInputError, MemoryConfig, MemoryManager
from invariants import check

MiB = 1 << 20
GiB = 1 << 30


@pytest.fixture(autouse=True)
def no_gpumem_env(monkeypatch):
    """Tests start from a clean environment: no GPUMEM_* variable leaks in."""
    import os
    for key in list(os.environ):
        if key.startswith("GPUMEM_") and key != "GPUMEM_TEST_BACKENDS":
            monkeypatch.delenv(key)


# --- defaults and presets ---------------------------------------------------------------------------
def test_defaults():
    c = MemoryConfig()
    assert c.gpu_memory_fraction == 0.9
    assert c.cpu_fallback_enabled is True
    assert c.min_free_bytes == 512 * MiB
    assert c.track_allocations is False
    assert c.max_pool_size is None and c.max_split_size is None and c.reserve_bytes is None
    assert c.max_pooled_per_bucket == 8
    assert MemoryConfig.default() == c


def test_preset_inference():
    c = MemoryConfig.for_inference()
    assert (c.gpu_memory_fraction, c.cpu_fallback_enabled, c.min_free_bytes, c.max_pool_size) == \
           (0.95, False, 256 * MiB, 2 * GiB)


def test_preset_constrained():
    c = MemoryConfig.for_constrained()
    assert c.gpu_memory_fraction == 0.7 and c.min_free_bytes == 128 * MiB
    assert c.max_pool_size == 256 * MiB and c.max_pooled_per_bucket == 2
    assert c.max_split_size == 64 * MiB and c.large_segment == 10 * MiB
    assert c.pressure_thresholds == (0.5, 0.7, 0.9)


@pytest.mark.parametrize("preset", ["default", "for_inference", "for_constrained"])
def test_presets_build_working_managers(sim_device, preset):
    dev = sim_device("8GiB")
    cfg = getattr(MemoryConfig, preset)()
    with MemoryManager("sim:0", cfg) as mm:
        assert mm.usable_memory == min(int(8 * GiB * cfg.gpu_memory_fraction), 8 * GiB)
        bufs = [mm.malloc(n) for n in (0, 100, 3 * MiB, 12 * MiB)]
        check(mm, bufs)
    assert dev.live_bytes == 0


def test_constrained_preset_caps_the_cache(sim_device):
    sim_device("8GiB")
    with MemoryManager("sim:0", MemoryConfig.for_constrained()) as mm:
        bufs = [mm.malloc(30 * MiB) for _ in range(12)]
        for b in bufs:
            b.free()
            assert mm.stats().cached_bytes <= 256 * MiB
        check(mm, [])


# --- builder ------------------------------------------------------------------------------------------
def test_builder_methods_return_validated_copies():
    base = MemoryConfig()
    c = (base.with_gpu_memory_fraction(0.5)
             .with_cpu_fallback(False)
             .with_min_free_bytes("1GiB")
             .with_tracking(True, stacks=True)
             .with_max_pool_size("512MiB")
             .with_max_split_size(64 * MiB)
             .with_max_pooled_per_bucket(3)
             .with_reserve_bytes("100MB")
             .with_pressure_thresholds(0.5, 0.6, 0.7))
    assert c.gpu_memory_fraction == 0.5 and c.cpu_fallback_enabled is False
    assert c.min_free_bytes == GiB
    assert c.track_allocations is True and c.track_stacks is True
    assert c.max_pool_size == 512 * MiB and c.max_split_size == 64 * MiB
    assert c.max_pooled_per_bucket == 3 and c.reserve_bytes == 100_000_000
    assert c.pressure_thresholds == (0.5, 0.6, 0.7)
    assert base == MemoryConfig()                        # the original is untouched
    assert c.with_max_pool_size(None).max_pool_size is None
    assert c.with_max_split_size(None).max_split_size is None
    assert c.with_reserve_bytes(None).reserve_bytes is None


def test_config_is_frozen():
    c = MemoryConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.gpu_memory_fraction = 0.5


@pytest.mark.parametrize("build", [
    lambda c: c.with_gpu_memory_fraction(1.5),
    lambda c: c.with_gpu_memory_fraction(0),
    lambda c: c.with_cpu_fallback(1),
    lambda c: c.with_min_free_bytes("-1GiB"),
    lambda c: c.with_min_free_bytes("lots"),
    lambda c: c.with_max_pool_size(-1),
    lambda c: c.with_max_pooled_per_bucket(-1),
    lambda c: c.with_pressure_thresholds(0.8, 0.6, 0.9),
    lambda c: c.replace(no_such_field=1),
])
def test_builder_rejects_bad_values(build):
    with pytest.raises(InvalidInputError):
        build(MemoryConfig())


def test_replace_names_the_fields():
    with pytest.raises(InvalidInputError, match="gpu_memory_fraction"):
        MemoryConfig().replace(gpu_memory_fractoin=0.5)


# --- environment ------------------------------------------------------------------------------------
def test_from_env_reads_variables():
    env = {"GPUMEM_GPU_MEMORY_FRACTION": "0.8", "GPUMEM_MIN_FREE_BYTES": "1GiB",
           "GPUMEM_CPU_FALLBACK_ENABLED": "0", "GPUMEM_DEBUG": "1",
           "GPUMEM_MAX_POOL_SIZE": "256MiB", "GPUMEM_MAX_POOLED_PER_BUCKET": "4",
           "GPUMEM_PRESSURE_THRESHOLDS": "0.5,0.75,0.9", "GPUMEM_RESERVE_BYTES": "none",
           "UNRELATED": "x"}
    c = MemoryConfig.from_env(env)
    assert c.gpu_memory_fraction == 0.8
    assert c.min_free_bytes == GiB
    assert c.cpu_fallback_enabled is False
    assert c.track_allocations is True
    assert c.max_pool_size == 256 * MiB and c.max_pooled_per_bucket == 4
    assert c.pressure_thresholds == (0.5, 0.75, 0.9)
    assert c.reserve_bytes is None


@pytest.mark.parametrize("raw, expected", [("1", True), ("true", True), ("Yes", True),
                                           ("on", True), ("0", False), ("false", False),
                                           ("no", False), ("OFF", False)])
def test_from_env_booleans(raw, expected):
    assert MemoryConfig.from_env({"GPUMEM_CPU_FALLBACK_ENABLED": raw}).cpu_fallback_enabled \
        is expected


def test_from_env_debug_and_explicit_tracking():
    assert MemoryConfig.from_env({"GPUMEM_DEBUG": "1"}).track_allocations is True
    assert MemoryConfig.from_env({"GPUMEM_DEBUG": "0"}).track_allocations is False
    assert MemoryConfig.from_env({"GPUMEM_DEBUG": "1", "GPUMEM_TRACK_ALLOCATIONS": "0"}) \
        .track_allocations is False
    assert MemoryConfig.from_env({}).track_allocations is False


def test_debug_env_sets_the_default(monkeypatch):
    monkeypatch.setenv("GPUMEM_DEBUG", "1")
    assert MemoryConfig().track_allocations is True
    monkeypatch.setenv("GPUMEM_DEBUG", "0")
    assert MemoryConfig().track_allocations is False


def test_from_env_over_a_base():
    base = MemoryConfig.for_inference()
    c = MemoryConfig.from_env({"GPUMEM_GPU_MEMORY_FRACTION": "0.5"}, base=base)
    assert c.gpu_memory_fraction == 0.5 and c.max_pool_size == base.max_pool_size
    assert c.cpu_fallback_enabled is False
    assert MemoryConfig.from_env({}, base=base) == base


def test_from_env_reads_os_environ(monkeypatch):
    monkeypatch.setenv("GPUMEM_MIN_FREE_BYTES", "2GiB")
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "0.25")
    c = MemoryConfig.from_env()
    assert c.min_free_bytes == 2 * GiB and c.gpu_memory_fraction == 0.25


def test_manager_without_config_reads_the_environment(sim_device, monkeypatch):
    sim_device("4GiB")
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "0.5")
    monkeypatch.setenv("GPUMEM_MIN_FREE_BYTES", "0")
    monkeypatch.setenv("GPUMEM_CPU_FALLBACK_ENABLED", "false")
    with MemoryManager("sim:0") as mm:
        assert mm.usable_memory == 2 * GiB
        assert mm.config.cpu_fallback_enabled is False
        assert mm.config.min_free_bytes == 0


@pytest.mark.parametrize("key, raw", [
    ("GPUMEM_GPU_MEMORY_FRACTION", "abc"), ("GPUMEM_CPU_FALLBACK_ENABLED", "maybe"),
    ("GPUMEM_MIN_FREE_BYTES", "-1GiB"), ("GPUMEM_MIN_FREE_BYTES", "lots"),
    ("GPUMEM_MIN_FREE_BYTES", "1.5B"), ("GPUMEM_MAX_POOLED_PER_BUCKET", "-1"),
    ("GPUMEM_MAX_POOLED_PER_BUCKET", "two"), ("GPUMEM_PRESSURE_THRESHOLDS", "a,b,c"),
])
def test_from_env_rejects_unparsable_values_naming_the_variable(key, raw):
    with pytest.raises(InvalidInputError) as info:
        MemoryConfig.from_env({key: raw})
    assert key in str(info.value)


@pytest.mark.parametrize("key, raw", [
    ("GPUMEM_GPU_MEMORY_FRACTION", "1.5"), ("GPUMEM_GPU_MEMORY_FRACTION", "nan"),
    ("GPUMEM_GPU_MEMORY_FRACTION", "0"), ("GPUMEM_PRESSURE_THRESHOLDS", "0.5,0.6"),
    ("GPUMEM_GRANULARITY", "1000"),
])
def test_from_env_rejects_out_of_range_values_naming_the_variable(key, raw):
    """A value that parses but fails validation must also say which variable it came from:
    a user who never built a MemoryConfig (MemoryManager("cuda:0") reads the environment)
    otherwise cannot tell where "gpu_memory_fraction must be in (0, 1]" comes from."""
    with pytest.raises(InvalidInputError) as info:
        MemoryConfig.from_env({key: raw})
    assert key in str(info.value)


def test_manager_with_bad_environment_fails(sim_device, monkeypatch):
    sim_device("1GiB")
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "2")
    with pytest.raises(InvalidInputError, match="gpu_memory_fraction"):
        MemoryManager("sim:0")
    monkeypatch.setenv("GPUMEM_GPU_MEMORY_FRACTION", "half")
    with pytest.raises(InvalidInputError, match="GPUMEM_GPU_MEMORY_FRACTION"):
        MemoryManager("sim:0")


# --- validation at construction ----------------------------------------------------------------------
@pytest.mark.parametrize("changes", [
    dict(gpu_memory_fraction=0), dict(gpu_memory_fraction=1.01), dict(gpu_memory_fraction=-0.1),
    dict(gpu_memory_fraction=math.nan), dict(gpu_memory_fraction=math.inf),
    dict(gpu_memory_fraction=True), dict(gpu_memory_fraction="0.5"),
    dict(cpu_fallback_enabled=1), dict(cpu_fallback_enabled="yes"), dict(track_allocations=None),
    dict(release_before_grow=0),
    dict(min_free_bytes=-1), dict(min_free_bytes=1.0), dict(min_free_bytes="1 gig"),
    dict(min_free_bytes=True),
    dict(granularity=0), dict(granularity=3), dict(granularity=1000),
    dict(small_size=4 * MiB), dict(small_segment=0), dict(large_segment=0),
    dict(large_round=0), dict(large_threshold=30 * MiB),
    dict(max_pooled_per_bucket=-1), dict(reserve_bytes=-1), dict(max_split_size=-5),
    dict(max_pool_size=-1), dict(max_pool_size=1.5),
    dict(pressure_thresholds=(0.8, 0.6, 0.9)), dict(pressure_thresholds=(0.5, 0.6)),
    dict(pressure_thresholds=(0.5, 0.6, 1.5)), dict(pressure_thresholds=[0.5, 0.6, 0.7]),
    dict(pressure_thresholds=(0.0, 0.6, 0.7)), dict(pressure_thresholds=(0.5, math.nan, 0.7)),
    dict(high_cache_fraction=1.5), dict(high_cache_fraction=-0.1),
])
def test_invalid_values_raise_at_construction(changes):
    with pytest.raises(InvalidInputError):
        MemoryConfig(**changes)


@pytest.mark.parametrize("changes", [
    dict(gpu_memory_fraction=1), dict(gpu_memory_fraction=1e-6), dict(min_free_bytes=0),
    dict(granularity=1), dict(granularity=4096), dict(max_pool_size=0),
    dict(max_pooled_per_bucket=0), dict(reserve_bytes=0), dict(high_cache_fraction=0),
    dict(pressure_thresholds=(0.1, 0.2, 1.0)),
])
def test_edge_values_are_accepted(changes):
    c = MemoryConfig(**changes)
    for k, v in changes.items():
        assert getattr(c, k) == v


def test_gpu_memory_fraction_limits_the_manager(sim_device):
    dev = sim_device("1GiB")
    cfg = MemoryConfig(gpu_memory_fraction=0.1, min_free_bytes=0, cpu_fallback_enabled=False)
    with MemoryManager("sim:0", cfg) as mm:
        assert mm.usable_memory == int(0.1 * GiB)
        bufs = []
        with pytest.raises(Exception) as info:
            while True:
                bufs.append(mm.malloc(12 * MiB))
        assert type(info.value).__name__ == "OutOfMemoryError"
        assert dev.live_bytes <= int(0.1 * GiB)
        check(mm, bufs)


def test_debug_env_turns_on_leak_tracking_in_a_manager(sim_device, monkeypatch):
    sim_device("1GiB")
    monkeypatch.setenv("GPUMEM_DEBUG", "1")
    with MemoryManager("sim:0", MemoryConfig(min_free_bytes=0)) as mm:
        assert mm.config.track_allocations is True
        b = mm.malloc(100, tag="weights")
        leaks = mm.check_leaks()
        assert [(m.id, m.nbytes, m.tag) for m in leaks] == [(b.id, 100, "weights")]
        b.free()
        assert mm.check_leaks() == []
    monkeypatch.delenv("GPUMEM_DEBUG")
    with MemoryManager("sim:0", MemoryConfig(min_free_bytes=0)) as mm:
        with pytest.raises(InvalidInputError, match="track_allocations"):
            mm.check_leaks()


# --- ranges (issue 9 bug 8) and misspelled variables (issue 15 item 12) ---------------------------
@pytest.mark.parametrize("name", ["granularity", "max_split_size", "small_segment",
                                  "max_pool_size", "large_split_min", "oversize_slack"])
@pytest.mark.parametrize("value", [2**64, 2**64 + 512, 2**70])
def test_sizes_past_the_pools_range_are_refused_at_construction(name, value):
    """real: a size the C pool cannot hold is an InvalidInputError naming the field at
    MemoryConfig(), not an OverflowError later in MemoryManager (granularity's values are
    powers of two or not: both are refused by the range check or the power-of-two check)."""
    with pytest.raises(InvalidInputError, match=name):
        MemoryConfig(**{name: value})


def test_largest_allowed_size_builds_a_manager(sim_device):
    """real (sim): the bound is inclusive and the pool takes it (no overflow inside)."""
    from gpumem.config import MAX_BYTES
    sim_device("1GiB")
    cfg = MemoryConfig(max_pool_size=MAX_BYTES, max_split_size=MAX_BYTES, min_free_bytes=0)
    with MemoryManager("sim:0", cfg) as mm:
        mm.malloc(4096).free()
    with pytest.raises(InvalidInputError, match="max_pool_size"):
        MemoryConfig(max_pool_size=MAX_BYTES + 1)


#: each size field with a valid value, as a size string and as the int it means
_SIZE_STRINGS = {
    "min_free_bytes": ("1GiB", GiB), "reserve_bytes": ("1.5 GiB", 3 * GiB // 2),
    "granularity": ("1KiB", 1024), "small_size": ("512KiB", 512 * 1024),
    "small_segment": ("4MiB", 4 * MiB), "large_segment": ("40MiB", 40 * MiB),
    "large_threshold": ("16MiB", 16 * MiB), "large_round": ("2KiB", 2048),
    "max_split_size": ("256MiB", 256 * MiB), "large_split_min": ("2M", 2 * 10 ** 6),
    "oversize_slack": ("10MB", 10 ** 7), "max_pool_size": ("4GiB", 4 * GiB),
    "expandable_handle_size": ("20MiB", 20 * MiB),
}


def test_every_size_field_takes_a_size_string():
    """A user can write any size setting as "4GiB" in MemoryConfig(...) and replace(...), as
    the environment and with_*() always allowed; it is stored as the int it means, so the
    config compares equal to one built from ints."""
    from gpumem.config import SIZE_FIELDS
    assert set(_SIZE_STRINGS) == set(SIZE_FIELDS)
    for name, (text, nbytes) in _SIZE_STRINGS.items():
        cfg = MemoryConfig(**{name: text})
        assert getattr(cfg, name) == nbytes and type(getattr(cfg, name)) is int, name
        assert cfg == MemoryConfig(**{name: nbytes})
        assert MemoryConfig().replace(**{name: text}) == cfg
    assert MemoryConfig(expandable_handle_size="Growth").expandable_handle_size == "growth"


@pytest.mark.parametrize("name", sorted(_SIZE_STRINGS))
def test_malformed_size_string_names_the_field(name):
    """A size string that is not a size is refused with InvalidInputError naming the field,
    and what is allowed (a unit, e.g. '16GiB')."""
    with pytest.raises(InvalidInputError, match=name) as exc:
        MemoryConfig(**{name: "4 gigs"})
    assert "e.g." in str(exc.value)


def test_configure_takes_size_strings(sim_device):
    """docs/shared_managers.md's call: configure(device, max_pool_size="4GiB") works and the
    shared manager caps its cache at 4 GiB; a malformed size leaves the shared manager as it
    was."""
    from gpumem import configure, get_manager
    from gpumem.placement.shared import close_shared_managers
    sim_device("8GiB")
    try:
        before = get_manager("sim:0")
        with pytest.raises(InvalidInputError, match="max_pool_size"):
            configure("sim:0", max_pool_size="lots")
        assert get_manager("sim:0") is before and not before.closed
        mm = configure("sim:0", max_pool_size="4GiB", min_free_bytes="256MiB")
        assert mm.config.max_pool_size == 4 * GiB and mm.config.min_free_bytes == 256 * MiB
        assert get_manager("sim:0") is mm
    finally:
        close_shared_managers()


def test_sizes_as_strings_through_get_manager_and_the_cli(monkeypatch, capsys, sim_device):
    """The same size strings reach a manager through the environment: get_manager's shared
    manager and the `gpumem` command both read GPUMEM_RESERVE_BYTES=512MiB (the CLI's summary
    shows 512 MiB usable on a 1 GiB device); a malformed one is a one-line error naming the
    variable (exit status 1)."""
    import json

    from gpumem import get_manager
    from gpumem.cli import main
    from gpumem.placement.shared import close_shared_managers
    sim_device("1GiB")
    monkeypatch.setenv("GPUMEM_RESERVE_BYTES", "512MiB")
    try:
        assert get_manager("sim:0").config.reserve_bytes == 512 * MiB
        assert get_manager("sim:0").usable_memory == 512 * MiB
    finally:
        close_shared_managers()
    capsys.readouterr()
    assert main(["summary", "--json", "-"]) == 0
    assert json.loads(capsys.readouterr().out)["usable_bytes"] == 512 * MiB
    monkeypatch.setenv("GPUMEM_RESERVE_BYTES", "half")
    assert main(["summary"]) == 1
    assert "GPUMEM_RESERVE_BYTES='half'" in capsys.readouterr().err


def test_misspelled_variable_warns_naming_the_known_ones():
    """real: GPUMEM_MIN_FREE_BYTE (no S) is not silently ignored: an UnknownSettingWarning
    names it, suggests the right one and lists the known variables; known ones do not warn."""
    import warnings

    from gpumem import UnknownSettingWarning
    with pytest.warns(UnknownSettingWarning) as rec:
        cfg = MemoryConfig.from_env({"GPUMEM_MIN_FREE_BYTE": "1GiB"})
    msg = str(rec[0].message)
    assert "GPUMEM_MIN_FREE_BYTE " in msg and "did you mean GPUMEM_MIN_FREE_BYTES" in msg
    assert "GPUMEM_GPU_MEMORY_FRACTION" in msg and "GPUMEM_SIM_DEVICES" in msg
    assert cfg.min_free_bytes == MemoryConfig().min_free_bytes
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryConfig.from_env({"GPUMEM_MIN_FREE_BYTES": "1GiB", "GPUMEM_DEBUG": "1",
                               "GPUMEM_SIM_DEVICES": "1", "OTHER": "x"})


def test_unknown_variable_warning_lists_user_settings_only():
    """An unknown GPUMEM_* name gets the closest user setting and the list of settings a user
    may set: the MemoryConfig fields and GPUMEM_DEVICE and the like, never the project's own CI
    knobs (GPUMEM_VENV, GPUMEM_PACKAGE_KEEP, GPUMEM_CBENCH_DIR...), which still do not warn."""
    import warnings

    from gpumem import UnknownSettingWarning
    from gpumem.config import INTERNAL_VARIABLES, OTHER_VARIABLES, USER_VARIABLES
    assert not USER_VARIABLES & INTERNAL_VARIABLES
    assert OTHER_VARIABLES == USER_VARIABLES | INTERNAL_VARIABLES
    assert {"GPUMEM_VENV", "GPUMEM_PACKAGE_KEEP", "GPUMEM_CBENCH_DIR"} <= INTERNAL_VARIABLES
    with pytest.warns(UnknownSettingWarning) as rec:
        MemoryConfig.from_env({"GPUMEM_DEVISE": "sim:0"})
    msg = str(rec[0].message)
    assert "did you mean GPUMEM_DEVICE?" in msg
    listed = set(msg.split("the settings are: ", 1)[1].split(", "))
    assert listed == USER_VARIABLES | {"GPUMEM_" + f.name.upper()
                                       for f in dataclasses.fields(MemoryConfig)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        MemoryConfig.from_env({name: "1" for name in INTERNAL_VARIABLES})


def test_variables_the_package_reads_are_user_settings():
    """Every GPUMEM_* name that gpumem or gpumem_sim reads at run time is a user setting (so
    the warning offers it); the internal list holds only what CI, tests and benchmarks read."""
    from pathlib import Path

    import gpumem
    import gpumem_sim
    from gpumem.config import INTERNAL_VARIABLES
    folders = [Path(m.__file__).resolve().parent for m in (gpumem, gpumem_sim)]
    read = set()
    for folder in folders:
        for path in folder.rglob("*.py"):
            if path.name != "config.py":
                read |= set(re.findall(r"GPUMEM_[A-Z_]+", path.read_text()))
    assert "GPUMEM_DEVICE" in read
    assert read & INTERNAL_VARIABLES == set()


def _unknown_variables(folders) -> list[str]:
    """The GPUMEM_* names read in ``folders`` that are no MemoryConfig field and not listed in
    OTHER_VARIABLES."""
    import dataclasses
    import re

    from gpumem.config import OTHER_VARIABLES
    used = set()
    for folder in folders:
        for path in folder.rglob("*"):
            if path.suffix in (".py", ".pyx", ".sh"):
                used |= set(re.findall(r"GPUMEM_[A-Z_]+", path.read_text()))
    known = OTHER_VARIABLES | {"GPUMEM_" + f.name.upper()
                               for f in dataclasses.fields(MemoryConfig)}
    return sorted(used - known)


def test_every_gpumem_variable_the_code_reads_is_known():
    """A GPUMEM_* variable that gpumem itself reads (GPUMEM_DEVICE, GPUMEM_DUMP_ON_OOM, ...) must
    never trigger the misspelling warning: every name in the package and the simulator (the
    ones under test, checked out or installed) is a MemoryConfig field or in OTHER_VARIABLES."""
    from pathlib import Path

    import gpumem
    import gpumem_sim
    folders = [Path(m.__file__).resolve().parent for m in (gpumem, gpumem_sim)]
    assert len(list(folders[0].rglob("*.py"))) > 50
    assert _unknown_variables(folders) == []


def test_every_gpumem_variable_the_ci_scripts_read_is_known():
    """The same for the CI scripts of the checkout (ci/*.sh, which set GPUMEM_* knobs)."""
    from invariants import require_checkout
    root = require_checkout("ci/")
    assert _unknown_variables([root / "ci"]) == []


def test_size_and_device_strings_are_parsed_in_linear_time():
    """real: a size or ``sim:<size>`` with 60,000 blanks before a stray character is refused at
    once. The grammar used to be one regular expression with blanks on both sides of an
    optional unit, which backtracks quadratically: 16,000 blanks took 1.4 s, 60,000 about
    20 s (found while writing tests/fuzz/sizes.py)."""
    import time

    from gpumem import parse_size
    from gpumem.backends import canonical_device, open_device
    from gpumem.errors import InvalidDeviceError
    text = "1" + " " * 60_000 + "x!"
    started = time.monotonic()
    with pytest.raises(InvalidInputError, match="cannot parse"):
        parse_size(text)
    with pytest.raises(InvalidDeviceError):
        canonical_device("sim:" + text)
    with pytest.raises((InvalidDeviceError, InvalidInputError)):
        open_device("sim:" + text)
    assert time.monotonic() - started < 2
    assert parse_size(" \t 18446744073709551617 B\n") == 18446744073709551617   # exact
