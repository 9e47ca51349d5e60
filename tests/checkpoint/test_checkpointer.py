"""ddpkit.Checkpointer: bad input is one clear line; save, keep, best, resume and exact restore.

Most tests run in this process, without a process group (world size 1: the
Checkpointer needs none). Two check jobs of 2 real gloo ranks, run side by
side by the ``two_rank_jobs`` fixture: a save reached by one rank only, and
every rank's RNG restored as its own.
Preemption signals are off (``preempt_signals=()``) so that no handler is
installed in the pytest process, except in the last test, which sends
SIGTERM to this process and its DataLoader worker as Slurm would on
preemption (the Checkpointer's handler records it; close() restores).
"""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
import yaml
from torch import nn
from torch.utils.data import Dataset

import ddpkit
from ddpkit import Checkpointer, CheckpointError
from ddpkit.checkpoint.disk.format import MANIFEST, list_checkpoints, read_manifest, verify_checkpoint
from tests.helpers.module_runs import run_side_by_side, selected_tests

SEED = 20240607
"""Seed of every random choice here: data, initial weights, generator states."""


class DdpkitLog(logging.Handler):
    """Collects what ddpkit logs (its logger does not propagate once set up, so caplog would miss it)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, level: int = logging.INFO) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= level)


@pytest.fixture
def ddpkit_log():
    logger = logging.getLogger("ddpkit")
    handler, level = DdpkitLog(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.fixture
def checkpointers():
    """Makes Checkpointers and closes every one of them after the test."""
    made: list[Checkpointer] = []

    def make(folder, **kwargs) -> Checkpointer:
        kwargs.setdefault("preempt_signals", ())
        made.append(Checkpointer(folder, **kwargs))
        return made[-1]

    yield make
    for ckpt in made:
        ckpt.close()


def _net(seed: int = SEED) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 2))


def _parts(seed: int = SEED):
    model = _net(seed)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _train(model, optimizer, scheduler, ckpt: Checkpointer, steps: int) -> None:
    """``steps`` optimizer steps; the batch of global step s depends on s alone, dropout on torch's RNG."""
    for _ in range(steps):
        batch = torch.Generator().manual_seed(SEED + ckpt.global_step)
        x = torch.randn(4, 8, generator=batch)
        loss = model(x).pow(2).mean()
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        ckpt.step()


def _draws() -> tuple[list[float], float, float]:
    """What comes next from torch's, python's and numpy's global generators."""
    return torch.rand(3).tolist(), random.random(), float(np.random.rand())


def _seed_all(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _steps(folder: Path) -> list[int]:
    return [info.global_step for info in list_checkpoints(folder) if info.complete]


def _one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message, message
    return message


# -- bad input: one line that names the fix ------------------------------------------------------


class _NoState:
    pass


class _Unsized(Dataset):
    def __getitem__(self, index):
        return index


class _Sized(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, index):
        return index


def test_an_object_without_state_dict_is_refused(tmp_path, checkpointers):
    with pytest.raises(ValueError) as error:
        checkpointers(tmp_path, model=nn.Linear(2, 2), extra={"counter": _NoState()})
    message = _one_line(error)
    assert "counter=_NoState has no state_dict()/load_state_dict()" in message
    assert "pass objects with both" in message


@pytest.mark.parametrize(
    "options,expected",
    [
        ({"keep": 0}, "keep=0 is not valid; it must be > 0"),
        ({"every_steps": -1}, "every_steps=-1 is not valid; it must be >= 0"),
        ({"best_mode": "auto"}, "best_mode='auto' is not valid; choose one of: max, min"),
        ({"readable_by": "world"}, "readable_by='world' is not valid; choose one of: user, group, all"),
        ({"preempt_signals": ("SIGKILL",)}, "preempt_signals='SIGKILL' is not valid; choose one of: SIGABRT,"),
        ({"on_write_error": "ignore"}, "on_write_error='ignore' is not valid; choose one of: stop, warn"),
        ({"timeout": 0}, "timeout=0 is not valid; it must be > 0"),
    ],
)
def test_a_bad_option_is_one_line_naming_the_keyword(tmp_path, checkpointers, options, expected):
    with pytest.raises(ddpkit.UserError) as error:
        checkpointers(tmp_path, model=nn.Linear(2, 2), **options)
    assert _one_line(error).startswith(expected)


def test_options_come_from_one_dataclass_as_keywords_or_ready_made(tmp_path, checkpointers):
    from ddpkit.checkpoint.options import CheckpointOptions

    given = CheckpointOptions(every_steps=5, keep=3, preempt_signals="")
    assert checkpointers(tmp_path / "a", model=nn.Linear(2, 2), options=given).options == given
    keywords = checkpointers(tmp_path / "b", model=nn.Linear(2, 2), every_steps=5, keep=3)
    assert keywords.options == given
    # Keywords go over a ready-made instance; a sequence of signal names is the comma-separated field.
    over = checkpointers(tmp_path / "c", model=nn.Linear(2, 2), options=given, keep=4, preempt_signals=("USR1",))
    assert (over.options.keep, over.options.every_steps, over.options.signal_names()) == (4, 5, ("SIGUSR1",))
    # Any signal a process can catch (a scheduler may warn with SIGXCPU); the command line documents five.
    assert CheckpointOptions(preempt_signals="SIGXCPU,SIGQUIT").signal_names() == ("SIGXCPU", "SIGQUIT")
    with pytest.raises(TypeError, match="unexpected keyword argument 'every_step'; its options are: every_steps,"):
        checkpointers(tmp_path / "d", model=nn.Linear(2, 2), every_step=5)


@pytest.mark.parametrize(
    "make,expected",
    [
        # tests/data/test_loader.py checks the start of these messages; here: one line, and the fix.
        (lambda: ddpkit.DataLoader(_Unsized(), global_batch_size=4), ["neither", "give it __len__"]),
        (
            lambda: ddpkit.DataLoader(_Sized(), global_batch_size=2, rank=0, world_size=4),
            ["global batch size 2 does not divide among 4 workers", "use a global_batch_size that is a multiple of 4"],
        ),
    ],
    ids=["unsized-dataset", "global-batch-below-world-size"],
)
def test_a_loader_the_checkpointer_could_not_resume_is_refused(make, expected):
    with pytest.raises(ValueError) as error:
        make()
    message = _one_line(error)
    for part in expected:
        assert part in message


def test_resuming_without_an_object_the_checkpoint_holds_names_it(tmp_path, checkpointers):
    model, optimizer, scheduler = _parts()
    checkpointers(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler).save()
    model, optimizer, _ = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer)
    with pytest.raises(CheckpointError) as error:
        ckpt.resume("auto")
    message = _one_line(error)
    assert "it holds scheduler that this run does not pass" in message
    assert "pass the same objects it was written with" in message


@pytest.mark.parametrize(
    "saved,resumed,expected",
    [
        (1, 2, 'Missing key(s) in state_dict: "2.weight", "2.bias"'),
        (2, 1, 'Unexpected key(s) in state_dict: "2.weight", "2.bias"'),
    ],
    ids=["extra-layer-in-the-run", "extra-layer-in-the-checkpoint"],
)
def test_resuming_a_model_of_another_architecture_names_the_keys(tmp_path, checkpointers, saved, resumed, expected):
    def model(layers: int) -> nn.Module:
        return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))[: 2 * layers - 1]

    checkpointers(tmp_path, model=model(saved)).save()
    with pytest.raises(CheckpointError) as error:
        checkpointers(tmp_path, model=model(resumed)).resume("auto")
    message = _one_line(error)
    assert "its model does not fit this run's model" in message and expected in message
    assert "resume with the settings it was written with, or start a new run in another folder" in message


SAVE_TIMEOUT_S = 1
"""How long a save waits for the other ranks in the test of a save that one rank never reaches."""


def _save_on_rank_one_only(rank: int, world_size: int, folder: str) -> tuple[str, float]:
    ckpt = Checkpointer(folder, model=nn.Linear(2, 2), timeout=SAVE_TIMEOUT_S, preempt_signals=())
    try:
        if rank == 0:
            time.sleep(0.5)  # busy elsewhere, then done: it never reaches the save
            return "", 0.0
        start = time.monotonic()
        try:
            ckpt.save()
        except CheckpointError as e:
            return str(e), time.monotonic() - start
        return "saved without rank 0", time.monotonic() - start
    finally:
        ckpt.close()


def test_a_save_reached_by_some_ranks_only_names_the_absent_rank_within_the_timeout(two_rank_jobs):
    folder = two_rank_jobs["folder"] / "save-on-one-rank"
    _, (message, waited) = two_rank_jobs["save-on-one-rank"].get()
    assert message == (
        f"a checkpoint save was reached by rank(s) [1] but not by rank(s) [0] within {SAVE_TIMEOUT_S}s; "
        "saving is collective: call Checkpointer.step()/save() on every rank at the same point"
    )
    assert SAVE_TIMEOUT_S <= waited < 10
    assert _steps(folder) == []


# -- what is saved, and when ------------------------------------------------------------------


def test_keeps_the_last_k_checkpoints(tmp_path, checkpointers):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, every_steps=1, keep=2)
    _train(model, optimizer, scheduler, ckpt, 5)
    assert _steps(tmp_path) == [4, 5]
    assert ckpt.last_path == tmp_path / "step-000000005"


def test_every_steps_cadence(tmp_path, checkpointers):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, every_steps=3, keep=10)
    _train(model, optimizer, scheduler, ckpt, 10)
    assert _steps(tmp_path) == [3, 6, 9]
    assert {read_manifest(tmp_path / f"step-{s:09d}")["reason"] for s in (3, 6, 9)} == {"every_steps"}


def test_the_best_checkpoint_by_a_metric_given_to_epoch_end(tmp_path, checkpointers):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, keep=1, best_metric="loss", best_mode="min")
    for loss in (0.9, 0.4, 0.6):
        _train(model, optimizer, scheduler, ckpt, 2)
        ckpt.epoch_end({"loss": loss})
    assert _steps(tmp_path) == [6]  # keep=1: the newest; the best one is kept apart
    best = list_checkpoints(tmp_path, prefix="best-")
    assert [info.global_step for info in best] == [4]
    manifest = read_manifest(best[0].path)
    assert manifest["metrics"] == {"loss": 0.4}
    assert manifest["best"] == {"metric": "loss", "mode": "min", "value": 0.4}
    assert manifest["completed_epochs"] == 2 and read_manifest(tmp_path / "step-000000006")["completed_epochs"] == 3
    verify_checkpoint(best[0].path)  # complete by itself: step-000000004, which it links to, was pruned


def test_the_config_is_stored_with_every_checkpoint(tmp_path, checkpointers):
    config = {"lr": 0.1, "model": {"name": "mine", "layers": [8, 16, 2]}, "note": "seed 20240607"}
    model, optimizer, _ = _parts()
    path = checkpointers(tmp_path, model=model, optimizer=optimizer, config=config).save()
    assert yaml.safe_load((path / "config.yaml").read_text()) == config
    model, optimizer, _ = _parts()
    start = checkpointers(tmp_path, model=model, optimizer=optimizer, config=config).resume("auto")
    assert start.manifest["config"] == config


# -- resuming --------------------------------------------------------------------------------


def test_resume_auto_never_and_path(tmp_path, checkpointers):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, every_steps=2, keep=3)
    fresh = ckpt.resume("auto")  # an empty folder: a fresh start
    assert (fresh.resumed, fresh.epoch, fresh.step_in_epoch, fresh.global_step) == (False, 0, 0, 0)
    _train(model, optimizer, scheduler, ckpt, 4)
    assert _steps(tmp_path) == [2, 4]

    def resume(how):
        model, optimizer, _ = _parts(SEED + 1)
        return checkpointers(tmp_path, model=model, optimizer=optimizer, every_steps=2, keep=3).resume(how)

    with pytest.raises(CheckpointError) as error:
        resume("never")
    assert "already holds checkpoints (newest: step-000000004); continue that run with resume=auto" in _one_line(error)
    assert resume("auto").path == tmp_path / "step-000000004"
    assert resume(True).path == tmp_path / "step-000000004"  # an argparse --resume flag means auto
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        resume(False)  # and its absence never, not a checkpoint named "False"
    assert resume(tmp_path / "step-000000004").global_step == 4
    with pytest.raises(CheckpointError) as error:
        resume(tmp_path / "step-000000002")
    assert "holds checkpoints newer than" in _one_line(error) and "step-000000004" in str(error.value)
    with pytest.raises(CheckpointError) as error:
        resume(tmp_path / "step-000000003")
    assert "does not exist" in _one_line(error)


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(tmp_path, checkpointers, ddpkit_log):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, every_steps=1, keep=2)
    _train(model, optimizer, scheduler, ckpt, 2)
    model_file = tmp_path / "step-000000002" / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit pattern, same size: only the checksum can tell
    model_file.write_bytes(bytes(data))

    model2, optimizer2, _ = _parts(SEED + 1)
    start = checkpointers(tmp_path, model=model2, optimizer=optimizer2).resume("auto")
    assert start.path == tmp_path / "step-000000001" and start.global_step == 1
    warnings = ddpkit_log.text(logging.WARNING)
    assert "skipping checkpoint step-000000002" in warnings and "SHA-256 does not match" in warnings
    assert "newest checkpoint" in warnings and "is corrupt; using the previous good one" in warnings
    assert (tmp_path / "step-000000002.corrupt" / MANIFEST).is_file()
    assert _steps(tmp_path) == [1]


def test_resume_restores_model_optimizer_scheduler_and_rng_bit_for_bit(tmp_path, checkpointers):
    # The uninterrupted run: 6 steps with dropout, then the generators' next draws.
    _seed_all(SEED)
    model, optimizer, scheduler = _parts()
    _train(model, optimizer, scheduler, checkpointers(tmp_path / "straight", model=model), 6)
    expected = (model.state_dict(), optimizer.state_dict(), scheduler.state_dict(), _draws())

    # The same run stopped after 3 steps (checkpoint), then continued in a "new process".
    _seed_all(SEED)
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path / "ckpt", model=model, optimizer=optimizer, scheduler=scheduler, every_steps=3)
    _train(model, optimizer, scheduler, ckpt, 3)
    _seed_all(SEED + 99)  # whatever the new process draws before resuming
    model, optimizer, scheduler = _parts(SEED + 1)
    ckpt = checkpointers(tmp_path / "ckpt", model=model, optimizer=optimizer, scheduler=scheduler, every_steps=3)
    start = ckpt.resume("auto")
    assert (start.global_step, start.path.name) == (3, "step-000000003")
    _train(model, optimizer, scheduler, ckpt, 3)

    weights, optimizer_state, scheduler_state, draws = expected
    assert weights.keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    for index, state in optimizer.state_dict()["state"].items():
        assert torch.equal(state["momentum_buffer"], optimizer_state["state"][index]["momentum_buffer"])
    assert optimizer.param_groups[0]["lr"] == 0.1 * 0.5**3
    assert scheduler.state_dict() == scheduler_state
    assert _draws() == draws


def _save_then_resume_every_ranks_rng(rank: int, world_size: int, folder: str) -> dict:
    _seed_all(SEED + rank)  # each rank its own stream, as dropout on each rank is
    model = _net()
    ckpt = Checkpointer(folder, model=model, every_steps=2, preempt_signals=())
    first = ckpt.resume("auto")
    ckpt.step()
    ckpt.step()  # a collective save at step 2
    saved = ckpt.last_path
    expected = _draws()
    ckpt.close()

    _seed_all(SEED + 99)  # a restarted process: same seed on every rank
    ckpt = Checkpointer(folder, model=_net(SEED + 1), every_steps=2, preempt_signals=())
    start = ckpt.resume("auto")
    got = _draws()
    weights = ddpkit.unwrap_model(ckpt.objects["model"]).state_dict()
    ckpt.close()
    return {
        "first": first.resumed,
        "saved": str(saved),
        "start": (start.global_step, str(start.path)),
        "expected": expected,
        "got": got,
        "weight": weights["0.weight"],
    }


def _save_then_resume_per_rank_state(rank: int, world_size: int, folder: str) -> dict:
    # nanoGPT's shape: each rank prefetches its own next batch; plain counters in a dict.
    log = DdpkitLog()
    logging.getLogger("ddpkit").addHandler(log)
    batch = {"x": torch.full((2, 3), float(rank))}
    progress = {"iter_num": 0, "best_val_loss": 1e9}
    wrong = {"y": torch.full((2,), float(rank))}  # per-rank too, but passed as extra=

    def checkpointer() -> Checkpointer:
        extra = {"progress": progress, "wrong": wrong}
        return Checkpointer(
            folder, model=_net(), extra=extra, per_rank={"batch": batch}, every_steps=2, preempt_signals=()
        )

    ckpt = checkpointer()
    ckpt.resume("auto")
    ckpt.step()
    progress["iter_num"], progress["best_val_loss"] = 2, 0.5
    ckpt.step()  # a collective save at step 2
    ckpt.close()

    batch["x"], progress["iter_num"], wrong["y"] = torch.zeros(1), 0, torch.zeros(1)
    ckpt = checkpointer()
    ckpt.resume("auto")
    ckpt.close()
    logging.getLogger("ddpkit").removeHandler(log)
    return {"x": batch["x"], "progress": dict(progress), "y": wrong["y"], "warnings": log.text(logging.WARNING)}


TWO_RANK_JOBS = {
    "save-on-one-rank": (
        "test_a_save_reached_by_some_ranks_only_names_the_absent_rank_within_the_timeout",
        _save_on_rank_one_only,
    ),
    "rng": ("test_two_ranks_save_and_resume_each_ranks_rng", _save_then_resume_every_ranks_rng),
    "per-rank": (
        "test_per_rank_state_is_each_ranks_own_and_plain_values_are_restored_in_place",
        _save_then_resume_per_rank_state,
    ),
}
"""Each 2-rank job (named by the folder it saves into under the fixture's): the test that checks it, its function."""


@pytest.fixture(scope="module")
def two_rank_jobs(request, tmp_path_factory) -> dict:
    """The selected tests' 2-rank jobs, side by side: each job's outcome, and "folder" holding their folders."""
    folder = tmp_path_factory.mktemp("two-ranks")
    selected = selected_tests(request)
    jobs = {name: (fn, 2, (str(folder / name),), {}) for name, (test, fn) in TWO_RANK_JOBS.items() if test in selected}
    return {**run_side_by_side(jobs, timeout=90), "folder": folder}


def test_two_ranks_save_and_resume_each_ranks_rng(two_rank_jobs):
    folder = two_rank_jobs["folder"] / "rng"
    results = two_rank_jobs["rng"].get()
    assert _steps(folder) == [2]
    assert read_manifest(folder / "step-000000002")["world_size"] == 2
    for result in results:
        assert not result["first"]
        assert result["saved"] == str(folder / "step-000000002")
        assert result["start"] == (2, str(folder / "step-000000002"))
        assert result["got"] == result["expected"]
        assert torch.equal(result["weight"], _net().state_dict()["0.weight"])  # rank 0's weights, restored
    assert results[0]["got"] != results[1]["got"]  # each rank got its own stream back, not rank 0's


def test_per_rank_state_is_each_ranks_own_and_plain_values_are_restored_in_place(two_rank_jobs):
    folder = two_rank_jobs["folder"] / "per-rank"
    results = two_rank_jobs["per-rank"].get()
    for rank, result in enumerate(results):
        assert torch.equal(result["x"], torch.full((2, 3), float(rank)))  # its own prefetched batch, not rank 0's
        assert result["progress"] == {"iter_num": 2, "best_val_loss": 0.5}  # the same dict, restored in place
        assert torch.equal(result["y"], torch.zeros(2))  # extra= is rank 0's everywhere, as documented...
    assert "extra object(s) wrong hold tensors that differ between the ranks" in results[0]["warnings"]
    assert "pass them as per_rank={...}" in results[0]["warnings"]  # ...and rank 0 said so at the first save
    assert "progress" not in results[0]["warnings"]
    assert read_manifest(folder / "step-000000002")["per_rank"] == ["batch"]


# -- preemption: the signal reaches every process of the job ---------------------------------------


class _Indices(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.tensor(index)


def test_dataloader_workers_survive_a_preemption_signal_sent_to_every_process(tmp_path, checkpointers):
    loader = ddpkit.DataLoader(
        _Indices(), global_batch_size=4, shuffle=True, seed=SEED, rank=0, world_size=1, num_workers=1
    )
    ckpt = checkpointers(tmp_path, loader=loader, preempt_signals=("SIGTERM",))
    ckpt.start()  # the handlers are installed from here on (resume() and the first step() start it too)
    before = {child.pid for child in psutil.Process().children()}
    batches = iter(loader)
    try:
        first = next(batches)
        workers = [child.pid for child in psutil.Process().children() if child.pid not in before]
        assert len(workers) == 1
        # Slurm signals every process of the job step: the training process and its DataLoader workers.
        for pid in (*workers, os.getpid()):
            os.kill(pid, signal.SIGTERM)
        time.sleep(0.5)
        rest = list(batches)
    finally:
        del batches  # shuts the workers down
    assert sorted(torch.cat([first, *rest]).tolist()) == list(range(64))
    assert ckpt.signals.received == signal.SIGTERM  # recorded; the next step() agrees on it and checkpoints


def test_a_loop_leaving_its_epochs_early_is_warned_once_that_a_resume_inside_one_differs(
    tmp_path, checkpointers, ddpkit_log
):
    loader = ddpkit.DataLoader(_Indices(), global_batch_size=4, shuffle=True, seed=SEED, rank=0, world_size=1)
    ckpt = checkpointers(tmp_path, loader=loader, every_steps=100)
    next(iter(loader))  # a look at the first batch takes nothing from the loop, and is not a loop leaving early
    for epoch in range(3):
        loader.set_epoch(epoch)
        for i, _ in enumerate(loader):
            if i == 5:  # a --limit-batches flag
                break
            ckpt.step()
    warnings = [r.getMessage() for r in ddpkit_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("the loop left epoch 0 after 6 of 16 batches (a break in its batch loop)")
    assert "sampler=RandomSampler(dataset, num_samples=N)" in warnings[0]


def test_without_a_loader_an_epoch_end_at_a_saved_step_is_saved_as_complete(tmp_path, checkpointers):
    # Epochs of 4 steps, every_steps=4: step() saves the epoch's last step before epoch_end() counts it.
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, every_steps=4, on_epoch_end=False)
    _train(model, optimizer, scheduler, ckpt, 4)
    ckpt.epoch_end()
    model2, optimizer2, _ = _parts(SEED + 1)
    start = checkpointers(tmp_path, model=model2, optimizer=optimizer2).resume("auto")
    assert (start.global_step, start.epoch, start.step_in_epoch) == (4, 1, 0)  # was epoch 0: trained again


def test_without_a_loader_a_checkpoint_inside_an_epoch_says_how_many_batches_to_skip(
    tmp_path, checkpointers, ddpkit_log
):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, every_steps=3)
    _train(model, optimizer, scheduler, ckpt, 4)
    ckpt.epoch_end()  # epoch 0: 4 steps
    _train(model, optimizer, scheduler, ckpt, 2)  # the checkpoint of step 6 is 2 steps into epoch 1
    warnings = [r.getMessage() for r in ddpkit_log.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("checkpoint of global step 3 is 3 step(s) into epoch 0")
    assert "pass loader=ddpkit.DataLoader(...) for an exact resume" in warnings[0]

    model2, optimizer2, scheduler2 = _parts(SEED + 1)
    start = checkpointers(tmp_path, model=model2, optimizer=optimizer2, scheduler=scheduler2).resume("auto")
    assert (start.global_step, start.epoch, start.step_in_epoch) == (6, 1, 2)
    assert "(global step 6: 1 epoch(s) complete and 2 step(s) of the next), without a loader=" in ddpkit_log.text(
        logging.WARNING
    )


def test_an_lr_scheduler_the_checkpointer_does_not_hold_is_warned_once(tmp_path, checkpointers, ddpkit_log):
    model, optimizer, scheduler = _parts()
    ckpt = checkpointers(tmp_path / "without", model=model, optimizer=optimizer, every_steps=1)
    ckpt.resume("auto")
    _train(model, optimizer, scheduler, ckpt, 2)
    warnings = [r.getMessage() for r in ddpkit_log.records if "LR scheduler" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("optimizer has an LR scheduler that this Checkpointer does not hold")
    assert "pass it as scheduler=..." in warnings[0]

    ddpkit_log.records.clear()
    held = checkpointers(tmp_path / "with", model=model, optimizer=optimizer, scheduler=scheduler, every_steps=1)
    held.resume("auto")
    _train(model, optimizer, scheduler, held, 1)
    assert "does not hold" not in ddpkit_log.text(logging.WARNING)


def test_ddpkit_train_s_checkpoint_options_passed_as_they_are_are_refused_naming_for_run(tmp_path):
    from ddpkit.train.config import CheckpointConfig

    with pytest.raises(ddpkit.UserError) as error:
        Checkpointer(tmp_path, model=_net(), options=CheckpointConfig(), preempt_signals=())
    assert "'auto' is ddpkit train's word, resolved for its task by for_run()" in _one_line(error)
    ckpt = Checkpointer(tmp_path, model=_net(), options=CheckpointConfig().for_run("accuracy"), preempt_signals=())
    assert (ckpt.options.best_metric, ckpt.options.best_mode) == ("accuracy", "max")
    ckpt.close()


def _bytes_written_by_this_process() -> int:
    """What this process has handed to write() so far (the kernel's count, /proc/self/io's wchar)."""
    fields = dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())
    return int(fields["wchar"])


def test_an_epoch_end_is_written_once_also_with_a_scheduler_stepped_after_the_batch_loop(tmp_path, checkpointers):
    # T12: an own loop's epoch-end saves with a loader-held Checkpointer and a per-epoch scheduler write
    # each checkpoint once; the code after the batch loop is in it (a resume from it is exact).
    torch.manual_seed(SEED)
    model = nn.Linear(256, 1024)  # about 1 MB of weights, 3 MB with Adam's state: the bulk of each file
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    data = torch.utils.data.TensorDataset(torch.randn(32, 256))
    loader = ddpkit.DataLoader(data, global_batch_size=8, shuffle=True, seed=SEED, rank=0, world_size=1)
    ckpt = checkpointers(tmp_path, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, keep=5)
    start = ckpt.resume("auto")
    before = _bytes_written_by_this_process()
    for epoch in range(start.epoch, 3):
        loader.set_epoch(epoch)
        for (x,) in loader:
            model(x).pow(2).mean().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step()
        scheduler.step()
    ckpt.close()
    written = _bytes_written_by_this_process() - before
    checkpoints = list_checkpoints(tmp_path)
    assert [info.global_step for info in checkpoints] == [4, 8, 12]
    one_each = sum(info.size for info in checkpoints)
    assert one_each <= written <= 1.15 * one_each, (written, one_each)
    # Each holds the scheduler's step after its epoch: a resume continues at the next epoch's lr.
    assert [verify_checkpoint(info.path)["scheduler.pt"]["last_epoch"] for info in checkpoints] == [1, 2, 3]


def test_a_second_run_into_a_folder_in_use_stops_at_start_naming_the_holder(tmp_path):
    from ddpkit.checkpoint.disk.folder_lock import FolderInUseError
    from tests.cli_runner import PYTHONPATH

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time, torch, ddpkit\n"
            f"ckpt = ddpkit.Checkpointer({str(tmp_path)!r}, model=torch.nn.Linear(2, 2), preempt_signals=())\n"
            "ckpt.start(); print('holding', flush=True); time.sleep(60)",
        ],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "holding"
        ckpt = Checkpointer(tmp_path, model=nn.Linear(2, 2), preempt_signals=())
        with pytest.raises(FolderInUseError) as error:
            ckpt.resume("auto")
        message = _one_line(error)
        assert f"is in use by another run (host {os.uname().nodename}, pid {holder.pid}" in message, message
        assert _steps(tmp_path) == []  # nothing written
    finally:
        holder.kill()
        holder.wait()
    again = Checkpointer(tmp_path, model=nn.Linear(2, 2), preempt_signals=())
    assert not again.resume("auto").resumed  # the holder is gone: its lock went with it
    again.close()


def test_a_save_of_non_finite_weights_is_kept_apart_and_never_prunes_a_finite_one(tmp_path, checkpointers, ddpkit_log):
    model = nn.Linear(4, 4)
    ckpt = checkpointers(tmp_path, model=model, keep=1, best_metric="loss", best_mode="min")
    ckpt.resume("auto")
    ckpt.step()
    ckpt.epoch_end({"loss": 0.5})
    good = ckpt.save()
    with torch.no_grad():
        model.weight[0, 0] = float("nan")
    ckpt.step()
    ckpt.epoch_end({"loss": float("nan")})  # a NaN metric never becomes the best
    bad = ckpt.save()
    assert read_manifest(bad)["finite"] is False and read_manifest(bad)["nonfinite_tensors"] == ["model.pt.weight"]
    assert good.exists()  # keep=1 counts finite checkpoints only
    assert [info.global_step for info in list_checkpoints(tmp_path, prefix="best-")] == [1]
    assert "holds NaN or infinity (model.pt.weight)" in ddpkit_log.text(logging.WARNING)


def test_the_save_callback_and_the_continue_hint_are_given_to_the_checkpointer(tmp_path):
    """A caller (``ddpkit train``) gives its callback by a method and its hint by the constructor."""
    calls = []
    ckpt = Checkpointer(tmp_path, model=nn.Linear(2, 2), preempt_signals=(), continue_hint="run it again")
    ckpt.set_on_save(lambda path, reason: calls.append((path.name, reason)))
    ckpt.step()
    first = ckpt.save()
    ckpt.set_on_save(None)  # from now on, nothing is called
    ckpt.step()
    ckpt.save()
    ckpt.close()
    assert first is not None and calls == [(first.name, "manual")]
    assert ckpt.continue_hint == "run it again"
