"""The ledger of a shared memory budget: one small fixed-layout file per (group, device), mapped
into the memory of every process of one user that joins the group.

Layout (little-endian, :data:`FILE_SIZE` bytes): a header (magic, version, slot count, the
budget, the device's total memory) and :data:`SLOT_COUNT` slots. A slot is free, a *member* (one
MemoryManager: what it holds from the device, what of that is cached, the release requests
written to it, the ones it acknowledged and the ones it answered) or a *card* (a simulated
device's bytes, so that the simulated devices of one group in several processes are one card:
:mod:`gpumem.placement.sim_card`).

Liveness: the open file that claimed a slot holds an open-file-description lock (``F_OFD_SETLK``)
on one byte past the end of the file, one byte per slot. Only that open file can hold it: the
kernel drops it when the process dies (SIGKILL included; a zombie holds nothing) or ``exec``s
(the descriptors are close-on-exec), and a forked child drops its copy at once (see below). A
slot whose byte is not locked is reaped, whatever pid it names (a pid reused, a pid forged, an
exec'd member). Where the kernel has no OFD locks, the pid and start time decide (the older,
weaker rule).

Nothing in the file is trusted: the folder (:mod:`gpumem.placement.ledger_folder`) and the
file must belong to this user and be closed to group and others, the size, magic and version
must match, every number must be within bounds; anything else raises
:class:`~gpumem.errors.SharedLedgerError` naming the file.

Locking: an exclusive ``flock`` on the file plus a ``threading.Lock`` for the threads of one
process sharing one open file; both are taken with a bounded wait (:data:`LOCK_TIMEOUT`). Under
the lock only the mapping is read and written (and the liveness locks asked): no manager method,
no driver call. flock and OFD locks belong to the open file description, which ``fork`` shares
with the child, and the mapping holds it as well; so a child keeping them would keep the lock of
a parent killed mid-update, and the parent's slot alive. POSIX record locks are not shared with
a child, but any ``close`` of the file by the process drops them and they do not exclude the
threads or the several open ledgers of one process, so they cannot serve. Instead a forked
child unmaps and closes its copies of every ledger at once (``os.register_at_fork``; a child
forked from C without that hook does so the first time it uses the ledger); a ledger object
used in the child opens the file again, as a non-member (a child is a member only if it
joins).

The last user of a ledger removes the file (:meth:`Ledger.remove_if_unused`, under the lock); a
process that then takes the lock on a file no longer at its path opens the path again, so no
one joins a removed ledger.

Thread safety: every method of :class:`Ledger` may be called from any thread.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import re
import stat
import struct
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Callable, Iterator

from gpumem.config import MAX_BYTES, SHARED_GROUP_NAME
from gpumem.errors import SharedLedgerError
from gpumem.placement.ledger_folder import ledger_folder

__all__ = ["SharedLedgerError", "Ledger", "Slot", "MEMBER", "CARD", "FREE", "SLOT_COUNT",
           "FILE_SIZE", "ledger_folder", "ledger_path", "check_group_name", "process_start_time",
           "process_alive", "process_stopped", "LOCK_TIMEOUT", "VERSION"]

MAGIC = b"GPUMEMLG"
#: 2: liveness by OFD locks, the acknowledged sequence (version 1 members would be reaped)
VERSION = 2
#: header: magic, version, slot count, slot size, budget, device total, then reserved words
_HEADER = struct.Struct("<8sIIIxxxxQQ")
HEADER_SIZE = 64
#: slot: kind, flags, pid, start time, token, reserved, cached, card bytes, request sequence,
#: requested bytes, answered sequence, bytes released in answers (all time), acknowledged
#: sequence (the member's watcher woke up for the request and is answering it)
_SLOT = struct.Struct("<IIqQQQQQQQQQQ")
SLOT_SIZE = 128
SLOT_COUNT = 64
FILE_SIZE = HEADER_SIZE + SLOT_COUNT * SLOT_SIZE
FREE, MEMBER, CARD = 0, 1, 2
#: the longest wait for the lock before giving up with an error (a live holder never keeps it
#: longer than a few microseconds; a dead one loses it to the kernel)
LOCK_TIMEOUT = 2.0
MAX_PID = 1 << 22           # Linux's pid_max ceiling
#: the liveness lock of slot i is byte LIVE_OFFSET + i (past the end: no data is locked)
LIVE_OFFSET = FILE_SIZE
#: struct flock for F_OFD_* (Linux: short type, short whence, off_t start, off_t len, pid_t pid)
_FLOCK = struct.Struct("hhqqi4x")

assert _HEADER.size <= HEADER_SIZE and _SLOT.size <= SLOT_SIZE


def _gil_holding_flock() -> Callable[[int, int], None]:
    """flock(2) called without releasing the GIL (ctypes.PyDLL), where libc has it: a
    non-blocking flock returns in microseconds, and a thread that drops the GIL here while
    another spins in Python waits a whole switch interval (5 ms) to get it back. Elsewhere
    fcntl.flock."""
    try:
        libc = ctypes.PyDLL(None, use_errno=True)
        call = libc.flock
        call.argtypes = (ctypes.c_int, ctypes.c_int)
        call.restype = ctypes.c_int
    except (OSError, AttributeError):
        return fcntl.flock

    def flock(fd: int, operation: int) -> None:
        while call(fd, operation) != 0:
            err = ctypes.get_errno()
            if err != errno.EINTR:
                raise OSError(err, os.strerror(err)) if err not in (
                    errno.EAGAIN, errno.EWOULDBLOCK) else BlockingIOError(err, os.strerror(err))
    return flock


_flock = _gil_holding_flock()


@dataclass
class Slot:
    """One slot of the ledger as read (see the module docstring)."""

    index: int
    kind: int
    flags: int
    pid: int
    start: int
    token: int
    reserved: int
    cached: int
    card_bytes: int
    request_seq: int
    request_bytes: int
    answered_seq: int
    released: int
    acked_seq: int = 0

    def pack_into(self, buf: mmap.mmap) -> None:
        _SLOT.pack_into(buf, HEADER_SIZE + self.index * SLOT_SIZE, self.kind, self.flags,
                        self.pid, self.start, self.token, self.reserved, self.cached,
                        self.card_bytes, self.request_seq, self.request_bytes,
                        self.answered_seq, self.released, self.acked_seq)


def check_group_name(group: str) -> str:
    """The group name, or SharedLedgerError: it becomes part of a file name, so letters,
    digits, ``_ . -``, 1 to 64 characters, not starting with a dot or a dash."""
    if not isinstance(group, str) or not SHARED_GROUP_NAME.fullmatch(group):
        raise SharedLedgerError(
            f"shared_group must be 1 to 64 characters of letters, digits, '_', '.' or '-' (not "
            f"starting with '.' or '-'), got {group!r}")
    return group


def ledger_path(group: str, device_key: str) -> str:
    """The ledger file of ``group`` on the device named ``device_key``."""
    # no dot in the device part: the group's name ends at the last dot (gpumem groups)
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", device_key)[:64]
    return os.path.join(ledger_folder(), f"{check_group_name(group)}.{safe}.ledger")


def process_start_time(pid: int) -> int | None:
    """The start time of ``pid`` (clock ticks since boot, /proc/<pid>/stat field 22); None when
    the process is gone or a zombie (a SIGKILLed child its parent has not waited for yet);
    0 where there is no /proc (liveness then rests on the pid alone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return 0
    except OSError:
        return None
    fields = data[data.rfind(b")") + 2:].split()
    if not fields or fields[0] in (b"Z", b"X"):
        return None
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def process_alive(pid: int, start: int) -> bool:
    """Whether the process recorded as (pid, start time) still runs (not a reused pid)."""
    now = process_start_time(pid)
    return now is not None and (start == 0 or now == 0 or now == start)


def process_stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (SIGSTOP, a debugger; /proc/<pid>/stat state T or t): it
    cannot answer until someone continues it. False where unknown."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return False
    return data[data.rfind(b")") + 2:][:1] in (b"T", b"t")



#: whether the kernel has OFD locks (cleared at the first EINVAL: the older liveness rule then)
_ofd_locks = hasattr(fcntl, "F_OFD_SETLK") and hasattr(fcntl, "F_OFD_GETLK")
#: every open Ledger of this process, so that a forked child can drop them (see module docstring)
_open_ledgers: "weakref.WeakSet[Ledger]" = weakref.WeakSet()


class Ledger:
    """One open ledger file, mapped (see the module docstring). Opening checks it; every read
    of a slot checks its numbers again. ``create=False``: a missing file is an error, not made
    (for readers such as ``gpumem groups``)."""

    def __init__(self, path: str, *, create: bool = True) -> None:
        self.path = path
        self._create = create
        self._thread_lock = threading.Lock()
        self._pid = os.getpid()
        self._fd = -1
        self._map: mmap.mmap | None = None
        #: slot index -> token of the slots whose liveness lock this open file holds
        self._held: dict[int, int] = {}
        self._closed = False
        _open_ledgers.add(self)
        try:
            with self.locked():
                pass                              # opened, mapped and checked under the lock
        except BaseException:
            self.close()
            raise

    # --- opening ----------------------------------------------------------------------------
    def _open_file(self) -> None:
        flags = (os.O_RDWR | (os.O_CREAT if self._create else 0) | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0))
        try:
            self._fd = os.open(self.path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SharedLedgerError(f"shared-budget ledger {self.path} is a symlink: not "
                                        f"trusted") from None
            raise SharedLedgerError(f"cannot open the shared-budget ledger {self.path}: "
                                    f"{exc.strerror}") from None
        try:
            self._check_file()
        except BaseException:
            self._close_file()
            raise

    def _map_file(self) -> None:
        """Under the flock: the file checked again (it may have changed since the open), laid
        out if new, mapped and its header checked."""
        self._check_file()
        size = os.fstat(self._fd).st_size
        if size == 0:
            if not self._create:
                raise SharedLedgerError(f"shared-budget ledger {self.path} is empty")
            os.ftruncate(self._fd, FILE_SIZE)
        self._map = mmap.mmap(self._fd, FILE_SIZE)
        if size == 0 or (self._create and self._older_and_unused()):
            self._map[:] = bytes(FILE_SIZE)
            _HEADER.pack_into(self._map, 0, MAGIC, VERSION, SLOT_COUNT, SLOT_SIZE, 0, 0)
        self._check_header()

    def _older_and_unused(self) -> bool:
        """A ledger an older gpumem wrote (version 1: the same slots without the acknowledged
        sequence, members proven alive by pid and start time) none of whose members runs: laid
        out again, as a new one, rather than refused (an upgrade would otherwise lock a user out
        of a group until ``gpumem groups --prune``). One with a live member is refused."""
        assert self._map is not None
        magic, version, count, size, _, _ = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC or version != 1 or count != SLOT_COUNT or size != SLOT_SIZE:
            return False
        for index in range(SLOT_COUNT):
            kind, _, pid, start = struct.unpack_from("<IIqQ", self._map,
                                                     HEADER_SIZE + index * SLOT_SIZE)
            if kind != FREE and process_alive(pid, start):
                return False
        return True

    def _names_this_file(self) -> bool:
        """Whether the path still names the open file (the last user may have removed it)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return False
        mine = os.fstat(self._fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)

    def _close_file(self) -> None:
        self._held.clear()                        # closing the file drops the liveness locks
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()
            except BufferError:
                pass
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _drop_in_child(self, new_lock: bool = True) -> None:
        """In a forked child: no copy of the parent's open file is kept (it would keep the
        parent's flock and liveness locks); the next use opens the path again."""
        if new_lock:
            self._thread_lock = threading.Lock()  # a thread of the parent may have held it
        self._pid = os.getpid()
        self._held = {}
        m, self._map = self._map, None
        if m is not None:
            try:
                m.close()                         # the child's copy of the mapping
            except BufferError:                   # (a view of it kept somewhere): at least
                _detach_fds_of(self._fd)          # its descriptor copy goes
        if self._fd >= 0:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1

    # --- trust ------------------------------------------------------------------------------
    def _check_file(self) -> None:
        st = os.fstat(self._fd)
        if not stat.S_ISREG(st.st_mode):
            raise SharedLedgerError(f"shared-budget ledger {self.path} is not a regular file")
        if st.st_uid != os.getuid():
            raise SharedLedgerError(f"shared-budget ledger {self.path} belongs to uid "
                                    f"{st.st_uid}, not to this user (uid {os.getuid()}): "
                                    f"not trusted")
        if st.st_mode & 0o077:
            raise SharedLedgerError(f"shared-budget ledger {self.path} has mode "
                                    f"{stat.S_IMODE(st.st_mode):o}; it must be 0600 (readable "
                                    f"and writable by this user only): not trusted")
        if st.st_size not in (0, FILE_SIZE):
            raise SharedLedgerError(f"shared-budget ledger {self.path} is {st.st_size} bytes, "
                                    f"not {FILE_SIZE}: truncated or not a ledger; remove it "
                                    f"(gpumem groups --prune) once no process of the group runs")

    def _check_header(self) -> None:
        assert self._map is not None
        magic, version, count, size, budget, total = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise SharedLedgerError(f"shared-budget ledger {self.path} has a bad magic number "
                                    f"({magic!r}): corrupted or not a ledger; remove it "
                                    f"(gpumem groups --prune) once no process of the group runs")
        if version != VERSION or count != SLOT_COUNT or size != SLOT_SIZE:
            raise SharedLedgerError(f"shared-budget ledger {self.path} has version {version} "
                                    f"({count} slots of {size} bytes); this gpumem writes "
                                    f"version {VERSION} ({SLOT_COUNT} of {SLOT_SIZE}); remove it "
                                    f"(gpumem groups --prune) once no process of the group runs")
        for what, value in (("budget", budget), ("device total", total)):
            if value > MAX_BYTES:
                raise SharedLedgerError(f"shared-budget ledger {self.path}: {what} {value} is "
                                        f"out of bounds (at most 2**62): corrupted")
        if budget > total:
            raise SharedLedgerError(f"shared-budget ledger {self.path}: budget {budget} exceeds "
                                    f"the device total {total}: corrupted")

    # --- the lock ---------------------------------------------------------------------------
    def locked(self) -> "_Locked":
        return _Locked(self)

    def _acquire(self) -> None:
        deadline = time.monotonic() + LOCK_TIMEOUT
        if not self._thread_lock.acquire(timeout=LOCK_TIMEOUT):
            raise SharedLedgerError(f"shared-budget ledger {self.path}: another thread of this "
                                    f"process held its lock for {LOCK_TIMEOUT} s")
        try:
            if self._closed:                      # (never re-made once its user closed it)
                raise SharedLedgerError(f"shared-budget ledger {self.path} is closed")
            if os.getpid() != self._pid:          # a child forked without the at-fork hook
                self._drop_in_child(new_lock=False)
            for _ in range(16):
                if self._fd < 0:
                    self._open_file()
                self._flock_until(deadline)
                try:
                    # a file whose last user removed it is joined by no one: open the path
                    # again (a file holding a slot of ours is never removed by gpumem)
                    if self._held or self._names_this_file():
                        if self._map is None:
                            self._map_file()
                        return
                except BaseException:
                    _flock(self._fd, fcntl.LOCK_UN)
                    raise
                _flock(self._fd, fcntl.LOCK_UN)
                self._close_file()
            raise SharedLedgerError(f"shared-budget ledger {self.path} was removed or replaced "
                                    f"16 times while this process opened it")
        except BaseException:
            if self._map is None:
                self._close_file()
            self._thread_lock.release()
            raise

    def _flock_until(self, deadline: float) -> None:
        pause = 20e-6
        while True:
            try:
                _flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise SharedLedgerError(
                        f"shared-budget ledger {self.path}: another process held its lock "
                        f"for {LOCK_TIMEOUT} s (a stopped process?)") from None
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
            except OSError as exc:
                raise SharedLedgerError(f"cannot lock the shared-budget ledger {self.path}: "
                                        f"{exc.strerror}") from None

    def _release(self) -> None:
        try:
            _flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    # --- header -----------------------------------------------------------------------------
    def header(self) -> tuple[int, int]:
        """Under the lock: ``(budget, device total)`` (0, 0 until a member set them)."""
        assert self._map is not None
        self._check_header()
        _, _, _, _, budget, total = _HEADER.unpack_from(self._map, 0)
        return budget, total

    def set_header(self, budget: int, total: int) -> None:
        """Under the lock: the group's budget and device total (by the first member)."""
        assert self._map is not None
        _HEADER.pack_into(self._map, 0, MAGIC, VERSION, SLOT_COUNT, SLOT_SIZE, budget, total)

    # --- slots ------------------------------------------------------------------------------
    def slot(self, index: int) -> Slot:
        """Under the lock: slot ``index`` as read, its numbers checked (SharedLedgerError if
        out of bounds)."""
        assert self._map is not None
        s = Slot(index, *_SLOT.unpack_from(self._map, HEADER_SIZE + index * SLOT_SIZE))
        if s.kind == FREE:
            return s
        bad = None
        if s.kind not in (MEMBER, CARD):
            bad = f"kind {s.kind}"
        elif not 0 < s.pid < MAX_PID:
            bad = f"pid {s.pid}"
        else:
            for name in ("reserved", "cached", "card_bytes", "request_bytes", "released"):
                if getattr(s, name) > MAX_BYTES:
                    bad = f"{name} {getattr(s, name)}"
            if s.cached > s.reserved:
                bad = f"cached {s.cached} above reserved {s.reserved}"
        if bad is not None:
            raise SharedLedgerError(f"shared-budget ledger {self.path}: slot {index} has "
                                    f"{bad}, out of bounds: corrupted; remove the file once no "
                                    f"process of the group runs")
        return s

    def slots(self, kind: int | None = None) -> Iterator[Slot]:
        """Under the lock: the used slots (of ``kind`` if given)."""
        for i in range(SLOT_COUNT):
            s = self.slot(i)
            if s.kind != FREE and (kind is None or s.kind == kind):
                yield s

    def write(self, slot: Slot) -> None:
        """Under the lock: store ``slot``."""
        assert self._map is not None
        slot.pack_into(self._map)

    def claim(self, kind: int, pid: int, start: int, token: int) -> Slot:
        """Under the lock: a free slot made ``kind`` for (pid, start, token), kept alive by this
        open file's liveness lock until :meth:`free_slot` or the file is closed; dead slots are
        reaped first when none is free."""
        for attempt in range(2):
            for i in range(SLOT_COUNT):
                s = self.slot(i)
                if s.kind == FREE and self._hold(i):
                    new = Slot(i, kind, 0, pid, start, token, 0, 0, 0, 0, 0, 0, 0)
                    self.write(new)
                    self._held[i] = token
                    return new
            if attempt == 0 and not self.reap():
                break
        raise SharedLedgerError(f"shared-budget ledger {self.path}: all {SLOT_COUNT} slots are "
                                f"used by live processes of the group")

    def free_slot(self, index: int) -> None:
        """Under the lock: slot ``index`` becomes free (its liveness lock dropped if ours)."""
        self.write(Slot(index, FREE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
        if self._held.pop(index, None) is not None and _ofd_locks:
            self._lock_byte(index, fcntl.F_UNLCK)

    def alive(self, s: Slot) -> bool:
        """Under the lock: whether slot ``s``'s owner still holds it: its liveness lock is
        held (by this open file, or another one), else (no OFD locks) its pid and start time
        name a running process."""
        if self._held.get(s.index) == s.token:
            return True
        if _ofd_locks:
            held = self._lock_held(s.index)
            if held is not None:
                return held
        return process_alive(s.pid, s.start)

    def reap(self) -> list[Slot]:
        """Under the lock: free the slots whose owner is gone (dead, exec'd, a reused or a
        forged pid); the slots as they were."""
        reaped = []
        for s in list(self.slots()):
            if not self.alive(s):
                self.free_slot(s.index)
                reaped.append(s)
        return reaped

    def remove_if_unused(self) -> bool:
        """Under the lock: when no slot is used once the dead are reaped, the file is removed
        (the lock is kept until released; a process that then takes it opens the path again).
        Whether it was removed."""
        self.reap()
        if any(True for _ in self.slots()) or not self._names_this_file():
            return False
        try:
            os.unlink(self.path)
        except OSError:
            return False
        return True

    # --- liveness locks ---------------------------------------------------------------------
    def _hold(self, index: int) -> bool:
        """Take slot ``index``'s liveness lock; False when another open file holds it (a slot
        written free by hand while its owner lives: not ours to take)."""
        global _ofd_locks
        if not _ofd_locks:
            return True
        try:
            self._lock_byte(index, fcntl.F_WRLCK)
            return True
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                return False
            if exc.errno in (errno.EINVAL, errno.ENOLCK, errno.EOPNOTSUPP):
                _ofd_locks = False                # the older rule: pid and start time
                return True
            raise SharedLedgerError(f"cannot lock slot {index} of the shared-budget ledger "
                                    f"{self.path}: {exc.strerror}") from None

    def _lock_byte(self, index: int, kind: int) -> None:
        fcntl.fcntl(self._fd, fcntl.F_OFD_SETLK,
                    _FLOCK.pack(kind, os.SEEK_SET, LIVE_OFFSET + index, 1, 0))

    def _lock_held(self, index: int) -> bool | None:
        """Whether another open file holds slot ``index``'s liveness lock (None: unknown)."""
        try:
            got = fcntl.fcntl(self._fd, fcntl.F_OFD_GETLK,
                              _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, LIVE_OFFSET + index, 1, 0))
        except OSError:
            return None
        return _FLOCK.unpack(got)[0] != fcntl.F_UNLCK

    def close(self) -> None:
        """Close the file (its liveness locks go with it). Idempotent."""
        self._closed = True
        _open_ledgers.discard(self)
        self._close_file()


class _Locked:
    __slots__ = ("_ledger",)

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def __enter__(self) -> Ledger:
        self._ledger._acquire()
        return self._ledger

    def __exit__(self, *exc: object) -> None:
        self._ledger._release()


def _detach_fds_of(fd: int) -> None:
    """Point every descriptor of this process on the same file as ``fd`` at /dev/null (a
    forked child whose mapping object could not be closed: its hidden descriptor copy must not
    keep the parent's open file, and its number must stay taken)."""
    try:
        target = os.fstat(fd)
        null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return
    try:
        for name in os.listdir("/proc/self/fd"):
            try:
                other = int(name)
                st = os.fstat(other)
            except (ValueError, OSError):
                continue
            if other != null and (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
                os.dup2(null, other, inheritable=False)
    except OSError:
        pass
    finally:
        os.close(null)


def _after_fork_in_child() -> None:
    for ledger in list(_open_ledgers):
        ledger._drop_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
