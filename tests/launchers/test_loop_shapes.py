"""Loops shaped like public scripts resume bit-exactly, or stop with one line before training a step.

Every shape of ``scripts/loop_shapes.py`` (a Trainer class with argparse, as
pytorch/examples' tutorials are written) runs under ``ddpkit run nproc=2``:

- uninterrupted: the reference weights and global step;
- killed twice under ``max_restarts=2``: SIGKILL of rank 1 mid-epoch in the
  first round, then right after the code that follows an epoch's batch loop in
  the second (the checkpoint of that epoch's last step is the newest then);
- SIGTERM at an epoch's last step, then the same command again;
- the same again with the model sharded (``--shard``: FSDP2, sharded checkpoints), and two shapes sharded with
  their checkpoints written in the background (``--async-save``).

Each must end with the reference's weights (``torch.equal``) and global step.
Where the kill steps fall is drawn from ``random.Random(SEED)``.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parent / "scripts" / "loop_shapes.py"
SEED = 2311
STEPS_PER_EPOCH, EPOCHS = 6, 3
EXACT = [
    "readme",
    "step_sched",
    "epoch_sched",
    "peek",
    "from1",
    "no_set_epoch",
    "accum",
    "eval",
    "compiled",
    "big",
    "nanogpt",
    "imagenet",
    "gan",
]
SHARDED = EXACT[:10]
"""The shapes run again with the model sharded (FSDP2, sharded checkpoints); nanoGPT's, imagenet's and DCGAN's
are DDP scripts."""

_rng = random.Random(SEED)
MID_STEP = _rng.choice([s for s in range(2, STEPS_PER_EPOCH * 2) if s % STEPS_PER_EPOCH])
"""Global step after which rank 1 is killed in the first round (never an epoch's last)."""
END_EPOCH = _rng.randint(0, EPOCHS - 2)
"""The epoch after whose between-epoch code rank 1 is killed in the second round."""
TERM_STEP = STEPS_PER_EPOCH * _rng.randint(1, EPOCHS - 1)
"""The epoch's last global step at which rank 1 gets SIGTERM."""


def _run(
    commands: Commands,
    folder: Path,
    shape: str,
    *options: str,
    env: dict[str, str] | None = None,
    script_args: tuple[str, ...] = (),
):
    folder.mkdir(exist_ok=True)
    return commands.run(
        "run",
        "nproc=2",
        *options,
        str(SCRIPT),
        "--shape",
        shape,
        "--out",
        str(folder / "ckpt"),
        "--final",
        str(folder / "final.pt"),
        "--every-steps",
        "4",
        *script_args,
        cwd=folder,
        env=env,
    )


def _launcher_and_worker_lines(result, capsys) -> str:
    """The launcher's stderr: captured by Commands, and by pytest once the test runs (capsys replaces sys.stderr
    after the fixtures started); the workers' lines reach it through the launcher (ddpkit.launchers.output)."""
    return result.stderr + capsys.readouterr().err


def _final(folder: Path) -> dict:
    return torch.load(folder / "final.pt", weights_only=True)


def _assert_same(final: dict, reference: dict) -> None:
    assert final["global_step"] == reference["global_step"]
    differing = [k for k in reference["weights"] if not torch.equal(final["weights"][k], reference["weights"][k])]
    assert not differing, f"weights differ from the uninterrupted run's in {differing}"


@pytest.fixture
def commands():
    """A warm worker server for the test's launches (per test: the launcher's own lines are then captured)."""
    with Commands() as commands:
        yield commands


@pytest.mark.slow
@pytest.mark.parametrize("shape", EXACT)
def test_a_loop_shape_resumes_bit_exactly_after_kills_and_a_preemption(shape, commands, tmp_path, capsys):
    _kills_and_a_preemption(shape, commands, tmp_path, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("shape", SHARDED)
def test_a_sharded_loop_shape_resumes_bit_exactly_after_kills_and_a_preemption(shape, commands, tmp_path, capsys):
    _kills_and_a_preemption(shape, commands, tmp_path, capsys, "--shard")


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["readme", "eval"])
def test_a_sharded_loop_shape_saving_in_the_background_resumes_bit_exactly(shape, commands, tmp_path, capsys):
    _kills_and_a_preemption(shape, commands, tmp_path, capsys, "--shard", "--async-save")


def _kills_and_a_preemption(shape: str, commands: Commands, tmp_path: Path, capsys, *script_args: str) -> None:
    print(f"seed {SEED}: SIGKILL after step {MID_STEP}, after epoch {END_EPOCH}'s code; SIGTERM at step {TERM_STEP}")
    reference = _run(commands, tmp_path / "reference", shape, script_args=script_args)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    expected = _final(tmp_path / "reference")
    assert expected["global_step"] == STEPS_PER_EPOCH * EPOCHS

    second = f"epoch_end:{END_EPOCH + (shape == 'from1')}"
    if shape in ("peek", "nanogpt"):  # peek: a re-entered epoch has no batch to look at (README); nanogpt: no epochs
        second = f"step:{MID_STEP + STEPS_PER_EPOCH}"
    kills = {"KILLS": f"0:step:{MID_STEP},1:{second}"}
    killed = _run(commands, tmp_path / "killed", shape, "max_restarts=2", env=kills, script_args=script_args)
    assert killed.returncode == 0, killed.stdout + killed.stderr
    lines = _launcher_and_worker_lines(killed, capsys)
    assert lines.count("ddpkit: rank 1 was killed by SIGKILL; restarting the workers") == 2, lines
    assert "[rank 0/2] resumed from" in lines and "[rank 0/2] checkpoint" in lines
    for false_line in ("skip start.step_in_epoch", "training those batches twice", "hold tensors that differ"):
        assert false_line not in lines, f"{shape}: {false_line!r} is not true of this loop"
    _assert_same(_final(tmp_path / "killed"), expected)

    term = {"KILLS": f"0:step:{TERM_STEP}", "SIGNAL": "SIGTERM"}
    first = _run(commands, tmp_path / "preempted", shape, env=term, script_args=script_args)
    assert first.returncode == 75, first.stdout + first.stderr
    assert "run the same command again to continue" in _launcher_and_worker_lines(first, capsys)
    again = _run(commands, tmp_path / "preempted", shape, env=term, script_args=script_args)
    assert again.returncode == 0, again.stdout + again.stderr
    _assert_same(_final(tmp_path / "preempted"), expected)


@pytest.mark.slow
def test_epochs_numbered_from_1_off_by_one_stops_with_one_line_before_training(commands, tmp_path, capsys):
    # Killed after step 7: the newest checkpoint is epoch 1's (numbered from 1), complete at step 6.
    out = _run(commands, tmp_path, "from1_wrong", "max_restarts=1", env={"KILLS": "0:step:7"})
    assert out.returncode != 0
    lines = _launcher_and_worker_lines(out, capsys)
    assert "but the loop now calls set_epoch(" in lines and "start the loop at the epoch resume() returns" in lines, (
        lines
    )
    assert not (tmp_path / "final.pt").exists()


@pytest.mark.slow
def test_a_save_under_if_rank_0_fails_within_10_s_naming_the_fix(commands, tmp_path, capsys):
    start = time.monotonic()
    out = _run(commands, tmp_path, "rank0_save")
    assert out.returncode != 0
    assert time.monotonic() - start < 30  # the save itself is refused within ~1 s; the rest is start-up
    lines = _launcher_and_worker_lines(out, capsys)
    assert "was called on rank(s) [0] only: rank(s) [1] went on training past it" in lines, lines
    assert "not under `if rank == 0`" in lines
