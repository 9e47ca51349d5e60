"""How checkpoints are named and laid out: the manifest's name and format, folder names, modes, the error.

The lowest part of the checkpoint format, read by the writer (:mod:`ddpkit.checkpoint.disk.format`) and the
reader (:mod:`ddpkit.checkpoint.disk.reading`) alike.
"""

from __future__ import annotations

import re

from ddpkit.errors import UserError

FORMAT = "ddpkit-checkpoint/2"
"""Value of the manifest's ``format`` key."""
MANIFEST = "manifest.json"
STEP_PREFIX = "step-"
BEST_PREFIX = "best-"
CORRUPT_SUFFIX = ".corrupt"
INCOMPLETE_SUFFIX = ".incomplete"
UNREADABLE_SUFFIX = ".unreadable"
NAME_PATTERN = re.compile(r"^(step|best)-(\d{9,})$")
SHARDED_KEY = "sharded"
"""The manifest's key for what a sharded checkpoint's DCP files hold: ``{"format": ..., "objects": [...]}``."""


class CheckpointError(UserError):
    """A checkpoint is missing, incomplete, corrupt or refused; the message names the file and the fix."""


def checkpoint_name(global_step: int) -> str:
    """The folder name of the checkpoint taken after ``global_step`` steps."""
    return f"{STEP_PREFIX}{global_step:09d}"


def folder_mode(file_mode: int) -> int:
    """The folder mode for ``file_mode``: every read permission also gets search permission."""
    return file_mode | ((file_mode & 0o444) >> 2)
