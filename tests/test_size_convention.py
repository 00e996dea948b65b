"""One size convention everywhere (issue 41, point 7): Dask's ``parse_bytes`` and RMM's, a bare
or SI prefix decimal ("4G" = "4GB" = 4e9), an IEC prefix binary ("4GiB" = 2**32), any case,
device strings included; and the reading taken is shown where a user meets it.

Level: real (the parser, MemoryConfig, the sim backend, the replay and the OOM message).
"""
from __future__ import annotations

import pytest

from gpumem import MemoryConfig, MemoryManager, parse_size
from gpumem.errors import OutOfMemoryError
from gpumem.units import GiB, MiB, describe_size


@pytest.mark.parametrize("text, nbytes", [
    ("4G", 4 * 10**9), ("4GB", 4 * 10**9), ("4gb", 4 * 10**9), ("4g", 4 * 10**9),
    ("512M", 512 * 10**6), ("512mb", 512 * 10**6), ("1.5 GB", 15 * 10**8), ("3k", 3000),
    ("4GiB", 4 * GiB), ("4gib", 4 * GiB), ("4Gi", 4 * GiB), ("512MiB", 512 * MiB),
    ("1KiB", 1024), ("2TiB", 2 << 40), ("1PB", 10**15), ("1PiB", 1 << 50), ("7", 7), ("7b", 7),
])
def test_bare_and_si_prefixes_are_decimal_iec_prefixes_binary(text, nbytes):
    """real: "4G" and "4gb" are the same 4,000,000,000 bytes (they used to be 4 GiB and 4e9),
    "4GiB" is 2**32, in any case; as parse_size, a MemoryConfig size and an environment
    variable alike."""
    assert parse_size(text) == nbytes
    assert MemoryConfig(max_pool_size=text).max_pool_size == nbytes
    assert MemoryConfig.from_env({"GPUMEM_MAX_POOL_SIZE": text}).max_pool_size == nbytes


def test_a_sim_device_string_reads_its_size_the_same_way():
    """real: MemoryManager("sim:2GB") and "sim:2G" are 2e9-byte cards, "sim:2GiB" 2**31; the
    replay names the reading it took."""
    import gpumem
    from invariants import DATA
    for spec, total in (("sim:2GB", 2 * 10**9), ("sim:2G", 2 * 10**9), ("sim:2GiB", 2 * GiB)):
        with MemoryManager(spec, MemoryConfig(min_free_bytes=0)) as mm:
            assert mm.total_memory == total, spec
    res = gpumem.replay(DATA / "resnet50_train_step1.csv.gz", "sim:2GB")
    assert res.device == "sim:2GB (2.00 GB = 1.86 GiB)"


def test_an_oom_on_a_sized_device_says_which_reading_was_taken():
    """real: the OOM of a "sim:2GB" device shows "2.00 GB = 1.86 GiB" beside the name, so a
    user who meant 2 GiB sees why the card is smaller."""
    with MemoryManager("sim:2GB", MemoryConfig(min_free_bytes=0,
                                               cpu_fallback_enabled=False)) as mm:
        with pytest.raises(OutOfMemoryError, match=r"on sim:2GB \(2\.00 GB = 1\.86 GiB\)"):
            mm.malloc(3 * GiB)


def test_describe_size_shows_both_readings_binary_first_for_binary_sizes():
    """real: a whole number of MiB/GiB reads binary first, anything else decimal first."""
    assert describe_size(2 * 10**9) == "2.00 GB = 1.86 GiB"
    assert describe_size(4 * GiB) == "4.00 GiB = 4.29 GB"
    assert describe_size(512) == "512 B"


def test_gpumem_info_shows_the_environment_settings_with_the_reading(monkeypatch, capsys):
    """real: `gpumem info` lists the GPUMEM_* settings it took, a size with both readings
    (GPUMEM_MIN_FREE_BYTES=1G is 1.00 GB = 953.67 MiB, not 1 GiB)."""
    from gpumem.cli import main
    monkeypatch.setenv("GPUMEM_MIN_FREE_BYTES", "1G")
    monkeypatch.setenv("GPUMEM_MAX_POOL_SIZE", "2GiB")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPUMEM_MIN_FREE_BYTES=1G (1.00 GB = 953.67 MiB)" in out
    assert "GPUMEM_MAX_POOL_SIZE=2GiB (2.00 GiB = 2.15 GB)" in out
