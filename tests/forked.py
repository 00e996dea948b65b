"""Waiting for a forked child without hanging the suite when the child hangs."""
from __future__ import annotations

import os
import signal
import time


def wait_for_child(pid: int, seconds: float) -> int | None:
    """The child's exit code (minus the signal number when a signal ended it), or None when it
    has not exited within ``seconds`` (it is then killed and reaped)."""
    deadline = time.monotonic() + seconds
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None
        time.sleep(0.002)
