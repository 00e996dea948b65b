"""Where a user's shared-budget ledgers live: one private folder per user, found the same way
by every process of that user, which another local user cannot take away.

The folder is ``GPUMEM_SHARED_DIR`` if set, else ``$XDG_RUNTIME_DIR/gpumem`` (a folder only
this user can write, made by the login manager), else ``/dev/shm/gpumem-<uid>`` (the temp
folder's ``gpumem-<uid>`` without /dev/shm). That last name is in a folder everyone may write,
so another local user can create it first (a folder of theirs, or a symlink) for a user who has
no ``XDG_RUNTIME_DIR`` (batch jobs, containers, ssh sessions without a login manager). Such a
plant is never trusted, and then every process of the user falls back, by the same rule, to a
folder under a base only this user (or root) can write: ``/run/user/<uid>/gpumem`` where the
login manager made ``/run/user/<uid>``, else ``~/.cache/gpumem/shared-<host>`` (the host in the
name: a home on a network file system is shared between hosts, ledgers must not be). A folder
that is this user's but open to others is an error, never a reason to move: only this user
could have made it so.

:func:`folder_choice` says which folder and why (``gpumem groups`` prints it).
"""
from __future__ import annotations

import os
import re
import socket
import stat
import tempfile
from dataclasses import dataclass

from gpumem.errors import SharedLedgerError

__all__ = ["FolderChoice", "folder_choice", "ledger_folder", "check_folder", "SHM_BASE",
           "RUN_USER_BASE"]

#: the world-writable base of the default folder (tests point these elsewhere)
SHM_BASE = "/dev/shm"
#: where a login manager makes each user's runtime folder
RUN_USER_BASE = "/run/user"


@dataclass(frozen=True)
class FolderChoice:
    """The ledger folder and why it is that one."""

    path: str
    why: str


def check_folder(path: str) -> None:
    """SharedLedgerError unless ``path`` is a real folder (not a symlink) of this user, closed
    to group and others."""
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


def _squatter(path: str) -> str | None:
    """Why ``path`` (in a world-writable base) was planted by someone else, or None if it is
    absent or this user's (a folder of this user's is checked by check_folder)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{path} is a symlink (owned by uid {st.st_uid})"
    if st.st_uid != os.getuid():
        return f"{path} belongs to uid {st.st_uid}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{path} is not a directory"
    return None


def _private_base(path: str) -> bool:
    """Whether ``path`` is a folder of this user (or root's) that nobody else can write."""
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and st.st_uid in (os.getuid(), 0)
            and not st.st_mode & 0o022)


def _fallback(reason: str) -> FolderChoice:
    uid = os.getuid()
    run = os.path.join(RUN_USER_BASE, str(uid))
    if _private_base(run) and os.stat(run).st_uid == uid:
        return FolderChoice(os.path.join(run, "gpumem"),
                            f"{reason}: not trusted; {run} is this user's runtime folder")
    home = os.path.expanduser("~")
    if _private_base(home) and os.stat(home).st_uid == uid:
        host = re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"
        return FolderChoice(os.path.join(home, ".cache", "gpumem", f"shared-{host}"),
                            f"{reason}: not trusted; falling back to this user's home")
    raise SharedLedgerError(f"shared-budget folder: {reason}, so it is not trusted, and there "
                            f"is no private fallback ({run} is absent, home {home} is not this "
                            f"user's or others can write it); set GPUMEM_SHARED_DIR to a folder "
                            f"only you can write")


def folder_choice() -> FolderChoice:
    """The folder of this user's ledgers and why (see the module docstring); the default
    folder is not made here, only looked at."""
    path = os.environ.get("GPUMEM_SHARED_DIR")
    if path:
        return FolderChoice(path, "GPUMEM_SHARED_DIR")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.stat(runtime).st_uid == os.getuid():
        return FolderChoice(os.path.join(runtime, "gpumem"), "XDG_RUNTIME_DIR")
    base = SHM_BASE if os.path.isdir(SHM_BASE) else tempfile.gettempdir()
    path = os.path.join(base, f"gpumem-{os.getuid()}")
    planted = _squatter(path)
    if planted is not None:
        return _fallback(planted)
    return FolderChoice(path, "default (no XDG_RUNTIME_DIR)")


def ledger_folder(create: bool = True) -> str:
    """The per-user folder of the ledgers (:func:`folder_choice`), made with mode 0700 and
    checked. ``create=False``: a folder that does not exist is not made (the path is returned
    unchecked)."""
    choice = folder_choice()
    path = choice.path
    if not create and not os.path.lexists(path):
        return path
    try:
        if choice.why.startswith("default"):
            os.mkdir(path, 0o700)
        else:
            os.makedirs(path, 0o700)
    except FileExistsError:
        # planted between the look and the mkdir: the same rule as for an older plant
        if choice.why.startswith("default") and _squatter(path) is not None:
            return ledger_folder(create)
    except OSError as exc:
        raise SharedLedgerError(f"cannot create the shared-budget folder {path}: {exc}") from None
    check_folder(path)
    return path
