"""A rank SIGKILLed mid-run under torchrun (c10d and static rendezvous) and ``ddpkit run``: the restart ends bit-equal.

The script (tests/launch/scripts/own_bn.py) is a user's own loop on the
public API: DataLoader workers, BatchNorm, AdamW + OneCycleLR, ``no_sync``
accumulation, a Checkpointer. torch's agent keeps its store across restarts,
and a restarted round that formed its group on the same keys read the dead
round's gloo addresses (pytorch/pytorch#135712); ddpkit.init forms each
round's group under a token of its own (ddpkit.round_store). Where the kill
falls is drawn from ``random.Random(SEED)``; benchmarks/restarts.py runs ten
rounds of each launcher.
"""

from __future__ import annotations

import random

import pytest

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
