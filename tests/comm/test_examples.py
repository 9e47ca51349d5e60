"""The point-to-point examples run as documented and print in the promised order."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(*command: str) -> str:
    result = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=EXAMPLES.parent)
    assert result.returncode == 0, f"{' '.join(command)} failed:\n{result.stdout}\n{result.stderr}"
    return result.stdout


@pytest.mark.slow
def test_ping_pong_alternates_in_order():
    lines = _run(sys.executable, str(EXAMPLES / "ping_pong.py")).splitlines()
    assert lines[:6] == [f"rank {i % 2} {'ping' if i % 2 == 0 else 'pong'}: ball = {i + 1}" for i in range(6)]
    assert re.fullmatch(r"latency \(half round trip, 4 bytes, gloo\): \d+ us", lines[6])


@pytest.mark.slow
def test_ordered_print_follows_rank_order():
    lines = _run(sys.executable, str(EXAMPLES / "ordered_print.py"), "3").splitlines()
    assert lines == [f"rank {r} of 3: my turn ({r})" for r in range(3)] + [
        f"rank {r} of 3: my turn in reverse" for r in (2, 1, 0)
    ]


@pytest.mark.slow
def test_blocking_and_nonblocking_swaps_both_deliver():
    out = _run(sys.executable, str(EXAMPLES / "blocking_vs_nonblocking.py"))
    assert re.search(r"^\s+blocking: swap 16 MiB \+ compute, median [\d.]+ ms$", out, re.M), out
    assert re.search(r"^non-blocking: swap 16 MiB \+ compute, median [\d.]+ ms$", out, re.M), out


@pytest.mark.slow
def test_examples_run_under_torchrun():
    torchrun = Path(sys.executable).with_name("torchrun")
    out = _run(str(torchrun), "--standalone", "--nproc-per-node", "2", str(EXAMPLES / "ping_pong.py"))
    assert "rank 1 pong: ball = 6" in out
