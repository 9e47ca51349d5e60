"""How a worker process ends: output flushed and the exit code kept, with or without a job joined."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import sys
from ddpkit import distributed
distributed._joined_multiprocess_job = {joined}
print("written before the exit", end="")   # no newline: only a flush gets it out
print("and to stderr", end="", file=sys.stderr)
distributed.exit_process(3)
"""


@pytest.mark.parametrize("joined", [True, False])
def test_exit_process_flushes_output_and_keeps_the_code(joined):
    out = subprocess.run([sys.executable, "-c", SCRIPT.format(joined=joined)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 3
    assert out.stdout == "written before the exit" and out.stderr.endswith("and to stderr")
