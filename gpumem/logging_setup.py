"""Where the ``gpumem`` logger's records go when gpumem runs as a program (the CLI).

The library itself only logs (and installs a NullHandler in ``gpumem/__init__.py``); an
application chooses the handlers. :func:`configure_logging` is that choice for the ``gpumem``
command: WARNING and above on stderr as ``gpumem: warning: ...``, DEBUG too with ``-v``.
"""
from __future__ import annotations

import logging
import sys
from typing import TextIO

__all__ = ["configure_logging", "remove_handler"]


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        msg = record.getMessage()
        level = record.levelname.lower()
        if record.exc_info:
            msg += "\n" + self.formatException(record.exc_info)
        return f"gpumem: {level}: {msg}"


def configure_logging(verbose: int = 0, stream: TextIO | None = None) -> logging.Handler:
    """Attach a stderr handler to the ``gpumem`` logger (DEBUG when ``verbose`` > 0, else
    WARNING) and return it, so the caller can :func:`remove_handler` it again."""
    logger = logging.getLogger("gpumem")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(_Formatter())
    level = logging.DEBUG if verbose > 0 else logging.WARNING
    handler.setLevel(level)
    logger.addHandler(handler)
    handler._gpumem_old_level = logger.level  # type: ignore[attr-defined]
    logger.setLevel(min(level, logger.level) if logger.level else level)
    return handler


def remove_handler(handler: logging.Handler) -> None:
    logger = logging.getLogger("gpumem")
    logger.removeHandler(handler)
    logger.setLevel(getattr(handler, "_gpumem_old_level", logging.NOTSET))
    handler.close()
