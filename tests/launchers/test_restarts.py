"""A rank SIGKILLed mid-run under torchrun (c10d and static rendezvous) and ``ddpkit run``: the restart ends bit-equal.

The script (tests/launchers/scripts/own_bn.py) is a user's own loop on the
public API: DataLoader workers, BatchNorm, AdamW + OneCycleLR, ``no_sync``
accumulation, a Checkpointer. torch's agent keeps its store across restarts,
and a restarted round that formed its group on the same keys read the dead
round's gloo addresses (pytorch/pytorch#135712); ddpkit.init forms each
round's group under a token of its own (ddpkit.round_store). Where the kill
falls is drawn from ``random.Random(SEED)``; benchmarks/restarts.py runs ten
rounds of each launcher.

Every process of a ``ddpkit run`` job shares the launcher's multiprocessing
folder (``/tmp/pymp-*``: a child inherits it), which the launcher removes
as it exits. A DataLoader worker that sends a batch holds a listener socket
in it, which it unlinks when it exits. A worker orphaned by a killed rank
used to notice within 5 s and then exit, after a quick restart's launcher
had removed the folder: a ``FileNotFoundError`` traceback after a
successful run. The kernel now kills such workers with their rank
(``PR_SET_PDEATHSIG``); one test makes that race certain.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest

from tests.cli_runner import PYTHONPATH
from tests.helpers.restarts import LAUNCHERS, STEPS, launch

SEED = 2026
_rng = random.Random(SEED)
KILL_AT, KILL_RANK = _rng.randint(2, STEPS - 1), _rng.randint(0, 1)
"""Where the SIGKILL falls: after optimizer step KILL_AT, on rank KILL_RANK."""


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The final weights of one uninterrupted ``ddpkit run nproc=2``."""
    out = launch("ddpkit-run", tmp_path_factory.mktemp("reference"))
    assert out.returncode == 0 and out.weights is not None, out.output
    return out.weights


@pytest.mark.slow
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_killed_rank_is_restarted_and_the_run_ends_bit_equal(launcher, reference, tmp_path):
    print(f"seed {SEED}: SIGKILL to rank {KILL_RANK} after optimizer step {KILL_AT} under {launcher}")
    out = launch(launcher, tmp_path, KILL_AT, KILL_RANK)
    assert out.returncode == 0, out.output
    assert f"rank {KILL_RANK}: sending myself SIGKILL after step {KILL_AT}" in out.output
    # Resumed from the checkpoint of the step before the kill (every_steps=1), by both ranks of the restart.
    for rank in (0, 1):
        assert f"rank {rank}: start epoch={(KILL_AT - 1) // 6} global_step={KILL_AT - 1} resumed=True" in out.output
    assert "connectFullMesh" not in out.output
    assert not out.differing(reference), f"final weights differ in {out.differing(reference)}"


ORPHANS_SCRIPT = """
import os, signal, time
import torch
import ddpkit

ctx = ddpkit.init()
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    loader = ddpkit.DataLoader(torch.utils.data.TensorDataset(torch.arange(64.0)), global_batch_size=4, num_workers=2)
    batches = iter(loader)  # kept: a dropped iterator would stop its workers before the kill
    next(batches)  # each worker has sent a batch: it holds a listener in the launcher's folder
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # until the launcher stops this round
print(f"rank {ctx.rank} restart {os.environ['TORCHELASTIC_RESTART_COUNT']} done", flush=True)
"""


@pytest.mark.slow
def test_dataloader_workers_of_a_killed_round_leave_no_traceback_after_a_quick_restart(tmp_path):
    # The restarted round ends at once, so the launcher exits (and removes its folder) within about a second
    # of the kill: the killed round's DataLoader workers, orphans for up to 5 s before, ran their finalizers
    # after that in every run. Output is read to its end: a process still holding the pipe is waited for.
    (tmp_path / "script.py").write_text(ORPHANS_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "ddpkit", "run", "nproc=2", "max_restarts=1", "show_ranks=all", "script.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert out.returncode == 0, out.stderr
    assert "rank 1 was killed by SIGKILL; restarting the workers (restart 1 of 1)" in out.stderr
    assert "rank 0 restart 1 done" in out.stdout and "rank 1 restart 1 done" in out.stdout, out.stdout
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
