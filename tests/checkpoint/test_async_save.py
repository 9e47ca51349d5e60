"""Checkpointer(async_save=True): the same files as a synchronous save, written while training goes on.

In this process (world size 1, no preemption handlers): the copy keeps
shared storages and views and is unaffected by later steps; async and sync
saves of the same state are byte-identical per file, also through a loader's
deferred epoch-end checkpoints and their metrics; a failed background write
is raised at the next wait. In a child process killed with SIGKILL while its
background thread writes: the previous checkpoint stays the newest complete
one, and resume picks it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import Checkpointer
from ddpkit.checkpoint.disk.async_save import copy_state
from ddpkit.checkpoint.disk.format import MANIFEST, list_checkpoints, read_manifest, verify_checkpoint
from ddpkit.checkpoint.disk.storage import StorageError
from tests.cli_runner import PYTHONPATH

SEED = 20251125


def _model() -> nn.Module:
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 6))
    model[2].weight = nn.Parameter(model[0].weight.t())  # a view of another parameter's storage, saved shared
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 6)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir()) if path.name != MANIFEST}


def _manifest_without_time(folder: Path) -> dict:
    manifest = read_manifest(folder)
    manifest.pop("created")
    return manifest


def test_copy_keeps_shared_storages_and_views_and_is_not_changed_by_training():
    base = torch.arange(12.0)
    state = {"a": base, "view": base[2:8].view(2, 3), "t": base.view(3, 4).t(), "n": [1, (2.5, "x")]}
    copied = copy_state(state, copy_cpu=True, pin_memory=False)
    base.add_(100)
    assert torch.equal(copied["a"], torch.arange(12.0))
    assert copied["view"].untyped_storage().data_ptr() == copied["a"].untyped_storage().data_ptr()
    assert (copied["view"].storage_offset(), copied["t"].stride()) == (2, (1, 4))
    assert copied["n"] == [1, (2.5, "x")] and copied["n"] is not state["n"]
    assert copy_state(state, copy_cpu=False, pin_memory=False)["a"] is base  # CPU tensors stay when not copying


def test_async_and_sync_saves_of_the_same_state_are_byte_identical(tmp_path):
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _train(model, optimizer, 3)
    sync = Checkpointer(tmp_path / "sync", model=model, optimizer=optimizer, preempt_signals=())
    background = Checkpointer(tmp_path / "async", model=model, optimizer=optimizer, preempt_signals=(), async_save=True)
    for ckpt in (sync, background):
        ckpt.global_step = 3
    expected = sync.save()
    path = background.save()
    _train(model, optimizer, 2)  # the loop goes on at once: the write in flight must hold step 3's state
    assert background.wait() == path == tmp_path / "async" / expected.name
    sync.close(), background.close()
    assert _files(path) == _files(expected)
    assert _manifest_without_time(path) == _manifest_without_time(expected)
    verify_checkpoint(path)


class Numbers(torch.utils.data.Dataset):
    def __len__(self):
        return 20

    def __getitem__(self, index):
        return torch.full((6,), float(index)), torch.tensor(index % 3)


def _run_loop(folder: Path, async_save: bool) -> list[Path]:
    """Two epochs with a loader: cadence saves, epoch-end checkpoints replaced at the next epoch, metrics, best."""
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddpkit.DataLoader(Numbers(), 6, seed=1)
    ckpt = Checkpointer(
        folder,
        model=model,
        optimizer=optimizer,
        loader=loader,
        every_steps=3,
        keep=10,
        best_metric="accuracy",
        preempt_signals=(),
        async_save=async_save,
    )
    for epoch in range(ckpt.resume("never").epoch, 2):
        loader.set_epoch(epoch)
        for x, y in loader:
            nn.functional.cross_entropy(model(x)[:, :3], y).backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.step()
        ckpt.epoch_end({"accuracy": 0.5 + 0.1 * epoch})
    ckpt.close()
    return [info.path for info in list_checkpoints(folder)] + [info.path for info in list_checkpoints(folder, "best-")]


def test_a_loop_with_async_saves_writes_the_files_a_sync_loop_writes(tmp_path):
    expected, written = _run_loop(tmp_path / "sync", False), _run_loop(tmp_path / "async", True)
    assert [path.name for path in written] == [path.name for path in expected]
    # Steps 3 and 6 (cadence), 4 and 8 (epoch ends, each replaced at the next epoch's start or close(), with
    # its metrics), and the best one (the second epoch's: the first epoch's best was deleted then).
    assert [path.name for path in expected] == [
        "step-000000003",
        "step-000000004",
        "step-000000006",
        "step-000000008",
        "best-000000008",
    ]
    for got, want in zip(written, expected, strict=True):
        assert _files(got) == _files(want), got.name
        assert _manifest_without_time(got) == _manifest_without_time(want), got.name
        verify_checkpoint(got)


def test_a_failed_background_write_is_raised_at_the_next_wait(tmp_path, monkeypatch):
    import ddpkit.checkpoint.disk.writer as writer

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer, "write_checkpoint", full_disk)
    ckpt = Checkpointer(tmp_path, model=_model(), preempt_signals=(), async_save=True)
    ckpt.save()  # returns: the write fails on the writer's thread
    with pytest.raises(StorageError, match="cannot write checkpoint .*step-000000000: No space left on device"):
        ckpt.wait()
    ckpt.close()


CHILD = """
import os, sys, time, threading
from pathlib import Path
import torch
from torch import nn
import ddpkit.checkpoint.disk.format as fmt
from ddpkit import Checkpointer

folder, marks = Path(sys.argv[1]), Path(sys.argv[2])
real_write = fmt.write_file_atomic

def write_then_hang(target, name, write, mode=0o600):
    result = real_write(target, name, write, mode)
    if "000000002" in str(target) and name == "model.pt" and threading.current_thread().name != "MainThread":
        (marks / "writing").touch()   # step 2's model.pt is on disk, its manifest is not
        time.sleep(600)
    return result

fmt.write_file_atomic = write_then_hang
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
optimizer = torch.optim.Adam(model.parameters())
ckpt = Checkpointer(folder, model=model, optimizer=optimizer, preempt_signals=(), async_save=True)
for step in (1, 2):
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    ckpt.global_step = step
    ckpt.save()
    if step == 1:
        ckpt.wait()
(marks / "trained-on").touch()        # save() returned while step 2 is being written
time.sleep(600)
"""


def test_an_async_save_killed_mid_write_leaves_the_previous_checkpoint_newest_and_complete(tmp_path):
    folder, marks = tmp_path / "checkpoints", tmp_path / "marks"
    marks.mkdir()
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(folder), str(marks)],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not ((marks / "writing").exists() and (marks / "trained-on").exists()):
            assert child.poll() is None, child.stderr.read()
            assert time.monotonic() < deadline, "the child never reached its second save"
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
        child.stderr.close()
    found = list_checkpoints(folder)
    assert [(info.global_step, info.complete) for info in found] == [(1, True), (2, False)]
    assert (found[1].path / "model.pt").exists()  # killed mid-write, not before it began
    verify_checkpoint(found[0].path)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 64))
    again = Checkpointer(folder, model=model, optimizer=torch.optim.Adam(model.parameters()), preempt_signals=())
    start = again.resume("auto")
    again.close()
    assert (start.global_step, start.path) == (1, found[0].path)
    assert json.loads((found[0].path / MANIFEST).read_text())["global_step"] == 1


def test_async_save_auto_writes_in_the_background_for_a_gpu_model_only():
    from ddpkit.checkpoint.options import CheckpointOptions

    auto = CheckpointOptions()
    assert auto.async_save == "auto"
    assert auto.resolve_async_save([torch.device("cuda", 0), torch.device("cpu")])
    assert not auto.resolve_async_save([torch.device("cpu")])
    assert CheckpointOptions(async_save=True).resolve_async_save([torch.device("cpu")])  # Python's bool, as typed
    assert not CheckpointOptions(async_save=False).resolve_async_save([torch.device("cuda", 1)])
    for word in ("sometimes", "true"):  # a word is the command line's: Python passes True or False
        with pytest.raises(
            ddpkit.UserError, match=f"async_save='{word}' is not valid; choose one of: 'auto', True, False"
        ):
            CheckpointOptions(async_save=word)  # type: ignore[arg-type]


def test_the_command_line_gives_async_save_as_the_bool_or_auto_the_options_hold():
    from ddpkit.keyvalue import ConfigError
    from ddpkit.train.config import parse_train_config

    for word, value in (("true", True), ("false", False), ("auto", "auto")):
        assert parse_train_config([f"checkpoint.async_save={word}"]).checkpoint.async_save == value
        assert type(parse_train_config([f"checkpoint.async_save={word}"]).checkpoint.async_save) is type(value)
    with pytest.raises(
        ConfigError, match="checkpoint.async_save='sometimes' is not valid; choose one of: auto, true, false"
    ):
        parse_train_config(["checkpoint.async_save=sometimes"])


def test_a_cpu_model_saves_synchronously_by_default(tmp_path):
    model = nn.Linear(4, 4)
    ckpt = Checkpointer(tmp_path, model=model, preempt_signals=())
    assert ckpt.async_save is False
    assert Checkpointer(tmp_path / "b", model=model, preempt_signals=(), async_save=True).async_save is True
