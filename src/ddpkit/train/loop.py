"""The training loop of ``ddpkit train``: one readable file on ddpkit's public API.

Everything it relies on is what a user's own script gets: the model comes from
``ddpkit.prepare_model`` (gradients averaged over the ranks at the end of
backward), batches from ``ddpkit.DataLoader`` (global batches independent of
the world size), checkpoints from ``ddpkit.Checkpointer``, exact evaluation
from ``ddpkit.reduce_sums``. Each optimizer step::

    loss = loader.global_mean(task.loss_sum(model(x), x, y))   # exact mean over the global batch
                                                                # (task.loss_mean where the shares are equal)
    scaler.scale(loss).backward()                               # gradients synchronised here
    optimizer.step(); scheduler.step(); optimizer.zero_grad()
    checkpointer.step()                                         # saves when due, handles preemption

Per step the loop does no host synchronisation: the running loss stays a
tensor and is read every ``log_every`` steps.

A loss that turns NaN or infinite stops the run (:class:`TrainingDiverged`,
exit status ``EXIT_DIVERGED``) with one line naming the steps and the last
good checkpoint, which is kept; no checkpoint of the non-finite state is
written. Two checks, each where the loop synchronises anyway:

- every ``log_every`` steps, the running loss of the window (a sum: one
  NaN or infinity in any of its steps makes it non-finite), agreed by all
  ranks with one all_reduce of one number;
- at a step where a checkpoint is due by the loop's own clock (an epoch's
  last step, a multiple of ``checkpoint.every_steps``, ``max_steps``), the
  model's tensors themselves (one ``isfinite`` per tensor, one transfer to
  the host: a checkpoint copies them to the host right after anyway). The
  weights are the same on every rank, so every rank decides alike. This
  also catches weights that overflowed in the very step before the save,
  whose loss was still finite.

Saves the loop cannot foresee (``every_seconds``, a preemption) are guarded
by the Checkpointer, which marks a checkpoint of non-finite weights so that
it never counts toward ``keep`` nor is resumed. With fp16's gradient scaler
(CUDA) an infinite loss is part of its normal work (the step is skipped and
the scale lowered), so there the run stops only when the weights are non-finite.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm  # type: ignore[import-untyped]  # tqdm ships no type information

from ddpkit import (
    Checkpointer,
    Context,
    DataLoader,
    gradient_sync,
    is_sharded,
    no_sync,
    reduce_sums,
    unwrap_model,
)
from ddpkit.checkpoint import NONFINITE_SUFFIX, last_finite_checkpoint, nonfinite_tensors, set_aside
from ddpkit.distributed import control_device
from ddpkit.errors import UserError
from ddpkit.log import get_logger, stderr_is_terminal
from ddpkit.names import EXIT_DIVERGED
from ddpkit.train.config import TrainConfig
from ddpkit.train.metrics_file import MetricsWriter
from ddpkit.train.state import TrainState
from ddpkit.train.task import Task, split_batch


class StopTraining(Exception):
    """Raised inside the loop to end training after the current step (fit returns its summary)."""


class TrainingDiverged(UserError):
    """The training loss (or the weights) became NaN or infinite; the message names the steps, the last good
    checkpoint and the fix."""

    exit_status = EXIT_DIVERGED
    """The exit status of the worker and of ``ddpkit train``."""


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Samples per optimizer step over all workers, from batch_size and batch_scope."""
    return cfg.batch_size * world_size if cfg.batch_scope == "per_worker" else cfg.batch_size


def build_optimizer(cfg: TrainConfig, params: Any, world_size: int) -> torch.optim.Optimizer:
    """Adam or SGD with momentum (fused kernels), the learning rate scaled by world_size if asked."""
    lr = cfg.lr * (world_size if cfg.scale_lr else 1)
    # fused: one kernel for all parameters instead of ~8 small ops each; on a
    # small model (W1) the optimizer step is otherwise a third of the step time.
    if cfg.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=cfg.weight_decay, fused=True)
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay, fused=True)


@dataclass
class Trainer:
    """Trains a prepared model on a DataLoader; the parts are built by :func:`ddpkit.train.run.build_trainer`."""

    cfg: TrainConfig
    ctx: Context
    model: nn.Module
    """The model as ``ddpkit.prepare_model`` returned it (DDP-wrapped or not)."""
    optimizer: torch.optim.Optimizer
    loader: DataLoader
    test_loader: DataLoader
    task: Task
    scheduler: Any = None
    scaler: torch.amp.GradScaler | None = None
    checkpointer: Checkpointer | None = None
    dataset_name: str = ""
    state: TrainState = field(default_factory=TrainState)
    train_loader_for_eval: DataLoader | None = None

    def __post_init__(self) -> None:
        self.module = unwrap_model(self.model)
        self._finite_at = 0
        """The global step up to which the weights are known finite (a resumed checkpoint's, a passed check)."""
        self.metrics = MetricsWriter(self.cfg.output_dir, enabled=self.ctx.is_main_process, tracker=self.state.tracker)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.cfg.precision)
        sync = gradient_sync(self.model)
        self.grad_sync = sync.mode if sync is not None else ("fsdp" if is_sharded(self.model) else "none")
        self.allreduce = sync.allreduce if sync is not None else "none"

    # -- one step -------------------------------------------------------------

    def _forward_context(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype)

    def _on_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(input, target or None) of a DataLoader batch, on this worker's device.

        ddpkit.DataLoader hands out batches on a CUDA worker's device already (its
        ``device="auto"``): tensors already there are taken as they are, without a
        ``.to`` call (a few microseconds a step); those of a loader that keeps them
        on the CPU are moved.
        """
        x, y = split_batch(batch)
        return _on(x, self.ctx.device), (_on(y, self.ctx.device) if y is not None else None)

    def _backward(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """Backward of this share's part of the global batch's mean loss; returns that loss, detached."""
        with self._forward_context():
            output = self.model(x)
        if len(x) * self.ctx.world_size == self.loader.last_global_batch_length:
            # global_mean would scale the sum by 1 / len(x): the share's mean, in one operation instead of three.
            loss = self.task.loss_mean(output, x, y)
        else:  # an epoch's last, uneven batch, an empty share, a micro-batch
            loss = self.loader.global_mean(self.task.loss_sum(output, x, y))  # the global mean once averaged over ranks
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        return loss.detach()

    def train_step(self, batch: Any) -> torch.Tensor:
        """One optimizer step on this rank's share of a global batch; returns its loss (a tensor).

        The loss returned is the share's part of the global mean loss times the
        world size: the share's own mean loss wherever the ranks' shares are
        equal (every step but an epoch's last, smaller one). Tensor operations
        are counted here: a step of W1 is about 250 us and each costs a few, so
        the loss is computed in one where it can be and returned as it is.
        """
        x, y = self._on_device(batch)
        k = self.cfg.grad_accum_steps
        if k == 1:
            total = self._backward(x, y)
        else:
            micro_x = torch.tensor_split(x, k)
            micro_y = torch.tensor_split(y, k) if y is not None else [None] * k
            total = torch.zeros((), device=self.ctx.device)
            for i, (mx, my) in enumerate(zip(micro_x, micro_y)):
                # Every micro-batch but the last accumulates locally; the last one synchronises.
                with no_sync(self.model) if i < k - 1 else contextlib.nullcontext():
                    total = total + self._backward(mx, my)
        if self.scaler is not None and self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad()
        return total

    # -- one epoch ------------------------------------------------------------

    def train_epoch(self) -> None:
        """Train the rest of the loader's current epoch."""
        state, loader, cfg = self.state, self.loader, self.cfg
        self.model.train()
        bar = self._progress_bar()
        window = _Window(torch.zeros((), device=self.ctx.device), 0, 0, time.perf_counter())
        clock = _TrainClock(state, self.checkpointer)
        try:
            for batch in loader:
                window.running += self.train_step(batch)
                count = loader.last_global_batch_length
                state.global_step += 1
                state.samples_seen += count
                window.steps += 1
                window.samples += count
                if self._save_due():
                    self._check_weights()
                stop = bool(cfg.max_steps and state.global_step >= cfg.max_steps)
                # A line every log_every steps, and one for the steps left at an epoch's end or at max_steps, so
                # that every step is logged once and a line's loss is the mean of the steps it covers.
                if state.global_step % cfg.log_every == 0 or loader.step_in_epoch >= loader.steps_per_epoch or stop:
                    self._check_loss(window)
                    window = self._log_window(bar, window)
                if self.checkpointer is not None:
                    clock.update()  # a checkpoint written now holds the train time up to this step
                    self.checkpointer.step()
                if stop and loader.step_in_epoch < loader.steps_per_epoch:
                    raise StopTraining(f"max_steps={cfg.max_steps} reached")
        finally:  # also when training stops mid-epoch
            clock.update()
            if bar is not None:
                bar.close()

    # -- non-finite loss (see the module docstring) ---------------------------

    def _save_due(self) -> bool:
        """True at a step where a checkpoint is due by the loop's clock: an epoch's last step, every_steps, max_steps."""
        if self.checkpointer is None or not self.cfg.checkpoint.enabled:
            return False
        step, every, loader = self.state.global_step, self.cfg.checkpoint.every_steps, self.loader
        return (
            loader.step_in_epoch >= loader.steps_per_epoch
            or bool(every and step % every == 0)
            or bool(self.cfg.max_steps and step >= self.cfg.max_steps)
        )

    def _check_weights(self) -> None:
        """Stop (TrainingDiverged) when the model's tensors hold NaN or infinity; else they are good up to here.

        Replicated weights are the same on every rank; a sharded model's ranks each check their shards and agree.
        """
        bad = nonfinite_tensors(self.module.state_dict())
        if self.grad_sync == "fsdp" and self.ctx.world_size > 1:
            flag = torch.tensor([float(bool(bad))], device=control_device())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item() and not bad:
                bad = ["another rank's shards"]
        if bad:
            self._diverged(f"the weights hold NaN or infinity ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''})")
        self._finite_at = self.state.global_step

    def _check_loss(self, window: _Window) -> None:
        """Stop (TrainingDiverged) when the window's running loss is NaN or infinite on some rank."""
        flag = (~torch.isfinite(window.running)).to(torch.float32)
        if self.ctx.world_size > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        if not flag.item():
            return
        if self.scaler is not None and self.scaler.is_enabled():
            self._check_weights()  # fp16's scaler skips steps of infinite gradients: only NaN weights stop
            return
        loss = window.running.item() / window.steps
        self._diverged(f"the training loss became {loss}")

    def _diverged(self, what: str) -> None:
        """Raise TrainingDiverged naming the steps and the last good checkpoint (rank 0 sets later ones aside)."""
        cfg, step = self.cfg, self.state.global_step
        window = max(self._finite_at, step - cfg.log_every)
        box = ["no checkpoint was written before; start over"]
        if self.checkpointer is not None:
            self.checkpointer.wait()  # (a collective) a write in flight is complete before its files are judged
            if self.ctx.is_main_process:
                path, bad = last_finite_checkpoint(self.checkpointer.root, suspect_from=max(window - 1, 0))
                for folder in bad:
                    aside = set_aside(folder, NONFINITE_SUFFIX)
                    get_logger().warning(f"set {folder} aside as {aside.name}: its weights are NaN or infinite")
                if path is not None:
                    box = [f"the last good checkpoint, {path}, is kept; continue from it with resume=auto lr=..."]
            if self.ctx.world_size > 1:
                dist.broadcast_object_list(box, src=0, device=control_device())
        good = box[0]
        raise TrainingDiverged(
            f"{what} between global steps {window} and {step} (epoch {self.loader.epoch + 1}); lower lr "
            f"(now {cfg.lr}) or check the data and the model: {good}"
        )

    def _log_window(self, bar: Any, window: _Window) -> _Window:
        """Write the window's train line (rank 0) and move the progress bar; returns the next, empty window."""
        now = time.perf_counter()
        if self.ctx.is_main_process:
            # Rank 0's mean loss over the window's steps: a cheap estimate of the global loss.
            loss = window.running.item() / window.steps
            rate = window.samples / max(now - window.start, 1e-9)
            self.metrics.write(
                "train",
                epoch=self.loader.epoch,
                global_step=self.state.global_step,
                loss=round(loss, 6),
                samples_per_s=round(rate, 1),
                lr=self.optimizer.param_groups[0]["lr"],
            )
            if bar is not None:
                bar.update(window.steps)
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
        return _Window(torch.zeros((), device=self.ctx.device), 0, 0, now)

    def _progress_bar(self) -> Any:  # a tqdm bar (untyped), or None
        if not (self.ctx.is_main_process and self.cfg.progress and stderr_is_terminal()):
            return None
        return tqdm(
            total=self.loader.steps_per_epoch,
            initial=self.loader.step_in_epoch,
            desc=f"epoch {self.loader.epoch + 1}/{self.cfg.epochs}",
            unit="step",
            leave=False,
            file=sys.stderr,
        )

    # -- evaluation -----------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, loader: DataLoader) -> dict[str, float]:
        """Exact loss and accuracy (or MSE) over every sample of ``loader``'s dataset, each seen by one rank."""
        self.model.eval()
        sums: dict[str, Any] = {}
        for batch in loader:
            x, y = self._on_device(batch)
            with self._forward_context():
                output = self.module(x)
            for key, value in self.task.metric_sums(output, x, y).items():
                sums[key] = sums.get(key, 0) + value
        self.model.train()
        return self.task.metrics(reduce_sums(sums))

    # -- the whole run --------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``cfg.epochs`` are complete (or ``max_steps``) and return the run summary."""
        log, cfg = get_logger(), self.cfg
        sync = gradient_sync(self.model)
        if sync is not None:
            log.info(sync.describe())
        elif is_sharded(self.model):
            log.info(
                f"sharded (FSDP2) over {self.ctx.world_size} worker(s): gradients reduce-scattered, each worker "
                "keeps its shard of the parameters, gradients and optimizer state"
            )
        else:
            log.info("single worker: no gradient synchronisation")
        test: dict[str, float] = {}
        tested_at = -1
        self._finite_at = self.state.global_step  # resumed from a verified checkpoint
        if self.loader.epoch >= cfg.epochs:
            log.info(
                f"this run is finished: all {cfg.epochs} epochs are complete; nothing to train "
                "(raise epochs=... to train on, or start a new run without resume)"
            )
        try:
            for epoch in range(self.loader.epoch, cfg.epochs):
                if cfg.max_steps and self.state.global_step >= cfg.max_steps:
                    raise StopTraining(f"max_steps={cfg.max_steps} reached")
                self.loader.set_epoch(epoch)
                self.train_epoch()
                evaluated: dict[str, float] = {}
                if cfg.eval_every_epoch or epoch + 1 == cfg.epochs:
                    test = evaluated = self.evaluate(self.test_loader)
                    tested_at = self.state.global_step
                    self.metrics.write(
                        "eval", epoch=epoch + 1, global_step=self.state.global_step, split="test", **test
                    )
                    log.info(
                        f"epoch {epoch + 1}/{cfg.epochs}: test {_format(test)} (train time {self.state.train_time:.2f}s)"
                    )
                if self.checkpointer is not None:
                    self.checkpointer.epoch_end(evaluated)
        except StopTraining as stop:
            log.info(
                f"stopped after global step {self.state.global_step} (epoch {self.loader.epoch + 1}, "
                f"step {self.loader.step_in_epoch}): {stop}"
            )
            if self.checkpointer is not None and cfg.checkpoint.enabled:
                self.checkpointer.save("max_steps")
        if tested_at != self.state.global_step:  # stopped mid-epoch, or resumed with nothing left to train
            test = self.evaluate(self.test_loader)
            # epoch: the epochs trained, a fraction mid-epoch (as the plot's epoch axis reads it)
            done = self.loader.epoch + self.loader.step_in_epoch / self.loader.steps_per_epoch
            self.metrics.write("eval", epoch=done, global_step=self.state.global_step, split="test", **test)
            log.info("test " + _format(test))
        if self.checkpointer is not None:
            self.checkpointer.close()  # the last epoch's checkpoint, while metrics.jsonl (on_save) is open
        summary = self.summary(test)
        self.metrics.write("summary", **summary)
        self.metrics.close()
        if self.state.tracker is not None:
            self.state.tracker.close({key: value for key, value in summary.items() if key != "config"})
        return summary

    def summary(self, test: dict[str, float]) -> dict[str, Any]:
        """Train time, throughput and final metrics of the run."""
        summary = {
            "model": self.cfg.model,
            "dataset": self.dataset_name,
            "task": self.task.name,
            "world_size": self.ctx.world_size,
            "allreduce": self.allreduce,
            "grad_sync": self.grad_sync,
            "epochs": self.loader.epoch + (self.loader.step_in_epoch >= self.loader.steps_per_epoch),
            "global_steps": self.state.global_step,
            "train_time_s": round(self.state.train_time, 4),
            "samples_per_s": round(self.state.samples_seen / max(self.state.train_time, 1e-9), 1),
            "test": test,
            "config": dataclasses.asdict(self.cfg),
        }
        if self.train_loader_for_eval is not None:
            summary["train"] = self.evaluate(self.train_loader_for_eval)
        return summary


@dataclass
class _Window:
    """The optimizer steps since the last train line: their summed loss (a tensor), count, samples and start time."""

    running: torch.Tensor
    steps: int
    samples: int
    start: float


class _TrainClock:
    """Keeps ``state.train_time`` up to date during an epoch: time since the epoch began, minus checkpoint saves."""

    def __init__(self, state: TrainState, checkpointer: Checkpointer | None):
        self.state, self.checkpointer = state, checkpointer
        self.base, self.start, self.saved = state.train_time, time.perf_counter(), self._save_seconds()

    def _save_seconds(self) -> float:
        return self.checkpointer.save_seconds if self.checkpointer is not None else 0.0

    def update(self) -> None:
        """Set the train time to what it is now."""
        elapsed = time.perf_counter() - self.start - (self._save_seconds() - self.saved)
        self.state.train_time = self.base + elapsed


def _on(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself where it is there (ddpkit.DataLoader placed it), else a non-blocking copy."""
    return tensor if tensor.device == device else tensor.to(device, non_blocking=True)


def _format(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" if k != "accuracy" else f"accuracy {100 * v:.2f}%" for k, v in metrics.items())
