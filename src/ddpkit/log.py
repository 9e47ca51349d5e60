"""Rank-aware logging: every line says ``[rank r/w]``; rank 0 speaks by default.

Under ``ddpkit run`` and ``ddpkit train nproc=N`` (several workers) the
launcher prefixes every line a worker writes with the same ``[rank r/w]``
(:mod:`ddpkit.launchers.output`) and says so in :data:`PREFIXED_VARIABLE`; the
logger then leaves its own out, so that a line carries one prefix.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

if TYPE_CHECKING:
    _StreamHandler = logging.StreamHandler[TextIO]
else:  # subscriptable at run time from Python 3.11 only
    _StreamHandler = logging.StreamHandler

_LOGGER_NAME = "ddpkit"

PREFIXED_VARIABLE = "DDPKIT_PREFIXED"
"""Set to 1 by ddpkit's launcher for workers whose every output line it prefixes with ``[rank r/w]``."""
TERMINAL_VARIABLE = "DDPKIT_TERMINAL"
"""Set to 1 by ddpkit's launcher for workers whose stderr it shows on a terminal (their own is a file)."""


def rank_prefix(rank: int, world_size: int) -> str:
    """``[rank r/w] ``: how a line of rank r of w starts, on the console and in ddpkit's log messages."""
    return f"[rank {rank}/{world_size}] "


def stderr_is_terminal(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process's stderr ends on a terminal: its own, or the launcher's that shows it."""
    return sys.stderr.isatty() or environ.get(TERMINAL_VARIABLE) == "1"


class _RankFilter(logging.Filter):
    def __init__(self, rank: int, world_size: int, environ: Mapping[str, str] = os.environ):
        super().__init__()
        self.prefix = "" if environ.get(PREFIXED_VARIABLE) == "1" else rank_prefix(rank, world_size)

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank_prefix = self.prefix
        return True


def setup_logging(rank: int, world_size: int, all_ranks: bool = False) -> logging.Logger:
    """Configure ddpkit's logger for this worker and return it.

    Args:
        rank: this worker's global rank.
        world_size: number of workers.
        all_ranks: let every rank log at INFO (otherwise only rank 0 does;
            the others log warnings and errors).
    """
    logger = logging.getLogger(_LOGGER_NAME)
    logger.handlers.clear()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
    handler.addFilter(_RankFilter(rank, world_size))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO if rank == 0 or all_ranks else logging.WARNING)
    logger.propagate = False
    prefix = f"[rank {rank}/{world_size}]"
    warnings.formatwarning = functools.partial(_one_line_warning, prefix)
    return logger


def _one_line_warning(
    prefix: str, message: Warning | str, category: type[Warning], filename: str, lineno: int, line: str | None = None
) -> str:
    """A Python warning (torch's, a library's) as one line with the rank, like ddpkit's own lines: the message and
    where it came from, without the source line and path that the default format adds."""
    text = " ".join(str(message).split())
    origin = Path(filename).name
    return f"{prefix} warning: {text} ({category.__name__}, {origin}:{lineno})\n"


class _UnlessConfigured(_StreamHandler):
    """Writes to stderr only while the program has set up no logging of its own (no root handler)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def show_messages(rank: int, world_size: int) -> None:
    """Let ddpkit's messages reach the terminal of a script that did not set up logging.

    Rank 0's at INFO (checkpoints written, resumed from), the other ranks'
    warnings and errors, each line prefixed ``[rank r/w]``. A script's own
    logging setup wins: with a root handler, the records go to it instead.
    Nothing changes where ddpkit's logger has handlers already.
    """
    logger = logging.getLogger(_LOGGER_NAME)
    if logger.handlers:
        return
    handler = _UnlessConfigured(sys.stderr)
    handler.setFormatter(logging.Formatter("%(rank_prefix)s%(message)s"))
    handler.addFilter(_RankFilter(rank, world_size))
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO if rank == 0 else logging.WARNING)


def get_logger() -> logging.Logger:
    """ddpkit's logger (configured by setup_logging)."""
    return logging.getLogger(_LOGGER_NAME)
