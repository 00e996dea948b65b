"""What an out-of-memory error says first when its manager is in a shared group.

In a group, the likely cause of an OOM is what the other members hold: live memory they cannot
hand back. That comes first in the error, with the figures, before any setting of this manager.
When the group is the one the pytest plug-in makes for its xdist workers (they share one card
by design), the error also says how to give each worker a card of its own.

Pure reporting: reads the group's ledger through the SharedBudget, changes nothing.
"""
from __future__ import annotations

from typing import Any

from gpumem.units import format_bytes

__all__ = ["PLUGIN_GROUP_PREFIX", "group_cause"]

#: the prefix of the group the pytest plug-in's xdist workers join (gpumem.testing.plugin)
PLUGIN_GROUP_PREFIX = "pytest-xdist-"


def group_cause(shared: Any, manager: Any) -> str:
    """One clause for an OOM of ``manager``, a member of ``shared``: what the other members
    hold (live and cached) against the group's budget, and the fix that fits."""
    text = shared.describe()       # the group, its budget, what all its members hold
    try:
        members = [m for m in shared.members() if m.alive]
    except Exception:  # a broken ledger must not hide the OOM itself (describe said why)
        return text
    mine = manager.pool.reserved_bytes
    others = max(0, sum(m.reserved for m in members) - mine)
    others_cached = max(0, sum(m.cached for m in members)
                        - (mine - manager.pool.in_use_bytes))
    text += (f": the {max(0, len(members) - 1)} other member(s) hold {format_bytes(others)}, "
             f"{format_bytes(max(0, others - others_cached))} of it live (this manager holds "
             f"{format_bytes(mine)})")
    if str(shared.group).startswith(PLUGIN_GROUP_PREFIX):
        text += ("; this is the pytest plug-in's group: its xdist workers share one card by "
                 "design. Run pytest with --gpumem-shared-budget off to give each worker a "
                 "card of its own (simulated devices), or with fewer workers (-n)")
    elif others:
        text += ("; free buffers in the other members, or give the group a larger "
                 "shared_budget or device")
    return text
