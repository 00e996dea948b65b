"""One rule for settings (issue 41, points 2-5): every entry point that builds a manager reads
GPUMEM_* the same way (MemoryConfig.from_env, which warns about a misspelt name) or says in one
line what it ignores; a CLI option that names a setting has its name and values everywhere.

Level: real (the CLI, gpumem.replay and MemoryConfig on gpumem_sim).
"""
from __future__ import annotations

import warnings

import pytest

import gpumem
from gpumem import MemoryConfig
from gpumem.cli import main
from gpumem.cli.common import DEMO_TRACE
from gpumem.errors import InvalidInputError, UnknownSettingWarning


def test_library_replay_takes_the_segment_policy_from_the_environment(monkeypatch):
    """real: gpumem.replay() with GPUMEM_SEGMENTS=plain replays plain segments, as a
    MemoryManager built without a config would (it used to replay auto, silently)."""
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    res = gpumem.replay(DEMO_TRACE)
    assert res.config["segments"] == "plain" and not res.config["expandable_segments"]
    monkeypatch.setenv("GPUMEM_SEGMENTS", "Fast")         # any case, as segments="Fast"
    assert gpumem.replay(DEMO_TRACE).config["segments"] == "fast"


def test_a_misspelt_variable_warns_in_a_replay(monkeypatch):
    """real: GPUMEM_SEGMNTS (a typo) gets an UnknownSettingWarning naming GPUMEM_SEGMENTS
    from gpumem.replay(), as from every manager."""
    monkeypatch.setenv("GPUMEM_SEGMNTS", "plain")
    with pytest.warns(UnknownSettingWarning, match="did you mean GPUMEM_SEGMENTS"):
        gpumem.replay(DEMO_TRACE)


def test_segments_accepts_any_case_in_config_and_environment():
    """real: segments="Auto" and GPUMEM_SEGMENTS=Fast follow one rule (both were not: the
    variable was lower-cased, the argument refused)."""
    assert MemoryConfig(segments="Auto") == MemoryConfig(segments="auto")
    assert MemoryConfig(segments="TIGHT").segments == "tight"
    assert MemoryConfig.from_env({"GPUMEM_SEGMENTS": "Fast"}).segments == "fast"
    with pytest.raises(InvalidInputError, match="segments must be one of"):
        MemoryConfig(segments="fastest")


@pytest.mark.parametrize("older", [{"expandable_segments": True},
                                   {"expandable_handle_size": "20MiB"},
                                   {"expandable_handle_size": "growth"}])
def test_plain_with_an_older_expandable_setting_is_refused_naming_both(older):
    """real: segments="plain" with expandable_segments=True used to run auto while
    .segments read "plain"; docs/segments.md says the contradiction is refused, so it is,
    naming both settings (and from the environment naming the variables)."""
    (name, value), = older.items()
    with pytest.raises(InvalidInputError, match=rf"segments='plain'.*{name}"):
        MemoryConfig(segments="plain", **older)
    env = {"GPUMEM_SEGMENTS": "plain", "GPUMEM_" + name.upper(): str(value)}
    with pytest.raises(InvalidInputError, match="GPUMEM_SEGMENTS"):
        MemoryConfig.from_env(env)
    assert MemoryConfig(segments="plain", expandable_segments=False).segment_policy == "plain"


def test_cli_replay_segments_names_the_policy_not_a_file(tmp_path, monkeypatch, capsys):
    """real: `gpumem replay demo --segments plain` replays plain segments and writes no
    plain.png (it used to write plain.png and replay auto); --plot-segments writes the map."""
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    assert main(["replay", "demo", "--segments", "plain"]) == 0
    out = capsys.readouterr().out
    assert "(segments=plain)" in out and list(tmp_path.iterdir()) == []
    assert main(["replay", "demo", "--segments", "tight", "--plot-segments", "map.png"]) == 0
    assert "(segments=tight)" in capsys.readouterr().out
    assert (tmp_path / "map.png").stat().st_size > 0


def test_cli_replay_deprecated_segments_file_still_writes_the_map(tmp_path, capsys):
    """real: the old spelling `--segments FILE.png` still writes the map, with a note that
    names --plot-segments; a value that is neither is a usage error listing the policies."""
    pytest.importorskip("matplotlib")
    target = tmp_path / "old.png"
    assert main(["replay", "demo", "--segments", str(target)]) == 0
    assert "--plot-segments" in capsys.readouterr().err and target.stat().st_size > 0
    assert main(["replay", "demo", "--segments", "plainest"]) == 2
    assert "auto, tight, fast, plain" in capsys.readouterr().err


def test_cli_replay_reads_the_environment_and_the_flag_wins(monkeypatch, capsys):
    """real: `gpumem replay` takes GPUMEM_SEGMENTS and prints it; --segments on the command
    line wins over it; the settings a replay overrides (CPU fallback) are named in one line
    with the reason."""
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    monkeypatch.setenv("GPUMEM_CPU_FALLBACK_ENABLED", "1")
    monkeypatch.setenv("GPUMEM_MIN_FREE_BYTES", "1G")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnknownSettingWarning)
        assert main(["replay", "demo"]) == 0
    out = capsys.readouterr().out
    assert "(segments=plain)" in out
    assert "GPUMEM_SEGMENTS=plain" in out and "GPUMEM_MIN_FREE_BYTES=1G (1.00 GB = 953.67 MiB)" in out
    assert "ignored: GPUMEM_CPU_FALLBACK_ENABLED=1 (a replay counts" in out
    assert main(["replay", "demo", "--segments", "fast"]) == 0
    assert "(segments=fast)" in capsys.readouterr().out
    assert main(["replay", "demo", "--expandable-segments"]) == 0     # over the env's plain
    assert "(segments=auto)" in capsys.readouterr().out


def test_cli_replay_default_config_is_tunes_default_row(monkeypatch, capsys):
    """real: `gpumem replay --config default` keeps MemoryConfig.default()'s free margin, as
    tune's row does: on a 1 GiB card its 512 MiB margin refuses part of the demo trace (1.51
    GiB live), on an 80 GiB card nothing."""
    assert main(["replay", "demo", "--device", "sim:1GiB", "--json", "-"]) == 2
    import json
    out = capsys.readouterr().out
    assert json.loads(out)["config"]["min_free_bytes"] == MemoryConfig().min_free_bytes


def test_cli_options_that_name_a_setting_share_name_and_values(capsys):
    """real: --segments takes policy names in `replay`, `plot` and `tune` alike (tune a comma
    list), and --expandable-handle-size's help no longer claims one page is the default."""
    for cmd in (["replay", "--help"], ["plot", "--help"], ["tune", "--help"]):
        assert main(cmd) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "auto" in text and "plain" in text and "--segments" in text
        assert "default: one page" not in text
    assert main(["tune", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    from gpumem.planning.tune import TORCH_CONFS, gpumem_grid
    assert f"By default {len(gpumem_grid()) + len(TORCH_CONFS)} candidates" in text


def test_tune_says_in_one_line_that_its_rows_ignore_the_environment(monkeypatch, capsys):
    """real: with GPUMEM_SEGMENTS set, `gpumem tune` says its gpumem rows ignore it (each row
    replays the line it prints) instead of silently replaying something else."""
    monkeypatch.setenv("GPUMEM_SEGMENTS", "plain")
    assert main(["tune", "demo", "--allocator", "gpumem", "--presets", "default",
                 "--segments", "Fast", "--no-min-capacity", "--jobs", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tune ignores GPUMEM_SEGMENTS=plain" in out
