"""Leak checks for tests: which buffers a manager still holds, as a message a person can act on."""
from __future__ import annotations

import contextlib
from typing import Any

from gpumem.units import format_bytes

__all__ = ["leak_report", "assert_no_leaks", "shared_managers_on", "close_shared_managers_on",
           "shared_config_changes"]


def leak_report(manager: Any, *, at: str = "the end of the test") -> str:
    """``""`` when ``manager`` holds no live buffer (or is closed), else what is left: each
    buffer's tag, size and age when the manager tracks allocations, the count and bytes
    otherwise."""
    if manager.closed:
        return ""
    stats = manager.stats()
    if stats.active_buffers == 0:
        return ""
    tracker = getattr(manager, "tracker", None)
    if tracker is not None:
        text = tracker.format_report(at)
        if text:
            return text
    return (f"{stats.active_buffers} buffer(s) still live on {manager.device_string} at {at}: "
            f"{format_bytes(stats.in_use_bytes - stats.pending_free_bytes)} on the device, "
            f"{format_bytes(stats.fallback_bytes)} in CPU fallback (a manager with "
            f"track_allocations=True names each buffer)")


def assert_no_leaks(manager: Any, *, at: str = "the end of the test") -> None:
    """Raise AssertionError with :func:`leak_report` when ``manager`` holds live buffers."""
    text = leak_report(manager, at=at)
    if text:
        raise AssertionError(text)


def shared_managers_on(device_strings: Any) -> list[Any]:
    """The open shared managers (``gpumem.get_manager``) of these devices; none where this
    gpumem has no shared managers."""
    try:
        from gpumem.placement.shared import shared_managers
    except ImportError:
        return []
    wanted = set(device_strings)
    return [m for key, m in shared_managers().items() if key in wanted]


def close_shared_managers_on(device_strings: Any) -> None:
    """Close the shared managers of these devices: the next ``get_manager`` makes a fresh one
    (on a fresh simulated device after the plug-in installed new ones). Their leaks were
    reported by :func:`leak_report`: close() does not log them again."""
    for manager in shared_managers_on(device_strings):
        if getattr(manager, "tracker", None) is not None:
            manager.tracker.clear()
        manager.close()


def shared_config_changes(device_strings: Any, **changes: Any) -> Any:
    """A context in which the shared managers made on these devices get these MemoryConfig
    changes (none where this gpumem has no shared managers)."""
    try:
        from gpumem.placement.shared import config_changes_for
    except ImportError:
        return contextlib.nullcontext()
    return config_changes_for(list(device_strings), **changes)
