"""Simulated devices in several processes as one card (SimDevice.share_card).

A :class:`SharedCard` is kept outside gpumem_sim (gpumem's shared-budget ledger implements
it: ``gpumem.placement.sim_card``); a device that shares one counts the bytes the card's other
users hold as taken, and charges each byte it takes or gives back. Without a shared card a
device reads nothing of this, so it stays deterministic.
"""
from __future__ import annotations

import threading
from typing import Any, Protocol

from gpumem.errors import InvalidInputError

__all__ = ["SharedCard", "SharedCardUser"]


class SharedCard(Protocol):
    """One simulated card shared by devices in several processes (see SimDevice.share_card)."""

    def others(self) -> int:
        """Bytes the card's other users hold now."""
        ...

    def charge(self, delta: int) -> bool:
        """Record that this user takes (delta > 0) or gives back (< 0) bytes; False (nothing
        recorded) when taking them would pass the card's capacity."""
        ...


class SharedCardUser:
    """The shared-card calls of :class:`~gpumem_sim.device.SimDevice` (a mixin)."""

    # provided by SimDevice
    _lock: threading.Lock
    _live_bytes: int
    _card: Any
    device_string: Any

    def share_card(self, card: "SharedCard") -> None:
        """From now on this device is one of several (in several processes) that share one card
        of its capacity: ``card.others()`` bytes held by the others count as taken, and each
        byte this device takes or gives back is charged to ``card`` (``card.charge(n)`` returns
        False when the card has no room; the allocation then fails as out of memory). Only a
        device that holds nothing yet can join a card; InvalidInputError otherwise."""
        with self._lock:
            if self._card is not None:
                raise InvalidInputError(f"{self.device_string} already shares a card")
            if self._live_bytes:
                raise InvalidInputError(
                    f"{self.device_string} holds {self._live_bytes} bytes; only a device that "
                    f"holds nothing can join a shared card")
            self._card = card

    def unshare_card(self) -> "SharedCard | None":
        """Leave the shared card (only once this device holds nothing: the card's bytes stay
        charged otherwise); the card, or None when it shared none or still holds bytes."""
        with self._lock:
            card = self._card
            if card is None or self._live_bytes:
                return None
            self._card = None
            return card

    @property
    def shared_card(self) -> "SharedCard | None":
        return self._card

    def _card_others(self) -> int:
        """Bytes the card's other users hold (0 without a shared card). Lock held."""
        return 0 if self._card is None else self._card.others()

