"""Soft limits and OOM advice in a shared group (issue 38 point 1, issue 41 point 8): a growth
past the soft min_free_bytes asks the group's other members to hand cached memory back first;
an OOM caused by another member's live memory says so first and, in the pytest plug-in's group,
names ``--gpumem-shared-budget off``.

Level: **real** (two members in one process on one shared gpumem_sim card, through the real
ledger and watcher threads).
"""
from __future__ import annotations

import shutil
import tempfile

import pytest

from gpumem import MemoryManager
from gpumem.errors import OutOfMemoryError
from gpumem.manager.group_advice import PLUGIN_GROUP_PREFIX
from shared_workers import MiB, shared_config

CARD = "sim:256MiB"


@pytest.fixture
def shared_dir(monkeypatch):
    """A private ledger folder (short, for the sockets' path limit) for this test only."""
    path = tempfile.mkdtemp(prefix="gmgl", dir="/tmp")
    monkeypatch.setenv("GPUMEM_SHARED_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_soft_min_free_asks_the_group_to_hand_back_first(shared_dir):
    """Member B's 100 MiB growth would leave 56 MiB free, under the soft min_free_bytes of 64
    MiB: A is asked to hand its 100 MiB of cache back first, and B is served from the device
    (with a hard 0 margin nobody would be asked) (real)."""
    cfg = shared_config("softfree").with_soft_limits(min_free_bytes=64 * MiB)
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        a.malloc(100 * MiB).free()
        buf = b.malloc(100 * MiB)
        assert a._growth.shared.requests_answered >= 1
        assert a.stats().reserved_bytes == 0
        assert b.device.mem_get_info()[0] >= 64 * MiB
        buf.free()


def test_soft_min_free_never_refuses_what_the_card_holds(shared_dir):
    """When the other member's memory is live (nothing to hand back), the soft margin gives
    way: B gets what the card still has (real)."""
    cfg = shared_config("softlive").with_soft_limits(min_free_bytes=64 * MiB)
    with MemoryManager(CARD, cfg) as a, MemoryManager(CARD, cfg) as b:
        live = a.malloc(100 * MiB)
        buf = b.malloc(140 * MiB)                 # leaves 16 MiB free on the card
        assert b.device.mem_get_info()[0] < 64 * MiB
        buf.free()
        live.free()


def test_group_oom_puts_the_other_members_first_and_names_the_plugin_option(shared_dir):
    """Issue 41, point 8: in the pytest plug-in's group (its name prefix), an OOM caused by
    another member's live memory says so first, with the figures, then names
    --gpumem-shared-budget off; min_free_bytes (soft by default) is not offered as the fix
    (real)."""
    group = PLUGIN_GROUP_PREFIX + "0123456789abcdef"
    cfg = shared_config(group).with_soft_limits(min_free_bytes=64 * MiB,
                                                gpu_memory_fraction=0.9)
    with MemoryManager(CARD, cfg) as other, MemoryManager(CARD, cfg) as mm:
        held = other.malloc(200 * MiB)
        with pytest.raises(OutOfMemoryError) as info:
            mm.malloc(100 * MiB)
        reason = info.value.reason
        assert reason.startswith(f"shared group {group!r}: budget 256.00 MiB")
        assert "the 1 other member(s) hold 200.00 MiB, 200.00 MiB of it live" in reason
        assert "--gpumem-shared-budget off" in reason
        assert "min_free_bytes=" not in reason
        held.free()


def test_a_group_of_ones_own_gets_no_plugin_advice(shared_dir):
    """Outside the plug-in's group the advice is to free the others' buffers or give the group
    more, never the plug-in option (real)."""
    cfg = shared_config("mine")
    with MemoryManager(CARD, cfg) as other, MemoryManager(CARD, cfg) as mm:
        held = other.malloc(200 * MiB)
        with pytest.raises(OutOfMemoryError) as info:
            mm.malloc(100 * MiB)
        assert info.value.reason.startswith("shared group 'mine'")
        assert "free buffers in the other members" in info.value.reason
        assert "--gpumem-shared-budget" not in info.value.reason
        held.free()


def test_a_budget_refusal_is_not_called_the_devices(shared_dir):
    """With room on the card but not in the group's budget, the OOM says the budget refused it,
    not the device (real)."""
    cfg = shared_config("budget", budget="128MiB")
    with MemoryManager(CARD, cfg) as other, MemoryManager(CARD, cfg) as mm:
        held = other.malloc(100 * MiB)
        with pytest.raises(OutOfMemoryError) as info:
            mm.malloc(100 * MiB)
        reason = info.value.reason
        assert "the shared group's budget refused it (the device has room)" in reason
        assert "the device refused it" not in reason
        held.free()
