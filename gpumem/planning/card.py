"""What a card of a given size leaves to each allocator, by the backend's own rule.

``gpumem tune`` plans for a card (``4GiB`` of some kind), but no allocator on that card has all
of it: the driver and one context take their share first. Both allocators have what those
leave, by one rule: on a real CUDA card gpumem measures it (``cuMemGetInfo`` once the context
exists: ``CudaDevice.recommended_reserve``) and PyTorch's caching allocator simply has what the
driver gives; planning without the card, tune assumes the same 500 MiB for the driver and 100 MiB
for the context for both (docs/backends.md, "Usable-memory reserve"). gpumem's own limits
(``gpu_memory_fraction``, ``min_free_bytes``) apply on top inside the replay, where at their
defaults they are soft (docs/pressure_and_oom.md). :class:`Card` turns the card into the
capacities the replays run on (a private simulated device of that size), and says so in words
for the output.

Thread safety: a Card is immutable; nothing here touches a driver.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpumem.errors import InvalidInputError
from gpumem.units import MiB, format_bytes, parse_size

__all__ = ["Card", "CARD_KINDS", "card_size", "sim_device"]

#: device kinds whose usable-memory rule tune applies (CUDA's is the default)
CARD_KINDS = ("cuda", "sim")


def _cuda_reserve(total: int) -> int:
    # what the driver and one context take, the estimate CudaDevice.recommended_reserve falls
    # back on (on a card it measures them); importing it touches no driver. The same for both
    # allocators: neither keeps a margin of its own beyond its soft limits
    from gpumem.backends.cuda_driver import usable_memory_reserve
    return usable_memory_reserve(total, fraction=0.0)


def _sim_reserve(total: int) -> int:
    from gpumem.observe.replay import open_replay_device
    return open_replay_device(f"sim:{total}B").recommended_reserve(total)


@dataclass(frozen=True)
class Card:
    """A card of ``total`` bytes of kind ``kind`` (``"cuda"`` or ``"sim"``)."""

    total: int
    kind: str = "cuda"

    def __post_init__(self) -> None:
        if self.kind not in CARD_KINDS:
            raise InvalidInputError(f"card kind must be one of {', '.join(CARD_KINDS)}, got "
                                    f"{self.kind!r}")
        if isinstance(self.total, bool) or not isinstance(self.total, int) or self.total <= 0:
            raise InvalidInputError(f"card size must be an int > 0 bytes, got {self.total!r}")

    def resized(self, total: int) -> "Card":
        """The same kind of card with ``total`` bytes."""
        return Card(total, self.kind)

    @property
    def gpumem_reserve(self) -> int:
        """Bytes a gpumem manager leaves alone on this card by default (the backend's advice)."""
        if self.kind == "cuda":
            return _cuda_reserve(self.total)
        return _sim_reserve(self.total)

    @property
    def gpumem_bytes(self) -> int:
        """What gpumem has on this card, rounded down to whole MiB (so that ``sim:<n>MiB``, as
        the output writes it, is exactly the device tune replayed on): the capacity of the
        simulated device its rows are replayed on."""
        return (self.total - self.gpumem_reserve) // MiB * MiB

    @property
    def gpumem_device(self) -> str:
        """The device string of that simulated device, ``"sim:3086MiB"``."""
        return sim_device(self.gpumem_bytes)

    @property
    def torch_bytes(self) -> int:
        """What PyTorch's caching allocator has on this card (the driver and one context
        taken, on CUDA; all of a simulated card)."""
        if self.kind == "cuda":
            return (self.total - _cuda_reserve(self.total)) // MiB * MiB
        return self.total

    def capacity_for(self, allocator: str) -> int:
        """The replay capacity of ``allocator`` (``"gpumem"`` or ``"torch"``) on this card."""
        return self.torch_bytes if allocator == "torch" else self.gpumem_bytes

    def describe(self) -> str:
        """``"a 4.00 GiB CUDA card"``."""
        return f"a {format_bytes(self.total)} {'CUDA' if self.kind == 'cuda' else 'simulated'} card"

    def explain(self) -> list[str]:
        """Lines saying what each allocator was assumed to have on this card, and why."""
        fb = format_bytes
        if self.kind == "cuda":
            why = (f"the card less {fb(self.gpumem_reserve)} for the driver and one context, "
                   f"as PyTorch; on a real card gpumem measures what they take, "
                   f"docs/backends.md")
            torch_why = (f"the card less {fb(self.total - self.torch_bytes)} for the driver "
                         f"and context; PyTorch keeps no reserve of its own")
        else:
            why = f"the sim backend advises a reserve of {fb(self.gpumem_reserve)}"
            torch_why = "all of a simulated card"
        return [f"gpumem has {fb(self.gpumem_bytes)} of {self.describe()} ({why}): its rows "
                f"are replayed on {self.gpumem_device} with their own "
                f"settings (gpu_memory_fraction, min_free_bytes, max_pool_size apply there too: "
                f"soft at their defaults, hard where a row sets them)",
                f"PyTorch has {fb(self.torch_bytes)} ({torch_why})"]


def sim_device(nbytes: int) -> str:
    """A private simulated device of exactly ``nbytes``: ``"sim:3086MiB"``, else in bytes."""
    return f"sim:{nbytes // MiB}MiB" if nbytes % MiB == 0 else f"sim:{nbytes}B"


def card_size(device: str | int) -> int:
    """Bytes of the card to plan for: ``"24GiB"``, ``"sim:24GiB"`` or an int."""
    if isinstance(device, int) and not isinstance(device, bool):
        if device <= 0:
            raise InvalidInputError(f"card size must be > 0 bytes, got {device}")
        return device
    if not isinstance(device, str):
        raise InvalidInputError(f"card must be a size such as '24GiB' or 'sim:24GiB', got "
                                f"{type(device).__name__} {device!r}")
    from gpumem.backends import private_device_size
    spec = device.strip()
    if ":" in spec:                       # "sim:24GiB"; any other device string names no size
        spec = private_device_size(spec) or ""
    if not spec or spec.isdigit() or ":" in spec:
        raise InvalidInputError(f"device {device!r} has no size: tune plans for a card of a "
                                f"given size, e.g. --card 24GiB (or --device sim:24GiB)")
    cap = parse_size(spec, what=f"card {device!r} size")
    if cap <= 0:
        raise InvalidInputError(f"card {device!r}: the size must be > 0 bytes")
    return cap
