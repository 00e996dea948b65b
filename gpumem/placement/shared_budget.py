"""A memory budget shared by the processes of one user on one device (docs/shared_budget.md).

A manager configured with ``MemoryConfig(shared_group=...)`` joins the group's ledger
(:mod:`gpumem.placement.ledger`) as a *member*: one slot with what it holds from the device
(``reserved``) and how much of that is cached. A growth that would take the members' sum past
the budget first asks the others to release cached memory (a request written into their slots
and a one-byte wake-up sent to their watcher's socket), waits a bounded time for their
answers (:meth:`SharedBudget._poll`: a member that acknowledged the request up to
:data:`ANSWER_WAIT`, a running one up to :data:`ACK_WAIT` for its acknowledgement, a stopped
one :data:`REPLY_WAIT`, a dead one not at all), and is then allowed or refused; a refused growth goes on
down the manager's OOM ladder as before. Members whose process died are reaped when their share
is needed, so a SIGKILLed member stops counting at the next growth that needs its share.

Each member answers requests on a daemon *watcher* thread that sleeps in ``recv`` on its socket
(no GIL held, no polling): on a request it acknowledges it (with its exact cached figure), takes
its manager's slow-path lock (bounded), releases cached segments, writes its new figures while
it still holds that lock (never over a claim its manager's miss made meanwhile) and answers. The hit path never touches the ledger: the slot is
written on the miss path (``allow``, ``sync``), when cached memory is released and by the
watcher.

Thread safety: ``allow``, ``begin_miss`` and ``sync`` run under the manager's slow-path lock;
the watcher takes that lock (with a timeout) before releasing anything and never holds the
ledger's lock while waiting for it. ``leave`` may be called from any thread.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import os
import socket
import sys
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from gpumem.backends.base import DeviceKind
from gpumem.placement.ledger import (MEMBER, Ledger, SharedLedgerError, Slot, ledger_folder,
                                     ledger_path, process_start_time, process_stopped)
from gpumem.units import format_bytes

if TYPE_CHECKING:
    import threading as _threading

    from gpumem._core.pool import CachingPool
    from gpumem.backends.base import Device
    from gpumem.config import MemoryConfig
    from gpumem.placement.sim_card import SimCard

__all__ = ["SharedBudget", "GroupMember", "group_members", "REPLY_WAIT", "ACK_WAIT",
           "ANSWER_WAIT", "SharedLedgerError", "budget_bytes", "device_key"]

log = logging.getLogger("gpumem")

#: the longest a growth waits for a member that neither acknowledged its request nor is running
#: (stopped by SIGSTOP or a debugger)
REPLY_WAIT = 0.1
#: the longest it waits for a running member's watcher to acknowledge (scheduling delay on a
#: loaded machine: a runnable thread of 5 runnable per core waits tens of ms per turn, and its
#: wake-up then needs the GIL, up to a switch interval more per thread ahead of it)
ACK_WAIT = 2.0
#: the longest it waits for the answer of a member that acknowledged (its release takes its
#: manager's lock, ANSWER_LOCK_WAIT at most, and frees segments through the driver)
ANSWER_WAIT = 5.0
#: how long the watcher waits for its manager's slow-path lock before answering "busy"
ANSWER_LOCK_WAIT = 0.05
#: the interpreter's switch interval while a watcher answers (see _quick_switches)
ANSWER_SWITCH_INTERVAL = 1e-4
#: how often the polling requester looks at the ledger while it waits
_POLL = 0.0005
#: the watcher wakes at least this often (to notice that its manager is gone)
_WATCH_TIMEOUT = 1.0


class HeldPages(Protocol):
    """What a member reads of its expandable segments: the bytes of page handles the driver
    refused to free (still taken on the device)."""

    held_bytes: int


class Releaser(Protocol):
    """What a member needs of its manager: the pool's figures, the slow-path lock and the
    release of cached memory (the manager's SegmentGrowth)."""

    lock: _threading.RLock
    pool: CachingPool
    expandable: HeldPages | None

    def release_cached(self, max_bytes: int | None = None, *, reason: str = "",
                       small: bool | None = None) -> int: ...


@dataclass(frozen=True)
class GroupMember:
    """One member of a group as the ledger has it (for ``gpumem info`` and reports)."""

    pid: int
    reserved: int
    cached: int
    requests: int
    answered: int
    released: int
    alive: bool


def device_key(device: Device, total: int) -> str:
    """The name of a device in ledger file names: its string and total memory (two processes
    that see different cards under one name do not share a ledger)."""
    return f"{device.device_string}-{total}"


def budget_bytes(config: MemoryConfig, total: int, device_string: str) -> int:
    """The budget in bytes: a fraction of ``total``, or bytes no larger than it."""
    budget = config.shared_budget
    if budget is None:
        return total
    if isinstance(budget, float):
        return max(1, int(total * budget))
    if budget > total:
        raise SharedLedgerError(
            f"shared_budget {format_bytes(budget)} exceeds the {format_bytes(total)} of "
            f"{device_string}; give at most its total memory or a fraction in (0, 1]")
    return budget


def _socket_path(folder: str, pid: int, token: int) -> str:
    return os.path.join(folder, f"w{pid}-{token:016x}.sock")


class SharedBudget:
    """A manager's membership in a shared group (see the module docstring)."""

    def __init__(self, releaser: Releaser, device: Device, config: MemoryConfig,
                 total: int) -> None:
        self.group = config.shared_group
        self.hand_back = config.shared_hand_back
        self.device_string = device.device_string
        self.budget = budget_bytes(config, total, device.device_string)
        self.path = ledger_path(self.group, device_key(device, total))
        self._folder = ledger_folder()
        self._releaser = weakref.ref(releaser)
        self._pid = os.getpid()
        self._token = int.from_bytes(os.urandom(8), "little")
        self._asked: dict[int, int] = {}           # slot -> token asked during this miss
        self._closed = False
        self.requests_sent = 0                     # release requests this member wrote
        self.requests_answered = 0                 # requests of the others it answered
        #: seconds from each round of requests to its last answer (or the end of the wait)
        self.reply_seconds: collections.deque[float] = collections.deque(maxlen=1000)
        self._ledger = Ledger(self.path)
        self._sock: socket.socket | None = None
        self._card: SimCard | None = None
        self._index = -1                           # the slot, once claimed
        try:
            with self._ledger.locked() as ledger:
                reaped = ledger.reap()
                budget, known_total = ledger.header()
                live = [s for s in ledger.slots(MEMBER)]
                if live and (budget, known_total) != (self.budget, total):
                    raise SharedLedgerError(
                        f"shared group {self.group!r} on {self.device_string} (ledger "
                        f"{self.path}) has a budget of {format_bytes(budget)} for a device of "
                        f"{format_bytes(known_total)}; this process asks for "
                        f"{format_bytes(self.budget)} of {format_bytes(total)}: every member "
                        f"must give the same shared_budget")
                if not live and not any(True for _ in ledger.slots()):
                    ledger.set_header(self.budget, total)
                elif not live:
                    if known_total and known_total != total:
                        raise SharedLedgerError(
                            f"shared-budget ledger {self.path} is for a device of "
                            f"{known_total} bytes, not {total}")
                    ledger.set_header(self.budget, total)
                self._index = ledger.claim(MEMBER, self._pid,
                                           process_start_time(self._pid) or 0,
                                           self._token).index
            self._forget_sockets(reaped)
            self._sock = self._bind()
            if device.kind is DeviceKind.SIMULATED:
                self._share_card(device, total)
        except BaseException:
            if self._index >= 0:
                try:
                    with self._ledger.locked() as ledger:
                        ledger.free_slot(self._index)
                except SharedLedgerError:
                    pass                            # reaped once this process is gone
            self._abandon()
            raise
        self._watcher = threading.Thread(target=_watch, args=(self, self._sock),
                                         name=f"gpumem-shared-{self.group}", daemon=True)
        self._watcher.start()
        log.debug("%s joined shared group %r (budget %s, ledger %s)", self.device_string,
                  self.group, format_bytes(self.budget), self.path)

    def _forget_sockets(self, reaped: list[Slot]) -> None:
        """The wake-up sockets of reaped members (their processes are gone)."""
        for s in reaped:
            if s.kind == MEMBER:
                try:
                    os.unlink(_socket_path(self._folder, s.pid, s.token))
                except OSError:
                    pass

    def _bind(self) -> socket.socket:
        path = _socket_path(self._folder, self._pid, self._token)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(path)
            sock.settimeout(_WATCH_TIMEOUT)
        except OSError as exc:
            sock.close()
            raise SharedLedgerError(f"cannot make the wake-up socket {path} of shared group "
                                    f"{self.group!r}: {exc} (a shorter GPUMEM_SHARED_DIR "
                                    f"helps if the path is too long)") from None
        os.chmod(path, 0o600)
        return sock

    def _share_card(self, device: Any, total: int) -> None:
        """A simulated device that holds nothing yet becomes a user of the group's card."""
        if getattr(device, "shared_card", None) is not None or device.live_bytes:
            return
        from gpumem.placement.sim_card import SimCard
        card = SimCard(self.path, total)
        try:
            device.share_card(card)
        except Exception:
            card.close()
            raise
        self._card = card
        self._device = device

    # --- the miss path ---------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """False once left, and in a forked child (the slot is the parent's)."""
        return not self._closed and os.getpid() == self._pid

    def begin_miss(self) -> None:
        """A new miss: the members may be asked again."""
        self._asked.clear()

    def allow(self, seg_size: int, reserved: int, free: int, min_free: int,
              device_free: Callable[[], int], *, ask: bool = True) -> bool:
        """Whether this member may hold ``reserved + seg_size`` bytes: within the budget, and
        leaving ``min_free`` of the device's ``free`` memory (``device_free()`` reads it
        again). When allowed the bytes are claimed in the slot at once (``sync`` sets the true
        figure later). When not: dead members are reaped, then (with hand-back on) the others
        are asked to release cached memory, given a bounded time to answer (``_poll``), and both limits
        are checked again. Without ``ask`` (a size only worth having if it is free now) it
        neither reaps nor asks: False at once."""
        device_fits = free - seg_size >= min_free
        if not self.active:
            return device_fits
        need = reserved + seg_size
        with self._ledger.locked() as ledger:
            if device_fits and self._claim(ledger, need):
                return True
            if not ask:
                return False
            reaped = ledger.reap()                # a dead member's share is free at once
        self._forget_sockets(reaped)
        if reaped and not device_fits:            # (never read the device under the lock:
            free = device_free()                  # a shared sim card takes it too)
            device_fits = free - seg_size >= min_free
        with self._ledger.locked() as ledger:
            if device_fits and self._claim(ledger, need):
                return True
            if not self.hand_back:
                return False
            short = 0 if device_fits else seg_size + min_free - free
            asked = self._request(ledger, need, short)
        if not asked:
            return False
        start = time.monotonic()
        self._wake(asked)
        self._wait(asked, need if device_fits else None, start)
        if not device_fits and device_free() - seg_size < min_free:
            return False
        with self._ledger.locked() as ledger:
            return self._claim(ledger, need)

    def _others(self, ledger: Ledger) -> int:
        return sum(s.reserved for s in ledger.slots(MEMBER) if s.index != self._index)

    def _claim(self, ledger: Ledger, need: int) -> bool:
        if self._others(ledger) + need > self.budget:
            return False
        mine = ledger.slot(self._index)
        mine.reserved = max(mine.reserved, need)
        ledger.write(mine)
        return True

    def _request(self, ledger: Ledger, need: int,
                 device_short: int) -> list[tuple[int, int, int, int]]:
        """Under the lock: a release request in the slot of each other member that holds
        memory and was not asked during this miss (for what the budget or the device lacks);
        ``(slot, pid, token, sequence)`` of each."""
        deficit = max(self._others(ledger) + need - self.budget, device_short, 1)
        asked = []
        for s in ledger.slots(MEMBER):
            if s.index == self._index or s.reserved == 0 or self._asked.get(s.index) == s.token:
                continue
            pending = s.request_seq > s.answered_seq
            s.request_bytes = max(s.request_bytes, deficit) if pending else deficit
            s.request_seq += 1
            ledger.write(s)
            self._asked[s.index] = s.token
            asked.append((s.index, s.pid, s.token, s.request_seq))
        self.requests_sent += len(asked)
        return asked

    def _wake(self, asked: list[tuple[int, int, int, int]]) -> None:
        """One datagram to each asked member's watcher (a gone one is skipped)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.setblocking(False)
            for _, pid, token, _ in asked:
                try:
                    sock.sendto(b"r", _socket_path(self._folder, pid, token))
                except OSError:
                    pass        # gone (reaped later), or its queue is full: it has a wake-up

    def _wait(self, asked: list[tuple[int, int, int, int]], need: int | None,
              start: float) -> None:
        """Until every asked member answered (or left), the budget has room for ``need`` (None:
        the device's free memory is what lacks, so wait for the answers), or each member's
        bound passed (:meth:`_poll`). Requests to this member meanwhile are answered "busy" at
        once (it holds its own slow-path lock), so two members that ask each other never wait
        on each other."""
        try:
            self._poll(asked, need, start)
        finally:
            self.reply_seconds.append(time.monotonic() - start)

    def _poll(self, asked: list[tuple[int, int, int, int]], need: int | None,
              start: float) -> None:
        """The bound per asked member: none once it is gone (its liveness lock dropped);
        REPLY_WAIT while it has not acknowledged and its process is stopped; ACK_WAIT while it
        has not acknowledged but runs (its watcher waits for a core or the GIL); ANSWER_WAIT
        once it acknowledged (it is answering)."""
        waiting = {index: (pid, token, seq) for index, pid, token, seq in asked}
        pause = _POLL
        while waiting:
            time.sleep(pause)
            pause = min(pause * 2, 8 * _POLL)
            elapsed = time.monotonic() - start
            unacked = []
            with self._ledger.locked() as ledger:
                for index, (pid, token, seq) in list(waiting.items()):
                    s = ledger.slot(index)
                    if (s.kind != MEMBER or s.token != token or s.answered_seq >= seq
                            or not ledger.alive(s)):
                        del waiting[index]
                    elif s.acked_seq >= seq:
                        if elapsed > ANSWER_WAIT:
                            del waiting[index]
                    elif elapsed > ACK_WAIT:
                        del waiting[index]
                    elif elapsed > REPLY_WAIT:
                        unacked.append(index)
                mine = ledger.slot(self._index)
                if mine.request_seq > mine.answered_seq:
                    mine.answered_seq = mine.acked_seq = mine.request_seq
                    ledger.write(mine)
                if need is not None and self._others(ledger) + need <= self.budget:
                    return
            for index in unacked:                 # (/proc read outside the ledger's lock)
                if process_stopped(waiting[index][0]):
                    del waiting[index]

    def sync(self) -> None:
        """Write this member's true figures (reserved, cached) into its slot: after a growth or
        a release, and at the end of a miss (which drops an unused claim)."""
        releaser = self._releaser()
        if releaser is None or not self.active:
            return
        pool = releaser.pool
        cached = max(0, pool.reserved_bytes - pool.in_use_bytes)
        # pages the driver refused to free are still taken from the device: they count
        expandable = releaser.expandable
        reserved = pool.reserved_bytes + (expandable.held_bytes if expandable else 0)
        with self._ledger.locked() as ledger:
            mine = ledger.slot(self._index)
            mine.reserved, mine.cached = reserved, min(cached, reserved)
            ledger.write(mine)

    def drop_claim(self) -> None:
        """After a miss that raised: its claim dropped at once (the true figures written, under
        the manager's slow-path lock: the claim of another thread's miss stays). Never raises."""
        releaser = self._releaser()
        if releaser is None or not self.active:
            return
        try:
            with releaser.lock:
                self.sync()
        except SharedLedgerError as exc:          # the watcher's refresh writes it later
            log.warning("gpumem: shared group %r: %s", self.group, exc)

    def refresh(self) -> None:
        """The watcher's periodic update of the slot's figures (what was freed into the cache
        since the last miss shows in ``gpumem groups``); skipped while the manager's slow path
        runs, which may hold a claim that this would overwrite."""
        releaser = self._releaser()
        if releaser is None or not self.active or not releaser.lock.acquire(blocking=False):
            return
        try:
            self.sync()
        except SharedLedgerError as exc:
            log.warning("gpumem: shared group %r: %s", self.group, exc)
        finally:
            releaser.lock.release()

    # --- answering ---------------------------------------------------------------------------
    def answer(self) -> int:
        """Answer a pending release request (the watcher calls this): acknowledge it at once
        (with the exact cached figure), release up to the bytes asked for under the manager's
        slow-path lock (ANSWER_LOCK_WAIT at most, else "busy": 0 bytes), write the new figures
        before that lock is dropped, and mark the request answered; the bytes released."""
        if not self.active:
            return 0
        releaser = self._releaser()
        with self._ledger.locked() as ledger:
            mine = ledger.slot(self._index)
            if mine.request_seq <= mine.answered_seq:
                return 0
            seq, want = mine.request_seq, mine.request_bytes
            mine.acked_seq = seq
            if releaser is not None:              # cached only: reserved may hold a claim
                pool = releaser.pool
                mine.cached = min(max(0, pool.reserved_bytes - pool.in_use_bytes),
                                  mine.reserved)
            ledger.write(mine)
        released = 0
        with _quick_switches():
            if releaser is not None and releaser.lock.acquire(timeout=ANSWER_LOCK_WAIT):
                try:
                    released = releaser.release_cached(max(want, 1),
                                                       reason="a shared-budget member asked")
                except Exception as exc:  # the request is still answered (with 0 bytes)
                    log.warning("gpumem: %s: releasing cached memory for shared group %r "
                                "failed: %r", self.device_string, self.group, exc)
                try:
                    self.sync()                   # under the lock: no claim is overwritten
                finally:
                    releaser.lock.release()
            with self._ledger.locked() as ledger:
                mine = ledger.slot(self._index)
                mine.answered_seq = max(mine.answered_seq, seq)
                mine.released += released
                ledger.write(mine)
        self.requests_answered += 1
        return released

    def describe(self) -> str:
        """One line for an out-of-memory message: the group, its budget and what it holds."""
        try:
            members = [m for m in self.members() if m.alive]
        except SharedLedgerError as exc:
            return f"shared group {self.group!r}: {exc}"
        return (f"shared group {self.group!r}: budget {format_bytes(self.budget)}, "
                f"{len(members)} member(s) hold {format_bytes(sum(m.reserved for m in members))}"
                f" ({format_bytes(sum(m.cached for m in members))} cached)"
                f"{'' if self.hand_back else ', hand-back off'}")

    # --- figures -----------------------------------------------------------------------------
    def members(self) -> list[GroupMember]:
        """Every member in the ledger now (this one included)."""
        return group_members(self._ledger)

    # --- leaving -----------------------------------------------------------------------------
    def leave(self) -> None:
        """Leave the group: the slot freed, the watcher stopped, a shared card left once the
        device holds nothing. Idempotent; never raises."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return                                  # a forked child: the parent's slot
        try:
            with self._ledger.locked() as ledger:
                ledger.free_slot(self._index)
                if self._card is None:            # else the card's close removes the file
                    ledger.remove_if_unused()
        except SharedLedgerError as exc:
            log.warning("gpumem: leaving shared group %r: %s", self.group, exc)
        sock = self._sock
        if sock is not None:
            try:                                    # wake the watcher: it sees _closed and
                sock.sendto(b"q", sock.getsockname())   # ends (never waited for here)
            except OSError:
                pass
        self._abandon()

    def _abandon(self) -> None:
        if self._card is not None and self._device.unshare_card() is self._card:
            self._card.close()
            self._card = None
        sock, self._sock = self._sock, None
        if sock is not None:
            try:
                os.unlink(sock.getsockname())
            except OSError:
                pass
            sock.close()
        self._ledger.close()


_switch_lock = threading.Lock()
_switch_users = 0
_switch_saved = 0.0
_switch_quick = 0.0


@contextlib.contextmanager
def _quick_switches() -> Iterator[None]:
    """While a watcher answers, the interpreter's switch interval is ANSWER_SWITCH_INTERVAL:
    each time the answer drops the GIL (a driver call, a lock) a thread spinning in Python gets
    it, and would keep it a whole interval (5 ms by default) before the watcher could go on.
    The first of several answering watchers saves the interval, the last restores it (unless
    someone else changed it meanwhile)."""
    global _switch_users, _switch_saved, _switch_quick
    with _switch_lock:
        if _switch_users == 0:
            _switch_saved = sys.getswitchinterval()
            sys.setswitchinterval(min(_switch_saved, ANSWER_SWITCH_INTERVAL))
            _switch_quick = sys.getswitchinterval()    # as stored (whole microseconds)
        _switch_users += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users -= 1
            if _switch_users == 0 and sys.getswitchinterval() == _switch_quick:
                sys.setswitchinterval(_switch_saved)


def group_members(ledger: Ledger) -> list[GroupMember]:
    """The members of an open ledger, each marked alive (its liveness lock held) or not."""
    with ledger.locked() as lg:
        slots = [(s, lg.alive(s)) for s in lg.slots(MEMBER)]
    return [GroupMember(s.pid, s.reserved, s.cached, s.request_seq, s.answered_seq, s.released,
                        alive) for s, alive in slots]


def _watch(member: SharedBudget, sock: socket.socket) -> None:
    """The watcher of one member: sleeps in recv (no GIL held), answers requests, ends when the
    member left, or leaves for it once its manager is gone without close()."""
    while True:
        try:
            sock.recv(16)
            asked = True
        except socket.timeout:
            asked = False
        except OSError:
            return                                  # closed under us: the member left
        if member._closed:
            return
        if member._releaser() is None:
            member.leave()
            return
        try:
            if asked:
                member.answer()
            else:
                member.refresh()
        except Exception as exc:  # the watcher outlives any one failure (a corrupted ledger,
            if member._closed:    # the ledger closed by leave() meanwhile)
                return
            log.warning("gpumem: shared group %r: %r", member.group, exc)
