"""Where a resumed loop continues: the batch counter of ``Checkpointer.enumerate``, epochs counted by a torch
DataLoader's length, and the one-line refusals of a Checkpointer that could not work.

In this process, without a process group (world size 1); the end-to-end traps under ``ddpkit run nproc=2``
are in tests/traps/test_ckptresume.py.
"""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import ddpkit
from ddpkit.checkpoint.manager.restore import resume_point_by_length, world_size_line
from ddpkit.checkpoint.ranks import rank_and_size
from ddpkit.commands.checkpoints import _epoch
from ddpkit.errors import UserError

DATA = TensorDataset(torch.arange(20.0).unsqueeze(1))
"""5 batches of 4."""


def _counted(folder, loader, steps: int) -> list[tuple[int, float]]:
    """Train ``steps`` batches of the first epoch with a Checkpointer holding ``loader``; save; close."""
    ckpt = ddpkit.Checkpointer(folder, extra={"seen": {}}, loader=loader, preempt_signals=())
    ckpt.resume("auto")
    seen = []
    for i, (x,) in ckpt.enumerate(loader):
        seen.append((i, float(x[0, 0])))
        ckpt.step()
        if len(seen) == steps:
            break
    ckpt.save()
    ckpt.close()
    return seen


@pytest.mark.parametrize("kind", ["ddpkit", "torch"])
def test_enumerate_counts_the_batches_of_the_epoch_from_where_a_resume_continues(tmp_path, kind):
    def make():
        if kind == "ddpkit":
            return ddpkit.DataLoader(DATA, global_batch_size=4, shuffle=True, seed=1, rank=0, world_size=1)
        return DataLoader(DATA, batch_size=4, shuffle=False)

    reference = [(i, float(x[0, 0])) for i, (x,) in enumerate(make())]
    first = _counted(tmp_path, make(), 3)
    assert first == reference[:3]
    loader = make()
    ckpt = ddpkit.Checkpointer(tmp_path, extra={"seen": {}}, loader=loader, preempt_signals=())
    start = ckpt.resume("auto")
    assert (start.epoch, start.step_in_epoch) == (0, 3)
    rest = [(i, float(x[0, 0])) for i, (x,) in ckpt.enumerate(loader)]
    for _ in rest:
        ckpt.step()
    assert rest == reference[3:]  # the true index and batch: the first 3 are not trained again
    if kind == "ddpkit":
        loader.set_epoch(1)
    assert [i for i, _ in ckpt.enumerate(loader)] == [0, 1, 2, 3, 4]  # a later pass counts from 0
    ckpt.close()


@pytest.mark.parametrize(
    "global_step, reason, expected",
    [
        (7, "every_steps", (2, 2)),  # mid-epoch
        (10, "every_steps", (2, 5)),  # the epoch's last step, written inside step(): its code runs again
        (10, "preempted", (2, 5)),
        (10, "manual", (3, 0)),  # save() after the epoch's code: the next epoch
        (10, "final", (3, 0)),
        (0, "every_steps", (1, 0)),
    ],
)
def test_epochs_counted_by_a_torch_dataloader_s_length(global_step, reason, expected):
    assert resume_point_by_length(global_step, 5, 1, reason) == expected


def test_a_torch_dataloader_given_as_loader_counts_the_epochs(tmp_path):
    loader = DataLoader(DATA, batch_size=4)
    ckpt = ddpkit.Checkpointer(tmp_path, extra={"seen": {}}, loader=loader, every_steps=4, preempt_signals=())
    for _ in range(9):
        ckpt.step()
    ckpt.close()  # steps 4 and 8 (every_steps), 9 (final)
    start = ddpkit.Checkpointer(tmp_path, extra={"seen": {}}, loader=loader, preempt_signals=()).resume("auto")
    assert (start.global_step, start.epoch, start.step_in_epoch, start.finished) == (9, 1, 4, True)
    assert start.manifest["steps_per_epoch"] == 5


def test_a_checkpoint_folder_that_is_a_file_is_refused_at_construction(tmp_path):
    (tmp_path / "afile.txt").write_text("x")
    with pytest.raises(UserError, match=r"^checkpoint folder .*afile.txt is a file; pass the path of a folder"):
        ddpkit.Checkpointer(tmp_path / "afile.txt", extra={"seen": {}})


def test_a_launcher_s_world_size_without_a_process_group_names_init():
    assert rank_and_size({"WORLD_SIZE": "1"}) == (0, 1)
    with pytest.raises(UserError, match=r"call ddpkit.init\(\) before ddpkit.Checkpointer\(...\)$"):
        rank_and_size({"WORLD_SIZE": "2", "RANK": "1"})


def test_a_world_size_change_says_what_carries_over():
    assert "same global batch of the same sample order" in world_size_line("step-1", 2, 1, positioned=True)
    line = world_size_line("step-1", 2, 1, positioned=False)
    assert "the global batch is 1/2 of what it was, there is no sample order to continue" in line
    assert "same global batch" not in line


@pytest.mark.parametrize(
    "manifest, shown",
    [
        ({"completed_epochs": 0, "step_in_epoch": 35, "steps_per_epoch": None}, "-"),
        ({"completed_epochs": 2, "step_in_epoch": 3, "steps_per_epoch": None}, "2+3"),
        ({"completed_epochs": 1, "step_in_epoch": 3, "steps_per_epoch": 5}, "1+3/5"),
        ({"completed_epochs": 2, "step_in_epoch": 0, "steps_per_epoch": None}, "2"),
    ],
)
def test_the_listing_shows_an_epoch_only_as_far_as_it_is_known(manifest, shown):
    assert _epoch(manifest) == shown


def _warnings(caplog_records) -> list[str]:
    return [r.getMessage() for r in caplog_records if r.levelno >= logging.WARNING]


@pytest.fixture
def ddpkit_warnings():
    """What ddpkit logs at WARNING and above (its logger does not propagate)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = records.append  # type: ignore[method-assign]
    logger = logging.getLogger("ddpkit")
    logger.addHandler(handler)
    try:
        yield records
    finally:
        logger.removeHandler(handler)


@pytest.mark.parametrize("with_metric", [True, False])
def test_best_metric_is_warned_only_when_no_epoch_end_gave_it(tmp_path, ddpkit_warnings, with_metric):
    loader = DataLoader(DATA, batch_size=4)  # 5 steps an epoch
    for run in range(2):  # a fresh run, then one resumed mid-epoch
        ckpt = ddpkit.Checkpointer(
            tmp_path, extra={"seen": {}}, loader=loader, every_steps=1, best_metric="accuracy", preempt_signals=()
        )
        start = ckpt.resume("auto")
        for epoch in range(start.epoch, 3):
            for _ in ckpt.enumerate(loader):
                ckpt.step()
                if run == 0 and ckpt.global_step == 7:  # stopped 2 steps into the second epoch
                    break
            else:
                if with_metric:
                    ckpt.epoch_end({"accuracy": 0.5 + epoch})
                continue
            break
        ckpt.close()
        assert (run, start.epoch, start.step_in_epoch) == (run, 1 if run else 0, 2 if run else 0)
    said = _warnings(ddpkit_warnings)
    assert said == ([] if with_metric else [said[0]] * 2), said  # once per run, no other warning
    assert with_metric or said[0].startswith("best_metric='accuracy' but no epoch_end() call gave it")
