"""Models and helpers for the checkpoint, resume, elastic, preemption and export tests.

Models are named by import path (``model=tests.train.checkpoint_helpers:mlp_dropout``).
The ``signalled`` model sends a signal to its own process at a chosen training
step on the first run only (restart count 0), driven by environment variables:

- DDPKIT_TEST_SIGNAL_STEP: the global step (1-based) whose forward sends it;
- DDPKIT_TEST_SIGNAL_RANK: the rank that sends it (default 1);
- DDPKIT_TEST_SIGNAL: the signal name (default SIGKILL);
- DDPKIT_TEST_SIGNAL_TARGET: "self" (default), "parent" (the launcher) or "group" (the launcher's process
  group, as the terminal sends Ctrl-C);
- DDPKIT_TEST_STEP_SLEEP: seconds each training forward sleeps (default 0).

``always_fails`` appends its restart count to DDPKIT_TEST_ATTEMPTS on every
attempt and fails on rank 1.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import torch
import torch._dynamo  # noqa: F401  # sets TORCHINDUCTOR_CACHE_DIR when first imported: here, not inside a test
from torch import nn
from torch.utils.data import TensorDataset

from ddpkit import distributed
from ddpkit.checkpoint.disk.format import list_checkpoints, verify_checkpoint
from ddpkit.checkpoint.rng import capture_rng_state
from ddpkit.data.datasets import DataOptions, load_datasets
from ddpkit.keyvalue import parse
from ddpkit.models.registry import get_model_spec
from ddpkit.train.config import TrainConfig
from ddpkit.train.loop import Trainer
from ddpkit.train.run import build_trainer

if TYPE_CHECKING:
    from tests.helpers.launch_in_process import Commands


def mlp_dropout() -> nn.Module:
    """A small MLP with dropout, so that a resume must restore the RNG to be exact."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 10))


BUILT_ON: list[str] = []
"""Where :func:`mlp_dropout_recording` was built in this process: the default device then (cpu or meta)."""


def mlp_dropout_recording() -> nn.Module:
    """mlp_dropout, noting in BUILT_ON the device it is built on."""
    BUILT_ON.append(torch.empty(0).device.type)
    return mlp_dropout()


def mlp_dropout_not_on_meta() -> nn.Module:
    """mlp_dropout from a function that cannot run on the meta device (as a model that reads its tensors)."""
    if torch.empty(0).device.type == "meta":
        raise NotImplementedError("this model reads its tensors' values while it is built")
    return mlp_dropout()


def mlp_dropout_new_head() -> nn.Module:
    """mlp_dropout with a different last layer (5 classes) and one extra layer: a transfer target."""
    return nn.Sequential(
        nn.Flatten(), nn.Linear(784, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 5), nn.Linear(5, 10)
    )


class _Signalled(nn.Module):
    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.calls = 0
        self.step = int(os.environ.get("DDPKIT_TEST_SIGNAL_STEP", "0"))
        self.first_run = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        self.mine = os.environ.get("RANK", "0") == os.environ.get("DDPKIT_TEST_SIGNAL_RANK", "1")
        self.signal = getattr(signal, os.environ.get("DDPKIT_TEST_SIGNAL", "SIGKILL"))
        self.target = os.environ.get("DDPKIT_TEST_SIGNAL_TARGET", "self")
        self.sleep = float(os.environ.get("DDPKIT_TEST_STEP_SLEEP", "0"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
            if self.calls == self.step and self.first_run and self.mine:
                if self.target == "group":
                    os.killpg(os.getpgid(_launcher_pid()), self.signal)
                else:
                    os.kill(_launcher_pid() if self.target == "parent" else os.getpid(), self.signal)
            if self.sleep:
                time.sleep(self.sleep)
        return self.inner(x)


def _launcher_pid() -> int:
    # ddpkit's launcher forks its workers from a server process it started: the launcher is the server's parent.
    parent = psutil.Process().parent()
    return parent.parent().pid if "forkserver" in " ".join(parent.cmdline()) else parent.pid


def signalled() -> nn.Module:
    """mlp_dropout that signals its own process at DDPKIT_TEST_SIGNAL_STEP (see the module docstring)."""
    return _Signalled(mlp_dropout())


def always_fails() -> nn.Module:
    """Fails on rank 1 at every attempt, after noting the attempt's restart count in DDPKIT_TEST_ATTEMPTS."""
    if os.environ.get("RANK") == "1":
        with open(os.environ["DDPKIT_TEST_ATTEMPTS"], "a") as f:
            f.write(os.environ.get("TORCHELASTIC_RESTART_COUNT", "?") + "\n")
        raise RuntimeError("rank 1 fails on purpose")
    return mlp_dropout()


class _KillsTheJobWhenPickled:
    """A model's extra state; pickling it (inside ``torch.save``, mid-write) at or after a chosen step SIGKILLs.

    It is saved as an empty OrderedDict, which ``torch.load(weights_only=True)`` accepts.
    """

    def __init__(self, model: _KilledMidSave):
        self.model = model

    def __reduce__(self):
        step = int(os.environ.get("DDPKIT_TEST_KILL_SAVE_STEP", "0"))
        if step and self.model.calls >= step:
            os.killpg(os.getpgrp(), signal.SIGKILL)  # the whole job, as a power cut would
        return (collections.OrderedDict, ())


class _KilledMidSave(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.calls += 1
        return self.inner(x)

    def get_extra_state(self) -> _KillsTheJobWhenPickled:
        return _KillsTheJobWhenPickled(self)

    def set_extra_state(self, state: object) -> None:
        pass


def killed_mid_save() -> nn.Module:
    """An MLP whose first checkpoint write after global step DDPKIT_TEST_KILL_SAVE_STEP SIGKILLs its process group.

    The kill comes from inside ``torch.save`` of ``model.pt``: the checkpoint's
    folder and the model file's temporary file exist, its manifest does not.
    """
    return _KilledMidSave()


# -- in-process trainers --------------------------------------------------------


def make_trainer(rank: int, world_size: int, words: list[str], *, with_indices: bool = False) -> Trainer:
    """A Trainer for ``words`` (key=value) on synthetic data, built by ``build_trainer`` as ``ddpkit train`` does.

    Joins the job through ``ddpkit.init``: it adopts the caller's process group
    (``run_on_ranks``) or, alone, forms a one-rank group. Leave it with
    ``distributed.shutdown()`` (:func:`train` does); a failing build leaves it here.

    Args:
        with_indices: the training samples carry their index as a third tensor
            (``(x, y, index)``: the loop ignores it), to record which samples each step trained on.
    """
    cfg = parse(TrainConfig, ["dataset=synthetic", "progress=false", "allreduce=builtin", "device=cpu", *words])
    ctx = distributed.init(cfg.backend, cfg.device, cfg.timeout, cfg.threads, environ={})
    try:
        assert (ctx.rank, ctx.world_size) == (rank, world_size), (ctx.rank, ctx.world_size)
        train_set, test_set = load_datasets("synthetic", DataOptions(synthetic_samples=cfg.synthetic_samples, seed=1))
        if with_indices:
            train_set = TensorDataset(*train_set.tensors, torch.arange(len(train_set)))
        return build_trainer(cfg, ctx, get_model_spec(cfg.model), train_set, test_set)
    except BaseException:
        distributed.shutdown()
        raise


def train(rank: int, world_size: int, words: list[str], **options) -> tuple[Trainer, Path | None]:
    """``make_trainer``, ``fit``, then close its checkpointer and leave the job (as ``run_worker`` does).

    Returns:
        The trainer, and the checkpoint it resumed from (None for a fresh start).
    """
    trainer = make_trainer(rank, world_size, words, **options)
    # Until the first save, the checkpointer's last path is the checkpoint resume() restored.
    start = trainer.checkpointer.last_path if trainer.checkpointer is not None else None
    try:
        trainer.fit()
    finally:
        if trainer.checkpointer is not None:
            trainer.checkpointer.close()
        distributed.shutdown()
    return trainer, start


def close(trainer: Trainer) -> None:
    """Close the checkpointer and metrics file of a trainer from ``make_trainer`` and leave the job."""
    if trainer.checkpointer is not None:
        trainer.checkpointer.close()
    trainer.metrics.close()
    distributed.shutdown()


def final_state(trainer: Trainer) -> dict:
    """Model, optimizer and RNG state and the position at the end of training, for bit-exact comparison.

    A sharded model's tensors (DTensors) are this rank's shards: equal on every rank means equal as a whole.
    """
    optimizer = trainer.optimizer.state_dict()["state"]
    return {
        "model": {k: _local(v) for k, v in trainer.module.state_dict().items()},
        "optimizer": {i: {k: _local(v) for k, v in s.items()} for i, s in optimizer.items()},
        "rng": capture_rng_state(),
        "state": {
            **trainer.state.state_dict(),
            "epoch": trainer.loader.epoch,
            "step_in_epoch": trainer.loader.step_in_epoch,
        },
    }


def _local(value: Any) -> Any:
    """A copy of a tensor, or of this rank's shard of a DTensor; anything else as it is."""
    if hasattr(value, "to_local"):
        return value.to_local().clone()
    return value.clone() if isinstance(value, torch.Tensor) else value


def assert_bit_equal(a: dict, b: dict, what: str = "") -> None:
    """Model, optimizer and RNG states are equal bit for bit."""
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), f"{what}: model tensor {name} differs"
    assert a["optimizer"].keys() == b["optimizer"].keys()
    for index in a["optimizer"]:
        for key in a["optimizer"][index]:
            assert torch.equal(a["optimizer"][index][key], b["optimizer"][index][key]), (
                f"{what}: optimizer state {index}.{key} differs"
            )
    ra, rb = a["rng"], b["rng"]
    assert torch.equal(ra["torch"], rb["torch"]), f"{what}: torch RNG differs"
    assert ra["python"] == rb["python"], f"{what}: Python RNG differs"
    assert torch.equal(ra["numpy"]["keys"], rb["numpy"]["keys"]) and ra["numpy"]["pos"] == rb["numpy"]["pos"], (
        f"{what}: NumPy RNG differs"
    )
    for key in ("global_step", "samples_seen", "epoch", "step_in_epoch"):
        assert a["state"][key] == b["state"][key], f"{what}: {key} differs"


class LogRecords(logging.Handler):
    """Collects the messages of ddpkit's logger while installed (``with LogRecords() as logs``)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelname, record.getMessage()))

    def __enter__(self) -> LogRecords:
        logger = logging.getLogger("ddpkit")
        self._level = logger.level
        logger.addHandler(self)
        logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        logger = logging.getLogger("ddpkit")
        logger.removeHandler(self)
        logger.setLevel(self._level)

    def warnings(self) -> list[str]:
        """The warning messages."""
        return [message for level, message in self.messages if level == "WARNING"]


# -- whole jobs through the ddpkit command -----------------------------------------

CLI_WORDS = [
    "nproc=2",
    "model=tests.train.checkpoint_helpers:signalled",
    "dataset=synthetic",
    "synthetic_samples=256",
    "batch_size=16",
    "epochs=2",
    "allreduce=builtin",
    "threads=1",
    "progress=false",
    "checkpoint.every_steps=4",
    "checkpoint.keep=100",
    "checkpoint.sync_seconds=0.001",
]
"""A 2-worker job of 2 x 16 steps; agreement on signals after every step, every checkpoint kept."""
CLI_TOTAL_STEPS = 32


def run_job(output_dir, *words: str, env: dict[str, str] | None = None, timeout: float = 240):
    """``ddpkit train CLI_WORDS... output_dir=...`` as a user runs it, in a process of its own."""
    from tests.cli_runner import run_ddpkit

    return run_ddpkit("train", *CLI_WORDS, f"output_dir={output_dir}", *words, cwd=output_dir, env=env, timeout=timeout)


def run_job_here(commands: Commands, output_dir, *words: str, env: dict[str, str] | None = None):
    """``ddpkit train CLI_WORDS... output_dir=...`` in this process, its workers forked from the server of
    ``commands`` (tests/helpers/launch_in_process.py)."""
    return commands.run("train", *CLI_WORDS, f"output_dir={output_dir}", *words, cwd=output_dir, env=env)


def manifests(output_dir) -> list[dict]:
    """The manifests of the complete step checkpoints under ``output_dir``, oldest first."""
    return [info.manifest for info in list_checkpoints(os.path.join(output_dir, "checkpoints")) if info.manifest]


def final_weights(output_dir) -> dict[str, torch.Tensor]:
    """The model weights of the newest checkpoint under ``output_dir`` (verified, weights_only)."""
    newest = [i for i in list_checkpoints(os.path.join(output_dir, "checkpoints")) if i.manifest][-1]
    assert newest.manifest["global_step"] == CLI_TOTAL_STEPS, newest.path
    return verify_checkpoint(newest.path)["model.pt"]


_REFERENCE: dict[str, dict[str, torch.Tensor]] = {}


def reference_weights(commands: Commands | None = None) -> dict[str, torch.Tensor]:
    """Final weights of the uninterrupted CLI_WORDS job (run once per test session), run in ``commands``
    (or in a block of its own)."""
    if "weights" not in _REFERENCE:
        folder = tempfile.mkdtemp(prefix="ddpkit-reference-")
        atexit.register(shutil.rmtree, folder, True)
        from tests.helpers.launch_in_process import Commands

        with contextlib.nullcontext(commands) if commands is not None else Commands() as block:
            out = run_job_here(block, folder)
        assert out.returncode == 0, out.stderr
        _REFERENCE["weights"] = final_weights(folder)
    return _REFERENCE["weights"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    """Equal bit for bit."""
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what}: {name} differs"
