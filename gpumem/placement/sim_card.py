"""One simulated card for the managers of one shared group in several processes.

Each process opens its own :class:`gpumem_sim.SimDevice` for ``"sim:2GiB"``; a manager that
joins a shared group makes its device one user of a card kept in the group's ledger
(:mod:`gpumem.placement.ledger`, a ``CARD`` slot per device holding the bytes it took from the
card). The device then sees the bytes of the other users as taken (``mem_get_info``) and every
allocation it makes is charged to the card under the ledger's lock, so four processes on
``sim:2GiB`` are four processes on one 2 GiB card. A device that joins no group reads nothing
of this (gpumem_sim stays deterministic within a process).

Thread safety: ``others`` and ``charge`` take the ledger's lock (the device calls them under
its own lock; the ledger's lock is never held while taking a device's).
"""
from __future__ import annotations

import os

from gpumem.placement.ledger import CARD, Ledger, SharedLedgerError, process_start_time

__all__ = ["SimCard"]


class SimCard:
    """A device's share of one simulated card (implements ``gpumem_sim.SharedCard``)."""

    def __init__(self, path: str, capacity: int) -> None:
        self.capacity = capacity
        self._ledger = Ledger(path)
        self._pid = os.getpid()
        try:
            with self._ledger.locked() as ledger:
                _, total = ledger.header()
                if total and total != capacity:
                    raise SharedLedgerError(
                        f"shared-budget ledger {path} is for a device of {total} bytes, not "
                        f"{capacity}")
                self._index = ledger.claim(CARD, self._pid, process_start_time(self._pid) or 0,
                                           int.from_bytes(os.urandom(8), "little")).index
        except BaseException:
            self._ledger.close()
            raise

    def others(self) -> int:
        """Bytes the card's other users hold now (their processes alive or not yet reaped)."""
        if os.getpid() != self._pid:
            return 0                                # a forked child shares no card
        with self._ledger.locked() as ledger:
            return sum(s.card_bytes for s in ledger.slots(CARD) if s.index != self._index)

    def charge(self, delta: int) -> bool:
        """Take (delta > 0) or give back bytes; False when the card has no room for them (the
        slots of dead processes are reaped before saying so)."""
        if os.getpid() != self._pid:
            return True
        with self._ledger.locked() as ledger:
            mine = ledger.slot(self._index)
            if delta > 0:
                for attempt in range(2):
                    held = sum(s.card_bytes for s in ledger.slots(CARD))
                    if held + delta <= self.capacity:
                        break
                    if attempt or not ledger.reap():
                        return False
            mine.card_bytes = max(0, mine.card_bytes + delta)
            ledger.write(mine)
            return True

    def close(self) -> None:
        """Leave the card (its slot freed); the device holds nothing by then."""
        if os.getpid() == self._pid:
            try:
                with self._ledger.locked() as ledger:
                    ledger.free_slot(self._index)
                    ledger.remove_if_unused()       # the group's last user removes the file
            except SharedLedgerError:
                pass                                # reaped once this process is gone
        self._ledger.close()
