"""What the shared groups of this user look like now: every ledger in the per-user folder, its
budget and its members (for ``gpumem groups`` / ``gpumem info`` and reports).

Read-only: nothing is reaped or changed; a member whose process is gone is shown as such. A
ledger that cannot be trusted is reported with its error instead of its figures.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from gpumem.placement.ledger import CARD, Ledger, SharedLedgerError, ledger_folder
from gpumem.placement.shared_budget import GroupMember, group_members

__all__ = ["GroupReport", "list_groups"]


@dataclass(frozen=True)
class GroupReport:
    """One group on one device."""

    group: str
    device: str                  # the device's string and total memory, as in the file name
    path: str
    budget: int = 0
    total: int = 0
    members: list[GroupMember] = field(default_factory=list)
    card_bytes: int = 0          # bytes taken from a shared simulated card (0: none)
    error: str | None = None

    @property
    def reserved(self) -> int:
        return sum(m.reserved for m in self.members if m.alive)

    @property
    def cached(self) -> int:
        return sum(m.cached for m in self.members if m.alive)

    def as_dict(self) -> dict:
        return {"group": self.group, "device": self.device, "path": self.path,
                "budget": self.budget, "total": self.total, "reserved": self.reserved,
                "cached": self.cached, "card_bytes": self.card_bytes, "error": self.error,
                "members": [m.__dict__ for m in self.members]}


def list_groups(folder: str | None = None) -> list[GroupReport]:
    """Every ledger in ``folder`` (default: this user's ledger folder), sorted by name."""
    folder = folder or ledger_folder(create=False)
    if not os.path.isdir(folder):
        return []
    reports = []
    for name in sorted(os.listdir(folder)):
        if not name.endswith(".ledger"):
            continue
        group, _, device = name[:-len(".ledger")].rpartition(".")
        path = os.path.join(folder, name)
        try:
            ledger = Ledger(path)
        except SharedLedgerError as exc:
            reports.append(GroupReport(group, device, path, error=str(exc)))
            continue
        try:
            budget, total = ledger.header()
            members = group_members(ledger)
            with ledger.locked() as lg:
                card = sum(s.card_bytes for s in lg.slots(CARD))
            reports.append(GroupReport(group, device, path, budget, total, members, card))
        except SharedLedgerError as exc:
            reports.append(GroupReport(group, device, path, error=str(exc)))
        finally:
            ledger.close()
    return reports
