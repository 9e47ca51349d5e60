"""``ddpkit bench ...`` run through ``ddpkit.commands.dispatch.main`` in the test's own process.

The benchmark's own work still happens in fresh processes (each configuration,
launched workers); only the command's process is the test's, which has
imported torch already. Those processes import this checkout
(``tests.cli_runner.PYTHONPATH``), and everything written to file descriptor
1, by this process or by a worker it forks, is returned as the output.
Unlike tests/helpers/launch_in_process.py's ``Commands``, no worker server
is started for the block: most benchmark commands start only fresh
processes of their own, and one that launches workers starts its server.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile

import pytest

from ddpkit.commands.dispatch import main
from tests.cli_runner import PYTHONPATH


def run_main(*words: str) -> tuple[int, str]:
    """``ddpkit WORDS`` in-process: the exit status and what it (and the workers it started) printed."""
    with tempfile.TemporaryFile() as captured, pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", PYTHONPATH)
        sys.stdout.flush()
        saved = os.dup(1)
        try:
            os.dup2(captured.fileno(), 1)
            with open(1, "w", closefd=False) as stdout, contextlib.redirect_stdout(stdout):
                code = main(list(words))
                stdout.flush()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        return code, captured.read().decode()
