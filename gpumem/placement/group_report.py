"""What the shared groups of this user look like now: every ledger in the per-user folder, its
budget and its members (for ``gpumem groups`` / ``gpumem info`` and reports), and the clean-up
of what is left of groups no process uses (``gpumem groups --prune``).

``list_groups`` is read-only: nothing is reaped or changed; a member whose process is gone is
shown as such. A ledger that cannot be trusted is reported with its error instead of its
figures. ``prune`` removes ledgers with no live user (under each one's lock, as the last member
would), refused ledgers this user owns, and wake-up sockets no live member owns.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpumem.placement.ledger import CARD, MEMBER, Ledger, SharedLedgerError
from gpumem.placement.ledger_folder import folder_choice
from gpumem.placement.shared_budget import GroupMember, group_members

__all__ = ["GroupReport", "list_groups", "prune", "PruneResult"]

_SOCKET = re.compile(r"w(\d+)-([0-9a-f]{16})\.sock")


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
    users: int = 0               # live slots (members and card users)

    @property
    def reserved(self) -> int:
        return sum(m.reserved for m in self.members if m.alive)

    @property
    def cached(self) -> int:
        return sum(m.cached for m in self.members if m.alive)

    @property
    def live(self) -> bool:
        """Trusted, and some process still uses it."""
        return self.error is None and self.users > 0

    def as_dict(self) -> dict:
        return {"group": self.group, "device": self.device, "path": self.path,
                "budget": self.budget, "total": self.total, "reserved": self.reserved,
                "cached": self.cached, "card_bytes": self.card_bytes, "error": self.error,
                "live": self.live, "members": [m.__dict__ for m in self.members]}


def _ledger_names(folder: str) -> list[str]:
    if not os.path.isdir(folder):
        return []
    return sorted(n for n in os.listdir(folder) if n.endswith(".ledger"))


def list_groups(folder: str | None = None) -> list[GroupReport]:
    """Every ledger in ``folder`` (default: this user's ledger folder), sorted by name."""
    folder = folder or folder_choice().path
    reports = []
    for name in _ledger_names(folder):
        group, _, device = name[:-len(".ledger")].rpartition(".")
        path = os.path.join(folder, name)
        try:
            ledger = Ledger(path, create=False)
        except SharedLedgerError as exc:
            if os.path.lexists(path):             # (else removed by its last member meanwhile)
                reports.append(GroupReport(group, device, path, error=str(exc)))
            continue
        try:
            members = group_members(ledger)
            with ledger.locked() as lg:
                budget, total = lg.header()
                used = [(s, lg.alive(s)) for s in lg.slots()]
            card = sum(s.card_bytes for s, alive in used if s.kind == CARD and alive)
            reports.append(GroupReport(group, device, path, budget, total, members, card,
                                       users=sum(alive for _, alive in used)))
        except SharedLedgerError as exc:
            reports.append(GroupReport(group, device, path, error=str(exc)))
        finally:
            ledger.close()
    return reports


@dataclass(frozen=True)
class PruneResult:
    """What ``prune`` removed (paths) and what it left (path, why)."""

    removed: list[str]
    kept: list[tuple[str, str]]


def prune(folder: str | None = None) -> PruneResult:
    """Remove, in ``folder`` (default: this user's ledger folder), every ledger no live process
    uses (its dead slots reaped under its lock, the file removed as its last member would),
    every ledger that cannot be trusted and belongs to this user (corrupted, truncated, another
    version, open to others: remove it only once no process of an older gpumem uses it), and
    every wake-up socket of a member not alive in any ledger. Another user's files are kept."""
    folder = folder or folder_choice().path
    removed: list[str] = []
    kept: list[tuple[str, str]] = []
    sockets = (sorted(n for n in os.listdir(folder) if _SOCKET.fullmatch(n))
               if os.path.isdir(folder) else [])   # listed before the members are read: a
    live: set[tuple[int, int]] = set()              # socket is bound after its slot is taken
    for name in _ledger_names(folder):
        path = os.path.join(folder, name)
        try:
            ledger = Ledger(path, create=False)
        except SharedLedgerError as exc:
            _remove_refused(path, str(exc), removed, kept)
            continue
        try:
            with ledger.locked() as lg:
                if lg.remove_if_unused():
                    removed.append(path)
                else:
                    live.update((s.pid, s.token) for s in lg.slots(MEMBER) if lg.alive(s))
        except SharedLedgerError as exc:
            _remove_refused(path, str(exc), removed, kept)
        finally:
            ledger.close()
    for name in sockets:
        m = _SOCKET.fullmatch(name)
        assert m is not None
        path = os.path.join(folder, name)
        if (int(m.group(1)), int(m.group(2), 16)) not in live:
            try:
                if os.lstat(path).st_uid == os.getuid():
                    os.unlink(path)
                    removed.append(path)
            except OSError:
                pass
    return PruneResult(removed, kept)


def _remove_refused(path: str, why: str, removed: list[str],
                    kept: list[tuple[str, str]]) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if st.st_uid != os.getuid():
        kept.append((path, f"belongs to uid {st.st_uid}: not this user's to remove ({why})"))
        return
    try:
        os.unlink(path)
        removed.append(path)
    except OSError as exc:
        kept.append((path, f"cannot remove: {exc.strerror}"))
