"""The Checkpointer keeps its promises about loops ported from public scripts, under ``ddpkit run nproc=2``.

Each trap runs ``scripts/ckptresume_loop.py`` (see its docstring for the shapes):

- pytorch/examples' DCGAN shape: torch's DataLoader over a DistributedSampler given as ``loader=``, no
  ``epoch_end()``, a block on the batch counter from ``ckpt.enumerate(loader)``: killed mid-epoch and
  right after an epoch's last step, restarted, it ends with the uninterrupted run's weights (``torch.equal``);
- a loop without epochs: ``close()`` writes the steps after the last cadence, and the next launch resumes there;
- one true line, and nothing lost, for: ``best_metric`` that no ``epoch_end()`` gives, a Checkpointer made
  before ``ddpkit.init()``, a checkpoint folder that is a file, a 2-worker checkpoint resumed by 1 worker
  without a loader (and ``ddpkit checkpoints`` lists its epoch without a made-up length).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint.disk.format import list_checkpoints, read_manifest
from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ckptresume_loop.py"
STEPS_PER_EPOCH, EPOCHS = 5, 3
MID_EPOCH_KILL = 7
"""Killed before step 7 is counted: resumed from step 6, one batch into the second epoch."""
EPOCH_END_KILL = 11
"""Killed before step 11 is counted: resumed from step 10, the second epoch's last, before its scheduler step."""


def _run(commands: Commands, folder: Path, shape: str, *args: str, nproc: int = 2, options=(), env=None, out="ck"):
    folder.mkdir(exist_ok=True)
    return commands.run(
        "run",
        f"nproc={nproc}",
        *options,
        str(SCRIPT),
        "--shape",
        shape,
        "--out",
        out,
        "--final",
        "final.pt",
        *args,
        cwd=folder,
        env=env,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every launch of this module, in one Commands block, by name (and the folders they ran in)."""
    root = tmp_path_factory.mktemp("ckptresume")
    results: dict = {"root": root}
    with Commands() as commands:
        results["reference"] = _run(commands, root / "reference", "torch_loader")
        for name, step in (("mid_epoch", MID_EPOCH_KILL), ("epoch_end", EPOCH_END_KILL)):
            env = {"KILL_AT_STEP": str(step)}
            results[name] = _run(
                commands, root / name, "torch_loader", options=("max_restarts=1", "show_ranks=all"), env=env
            )
        results["plain_enumerate"] = _run(
            commands, root / "plain", "plain_enumerate", options=("max_restarts=1",), env={"KILL_AT_STEP": "7"}
        )
        results["close_first"] = _run(commands, root / "close", "no_epochs", "--every", "5", "--steps", "22")
        results["close_listing"] = [info.global_step for info in list_checkpoints(root / "close" / "ck")]
        results["close_again"] = _run(commands, root / "close", "no_epochs", "--every", "5", "--steps", "22")
        results["close_no_cadence"] = _run(commands, root / "no_cadence", "no_epochs", "--every", "0")
        results["best"] = _run(commands, root / "best", "best")
        results["before_init"] = _run(commands, root / "before_init", "before_init")
        (root / "file").mkdir()
        (root / "file" / "afile.txt").write_text("notes\n")
        results["file"] = _run(commands, root / "file", "no_epochs", out="afile.txt")
        results["world_2"] = _run(commands, root / "world", "no_epochs", "--every", "0", "--steps", "35")
        results["world_1"] = _run(commands, root / "world", "no_epochs", "--every", "0", "--steps", "40", nproc=1)
        results["listing"] = commands.run("checkpoints", "ck", cwd=root / "world")
    return results


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return torch.load(folder / "final.pt", weights_only=True)


def _log(out) -> str:
    return out.stdout + out.stderr


@pytest.mark.parametrize(
    "name, start",
    [("mid_epoch", "epoch=1 step_in_epoch=1"), ("epoch_end", f"epoch=1 step_in_epoch={STEPS_PER_EPOCH}")],
)
def test_a_torch_dataloader_loop_killed_and_resumed_ends_bit_identical(runs, name, start):
    reference, out = runs["reference"], runs[name]
    assert reference.returncode == 0, _log(reference)
    assert out.returncode == 0, _log(out)
    assert f"rank 0: start {start}" in out.stdout
    assert "sending myself SIGKILL" in out.stdout
    expected, got = _weights(runs["root"] / "reference"), _weights(runs["root"] / name)
    differing = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not differing, f"final weights differ from the uninterrupted run's in {differing}"


def test_the_resume_line_says_where_a_torch_dataloader_loop_continues(runs):
    assert "(global step 6: 1 epoch(s) complete and 1 of 5 steps of the next: ckpt.enumerate(loader) skips them)" in (
        _log(runs["mid_epoch"])
    )
    assert "(global step 10: 1 epoch(s) complete and all 5 steps of the next: the code after its batch loop runs " in (
        _log(runs["epoch_end"])
    )


def test_a_resumed_torch_dataloader_loop_without_ckpt_enumerate_is_told_once_at_its_first_step(runs):
    out = runs["plain_enumerate"]
    assert out.returncode == 0, _log(out)
    line = (
        "resumed 1 batch(es) into epoch 1 of a torch DataLoader, and the loop took a step without iterating "
        "ckpt.enumerate(loader)"
    )
    assert _log(out).count(line) == 1, _log(out)
    assert _log(runs["mid_epoch"]).count(line) == 0


def test_close_writes_the_steps_after_the_last_cadence_and_the_next_launch_resumes_there(runs):
    first, again = runs["close_first"], runs["close_again"]
    assert first.returncode == 0, _log(first)
    assert runs["close_listing"] == [20, 22]  # keep=2: the cadence's last, and close()'s
    assert "checkpoint ck/step-000000022 (final)" in _log(first)
    assert again.returncode == 0, _log(again)
    assert "resumed from ck/step-000000022 (global step 22); the run that wrote it had finished there" in _log(again)
    assert "checkpoint ck/" not in _log(again)  # nothing trained, nothing written
    # Without a loader= nor epoch_end(), the resume line says that no epochs are counted, and the fix for a loop
    # that has them (a torch DataLoader's, whose ResumePoint would otherwise count steps past its epoch's length).
    assert (
        "no epochs are counted (no loader=, no epoch_end()): a loop over the epochs of a DataLoader passes it as "
        "loader= to continue at its epoch and batch" in _log(again)
    )


def test_close_writes_a_loop_without_any_cadence(runs):
    out = runs["close_no_cadence"]
    assert out.returncode == 0, _log(out)
    manifest = read_manifest(runs["root"] / "no_cadence" / "ck" / "step-000000022")
    assert (manifest["reason"], manifest["finished"]) == ("final", True)


def test_best_metric_without_epoch_end_is_said_once_when_the_first_epoch_is_saved(runs):
    out = runs["best"]
    assert out.returncode == 0, _log(out)
    line = (
        "best_metric='accuracy' but no epoch_end() call gave it: no best-* checkpoint is written; "
        "call ckpt.epoch_end({'accuracy': value}) after each epoch's evaluation"
    )
    assert _log(out).count(line) == 1
    # Said at the first checkpoint after the first epoch's end, before the second epoch's checkpoints.
    assert _log(out).index(line) < _log(out).index("checkpoint ck/step-000000006")


def test_a_checkpointer_made_before_init_names_the_fix(runs):
    out = runs["before_init"]
    assert out.returncode != 0
    assert (
        "the Checkpointer was made before the process group (WORLD_SIZE=2 but ddpkit.init() has not run): "
        "call ddpkit.init() before ddpkit.Checkpointer(...)" in out.stderr
    )
    assert "in use by another run" not in _log(out)
    assert "Traceback" not in out.stderr


def test_a_checkpoint_folder_that_is_a_file_is_refused_before_training(runs):
    out = runs["file"]
    assert out.returncode != 0
    assert "checkpoint folder afile.txt is a file; pass the path of a folder (or of a new one)" in out.stderr
    assert "done after" not in out.stdout and "File exists" not in _log(out)
    assert (runs["root"] / "file" / "afile.txt").read_text() == "notes\n"


def test_resuming_a_loop_without_loader_at_another_world_size_says_what_changes(runs):
    assert runs["world_2"].returncode == 0, _log(runs["world_2"])
    out = runs["world_1"]
    assert out.returncode == 0, _log(out)
    log = _log(out)
    assert (
        "checkpoint step-000000035 was written by 2 worker(s) and this run has 1, without a ddpkit.DataLoader as "
        "loader= to hold the data position: each rank draws batches of the size it did, so the global batch is "
        "1/2 of what it was" in log
    )
    assert "same global batch" not in log and "sample order (no sample" not in log


def test_the_listing_of_a_loop_without_epochs_shows_no_made_up_epoch(runs):
    out = runs["listing"]
    assert out.returncode == 0, _log(out)
    rows = {m[1]: m[3] for m in re.finditer(r"^(step-\d+)\s+(\d+)\s+(\S+)", out.stdout, re.M)}
    assert rows == {"step-000000035": "-", "step-000000040": "-"}
    assert "None" not in out.stdout
