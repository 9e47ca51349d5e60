"""Hangs tell where: a wait that times out names where the stuck rank was, from its own stack dump."""

from __future__ import annotations

import faulthandler
import re
import threading
import time

import pytest

from ddpkit.stacks import innermost_frame
from tests.helpers.launch_in_process import Commands

SCRIPT = """
import os, signal, time
import torch
import ddpkit

ctx = ddpkit.init(timeout=20)
model = ddpkit.prepare_model(torch.nn.Linear(4, 2))
for step in range(5):
    model(torch.randn(8, 4)).sum().backward()  # the gradient all_reduce waits for every rank
    if step == 2 and ctx.rank == 1:
        {stuck}
print("done", ctx.rank)
"""
SLEEPS = "time.sleep(600)  # stuck inside a step"
STOPS = "os.kill(os.getpid(), signal.SIGSTOP)"


def _stuck_here(path) -> int:
    with open(path, "w") as f:
        faulthandler.dump_traceback(f, all_threads=True)  # the line named below
    return threading.get_ident()


def test_innermost_frame_of_the_main_thread_in_a_dump(tmp_path):
    path = tmp_path / "rank-1.txt"
    other = threading.Thread(target=time.sleep, args=(0.5,))
    other.start()
    ident = _stuck_here(path)
    other.join()
    text = path.read_text()
    assert text.count("(most recent call first):") >= 2  # this thread and the other
    line = _stuck_here.__code__.co_firstlineno + 2
    assert innermost_frame(text, ident) == f"{__file__}:{line} in _stuck_here"
    assert innermost_frame(text, other.ident).endswith(" in run")  # in time.sleep, called from Thread.run
    assert innermost_frame(text, 12345) == ""  # no such thread
    assert innermost_frame("", ident) == ""


@pytest.mark.slow
@pytest.mark.parametrize("stuck", [SLEEPS, STOPS], ids=["sleeping", "stopped"])
def test_a_stuck_rank_is_named_with_where_it_was_within_a_minute(tmp_path, stuck):
    (tmp_path / "script.py").write_text(SCRIPT.format(stuck=stuck))
    stacks = tmp_path / "stacks"
    started = time.monotonic()
    with Commands() as commands:
        out = commands.run("run", "nproc=2", "script.py", cwd=tmp_path, env={"DDPKIT_STACK_DIR": str(stacks)})
    took = time.monotonic() - started
    assert out.returncode == 1, out.stderr
    assert took < 60, f"the job took {took:.0f} s to end"
    error = [line for line in out.stderr.splitlines() if line.startswith("error: ")][0]
    assert (
        "error: worker rank 0 failed (exit code 1): RuntimeError: shm all_reduce: rank 1 did not arrive "
        "within 20.0 s" in error
    ), out.stderr
    if stuck == SLEEPS:
        match = re.search(r"; rank 1 was at script\.py:11 in <module> \(stack: (\S+)\)$", error)
        assert match, error
        assert match.group(1) == str(stacks / "rank-1.txt")
        dump = (stacks / "rank-1.txt").read_text()
        assert 'File "script.py", line 11 in <module>' in dump, dump
    else:
        assert re.search(
            r"; rank 1 \(pid \d+\) was stopped \(SIGSTOP\): no stack; it was continued so that it can "
            r"end$",
            error,
        ), error
