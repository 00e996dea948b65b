"""The ledger of a shared memory budget: one small fixed-layout file per (group, device), mapped
into the memory of every process of one user that joins the group.

Layout (little-endian, :data:`FILE_SIZE` bytes): a header (magic, version, slot count, the
budget, the device's total memory) and :data:`SLOT_COUNT` slots. A slot is free, a *member* (one
MemoryManager: what it holds from the device, what of that is cached, the release requests
written to it and the ones it answered) or a *card* (a simulated device's bytes, so that the
simulated devices of one group in several processes are one card: :mod:`gpumem.placement.sim_card`).
Every slot names its process by pid and start time (``/proc/<pid>/stat``), so a slot whose process
died, SIGKILL included, or whose pid was reused, is recognised and reaped.

Nothing in the file is trusted: the folder and the file must belong to this user and be closed
to group and others, the size, magic and version must match, every number must be within
bounds; anything else raises :class:`~gpumem.errors.SharedLedgerError` naming the file.

Locking: an exclusive ``fcntl.flock`` on the file (the kernel drops it when its holder dies)
plus a ``threading.Lock`` for the threads of one process sharing one open file; both are taken
with a bounded wait (:data:`LOCK_TIMEOUT`), never without one. Under the lock only the mapping is
read and written (and ``/proc`` read to reap): no manager method, no driver call.

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
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Callable, Iterator

from gpumem.config import MAX_BYTES, SHARED_GROUP_NAME
from gpumem.errors import SharedLedgerError

__all__ = ["SharedLedgerError", "Ledger", "Slot", "MEMBER", "CARD", "FREE", "SLOT_COUNT",
           "FILE_SIZE", "ledger_folder", "ledger_path", "check_group_name", "process_start_time",
           "process_alive", "LOCK_TIMEOUT"]

MAGIC = b"GPUMEMLG"
VERSION = 1
#: header: magic, version, slot count, slot size, budget, device total, then reserved words
_HEADER = struct.Struct("<8sIIIxxxxQQ")
HEADER_SIZE = 64
#: slot: kind, flags, pid, start time, token, reserved, cached, card bytes, request sequence,
#: requested bytes, answered sequence, bytes released in answers (all time)
_SLOT = struct.Struct("<IIqQQQQQQQQQ")
SLOT_SIZE = 128
SLOT_COUNT = 64
FILE_SIZE = HEADER_SIZE + SLOT_COUNT * SLOT_SIZE
FREE, MEMBER, CARD = 0, 1, 2
#: the longest wait for the lock before giving up with an error (a live holder never keeps it
#: longer than a few microseconds; a dead one loses it to the kernel)
LOCK_TIMEOUT = 2.0
MAX_PID = 1 << 22           # Linux's pid_max ceiling

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

    def pack_into(self, buf: mmap.mmap) -> None:
        _SLOT.pack_into(buf, HEADER_SIZE + self.index * SLOT_SIZE, self.kind, self.flags,
                        self.pid, self.start, self.token, self.reserved, self.cached,
                        self.card_bytes, self.request_seq, self.request_bytes,
                        self.answered_seq, self.released)


def check_group_name(group: str) -> str:
    """The group name, or SharedLedgerError: it becomes part of a file name, so letters,
    digits, ``_ . -``, 1 to 64 characters, not starting with a dot or a dash."""
    if not isinstance(group, str) or not SHARED_GROUP_NAME.fullmatch(group):
        raise SharedLedgerError(
            f"shared_group must be 1 to 64 characters of letters, digits, '_', '.' or '-' (not "
            f"starting with '.' or '-'), got {group!r}")
    return group


def _check_folder(path: str) -> None:
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise SharedLedgerError(f"shared-budget folder {path} is not a directory (a symlink or "
                                f"a file); remove it or set GPUMEM_SHARED_DIR")
    if st.st_uid != os.getuid():
        raise SharedLedgerError(f"shared-budget folder {path} belongs to uid {st.st_uid}, not "
                                f"to this user (uid {os.getuid()}): not trusted")
    if st.st_mode & 0o077:
        raise SharedLedgerError(f"shared-budget folder {path} has mode "
                                f"{stat.S_IMODE(st.st_mode):o}; it must be closed to group and "
                                f"others (0700)")


def ledger_folder(create: bool = True) -> str:
    """The per-user folder of the ledgers, created with mode 0700 and checked: it must be this
    user's and closed to group and others. ``GPUMEM_SHARED_DIR``, else
    ``$XDG_RUNTIME_DIR/gpumem``, else ``/dev/shm/gpumem-<uid>``, else the temp folder's
    ``gpumem-<uid>``. ``create=False``: a folder that does not exist is not made (the path
    is returned unchecked)."""
    path = os.environ.get("GPUMEM_SHARED_DIR")
    if not path:
        runtime = os.environ.get("XDG_RUNTIME_DIR")
        if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == os.getuid():
            path = os.path.join(runtime, "gpumem")
        elif os.path.isdir("/dev/shm"):
            path = f"/dev/shm/gpumem-{os.getuid()}"
        else:
            path = os.path.join(tempfile.gettempdir(), f"gpumem-{os.getuid()}")
    if not create and not os.path.lexists(path):
        return path
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise SharedLedgerError(f"cannot create the shared-budget folder {path}: {exc}") from None
    _check_folder(path)
    return path


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


class Ledger:
    """One open ledger file, mapped (see the module docstring). ``open`` checks it; every read
    of a slot checks its numbers again."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._thread_lock = threading.Lock()
        flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
        try:
            self._fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SharedLedgerError(f"shared-budget ledger {path} is a symlink: not "
                                        f"trusted") from None
            raise SharedLedgerError(f"cannot open the shared-budget ledger {path}: "
                                    f"{exc.strerror}") from None
        self._map: mmap.mmap | None = None
        try:
            self._check_file()
            with self.locked():
                self._check_file()                # again: it may have changed meanwhile
                size = os.fstat(self._fd).st_size
                if size == 0:                     # new: lay it out while holding the lock
                    os.ftruncate(self._fd, FILE_SIZE)
                self._map = mmap.mmap(self._fd, FILE_SIZE)
                if size == 0:
                    _HEADER.pack_into(self._map, 0, MAGIC, VERSION, SLOT_COUNT, SLOT_SIZE, 0, 0)
                self._check_header()
        except BaseException:
            self.close()
            raise

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
                                    f"once no process of the group runs")

    def _check_header(self) -> None:
        assert self._map is not None
        magic, version, count, size, budget, total = _HEADER.unpack_from(self._map, 0)
        if magic != MAGIC:
            raise SharedLedgerError(f"shared-budget ledger {self.path} has a bad magic number "
                                    f"({magic!r}): corrupted or not a ledger; remove it once "
                                    f"no process of the group runs")
        if version != VERSION or count != SLOT_COUNT or size != SLOT_SIZE:
            raise SharedLedgerError(f"shared-budget ledger {self.path} has version {version} "
                                    f"({count} slots of {size} bytes); this gpumem writes "
                                    f"version {VERSION} ({SLOT_COUNT} of {SLOT_SIZE})")
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
        pause = 20e-6
        while True:
            try:
                _flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() > deadline:
                    self._thread_lock.release()
                    raise SharedLedgerError(
                        f"shared-budget ledger {self.path}: another process held its lock "
                        f"for {LOCK_TIMEOUT} s (a stopped process?)") from None
                time.sleep(pause)
                pause = min(pause * 2, 1e-3)
            except OSError as exc:
                self._thread_lock.release()
                raise SharedLedgerError(f"cannot lock the shared-budget ledger {self.path}: "
                                        f"{exc.strerror}") from None

    def _release(self) -> None:
        try:
            _flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._thread_lock.release()

    # --- header -----------------------------------------------------------------------------
    def header(self) -> tuple[int, int]:
        """``(budget, device total)`` (0, 0 until a member set them)."""
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
        """Slot ``index`` as read, its numbers checked (SharedLedgerError if out of bounds)."""
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
        """The used slots (of ``kind`` if given)."""
        for i in range(SLOT_COUNT):
            s = self.slot(i)
            if s.kind != FREE and (kind is None or s.kind == kind):
                yield s

    def write(self, slot: Slot) -> None:
        """Under the lock: store ``slot``."""
        assert self._map is not None
        slot.pack_into(self._map)

    def claim(self, kind: int, pid: int, start: int, token: int) -> Slot:
        """Under the lock: a free slot made ``kind`` for (pid, start, token); dead slots are
        reaped first when none is free."""
        for attempt in range(2):
            for i in range(SLOT_COUNT):
                s = self.slot(i)
                if s.kind == FREE:
                    new = Slot(i, kind, 0, pid, start, token, 0, 0, 0, 0, 0, 0, 0)
                    self.write(new)
                    return new
            if attempt == 0 and not self.reap():
                break
        raise SharedLedgerError(f"shared-budget ledger {self.path}: all {SLOT_COUNT} slots are "
                                f"used by live processes of the group")

    def free_slot(self, index: int) -> None:
        """Under the lock: slot ``index`` becomes free."""
        self.write(Slot(index, FREE, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))

    def reap(self) -> list[Slot]:
        """Under the lock: free the slots whose process is gone (or whose pid was reused); the
        slots as they were."""
        reaped = []
        for s in list(self.slots()):
            # this process's own slots stay (same start time); a reused pid's do not
            if not process_alive(s.pid, s.start):
                self.free_slot(s.index)
                reaped.append(s)
        return reaped

    def close(self) -> None:
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:
                pass
            self._map = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class _Locked:
    __slots__ = ("_ledger",)

    def __init__(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def __enter__(self) -> Ledger:
        self._ledger._acquire()
        return self._ledger

    def __exit__(self, *exc: object) -> None:
        self._ledger._release()
