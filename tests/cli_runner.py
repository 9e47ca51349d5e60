"""Running the real ``ddpkit`` command in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHONPATH = os.pathsep.join([str(REPO / "src"), str(REPO)])
"""PYTHONPATH of a child process: this checkout's ddpkit (not whatever the venv installed) and its tests."""


def run_ddpkit(
    *words: str, cwd: Path, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m ddpkit WORDS`` in ``cwd`` with the repository importable; never hangs past ``timeout``."""
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "ddpkit", *words], cwd=cwd, env=environ, capture_output=True, text=True, timeout=timeout
    )
