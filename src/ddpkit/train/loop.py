"""The training loop: one readable file, lean enough that the framework costs little.

Each optimizer step takes this rank's share of one global batch (see
``ddpkit.data.sampler``), runs forward and backward, has the gradients
averaged over the ranks (``ddpkit.train.grad_sync``: DDP, one flat
all_reduce or the manual loop), and steps the optimizer. When the global
batch splits evenly, each rank's loss is the mean over its samples;
otherwise (the last batch of an epoch) it is the sum scaled by
``world_size / global_batch_length``. Either way, once averaged over the
ranks, the gradients are exactly the mean over the global batch.

Per step the loop does no host synchronisation: the running loss stays a
tensor and is read every ``log_every`` steps.
"""

from __future__ import annotations

import contextlib
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ddpkit.config import TrainConfig, to_dict
from ddpkit.data.datasets import TensorDataset
from ddpkit.data.sampler import GlobalBatchSampler, shard_range
from ddpkit.distributed import Context
from ddpkit.log import get_logger
from ddpkit.models.registry import ModelSpec
from ddpkit.train import grad_sync
from ddpkit.train.metrics import MetricsWriter, reduce_sums
from ddpkit.train.state import TrainState

EVAL_BATCH = 2000


class StopTraining(Exception):
    """Raised by a step or epoch callback to end training after the current step (fit returns its summary)."""


def global_batch_size(cfg: TrainConfig, world_size: int) -> int:
    """Samples per optimizer step over all workers, from batch_size and batch_scope."""
    return cfg.batch_size * world_size if cfg.batch_scope == "per_worker" else cfg.batch_size


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (CPU and CUDA) generators."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


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
    """Trains one registered model on one in-memory dataset, on this worker's shard.

    Args:
        cfg: the run's configuration.
        ctx: this worker's context (ranks, device).
        dataset: the whole dataset (every worker holds it; batches are indexed).
        spec: the registered model.
    """

    cfg: TrainConfig
    ctx: Context
    dataset: TensorDataset
    spec: ModelSpec
    state: TrainState = field(default_factory=TrainState)
    step_callbacks: list[Callable[[Trainer], None]] = field(default_factory=list)
    """Called after every optimizer step (checkpointing hooks in here)."""
    epoch_callbacks: list[Callable[[Trainer, dict[str, float]], None]] = field(default_factory=list)
    """Called after every epoch and its evaluation, with the test metrics ({} when not evaluated)."""

    def __post_init__(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        seed_everything(cfg.seed)
        model = self.spec.build().to(ctx.device)
        if cfg.init_from or cfg.freeze:
            # Before wrapping: DDP must not expect gradients of frozen parameters.
            from ddpkit.train.transfer import prepare_model

            for line in prepare_model(model, cfg.init_from, cfg.freeze).lines():
                get_logger().info(line)
        if cfg.sync_batchnorm and ctx.world_size > 1:
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
        self.allreduce = grad_sync.choose_allreduce(cfg.allreduce, ctx)
        self.module = model
        mode = grad_sync.choose_grad_sync(cfg.grad_sync, model, cfg.sync_batchnorm)
        self.sync = grad_sync.GradientSync(model, ctx, self.allreduce, mode)
        self.model = self.sync.model
        self.optimizer = build_optimizer(cfg, model.parameters(), ctx.world_size)
        self.scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16" and ctx.device.type == "cuda")
        self.sampler = GlobalBatchSampler(
            len(self.dataset.train_labels), global_batch_size(cfg, ctx.world_size), ctx.rank, ctx.world_size, cfg.seed
        )
        self.dataset = self.dataset.to(ctx.device)
        self.metrics = MetricsWriter(cfg.output_dir, enabled=ctx.is_main_process)
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
        self.epoch_start_time = time.perf_counter()
        if cfg.max_steps:
            self.step_callbacks.append(_stop_at_max_steps)

    # -- batches and losses -------------------------------------------------

    def batch(self, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and labels of the training samples ``indices``.

        ``index_select`` rather than ``tensor[indices]``: advanced indexing of
        a 4-D tensor costs several times more, a visible share of a W1 step.
        """
        images = self.dataset.train_images.index_select(0, indices)
        return self.inputs(images), self.dataset.train_labels.index_select(0, indices)

    def inputs(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 images -> float32 in [0, 1], normalized as the model asks."""
        x = images.float().div_(255.0)
        if self.spec.normalize is not None:
            mean, std = self.spec.normalize
            x = x.sub_(mean).div_(std)
        return x

    def batch_loss(self, output: torch.Tensor, x: torch.Tensor, y: torch.Tensor, reduction: str) -> torch.Tensor:
        """The loss of a batch, summed or averaged over samples (MSE: per-sample mean over pixels)."""
        if self.spec.task == "classification":
            return F.cross_entropy(output.float(), y, reduction=reduction)
        loss = F.mse_loss(output.float(), x, reduction=reduction)
        return loss / x[0].numel() if reduction == "sum" else loss

    def _forward_context(self) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.ctx.device.type, dtype=self.autocast_dtype)

    # -- training -------------------------------------------------------------

    def train_step(self, indices: torch.Tensor, global_count: int) -> torch.Tensor:
        """One optimizer step on this rank's ``indices``; returns the mean loss of its samples (a tensor)."""
        self.sync.zero_grad(self.optimizer)
        if self.cfg.grad_accum_steps == 1:
            loss = self._forward_backward(indices, global_count)
        else:
            loss = self._accumulate(indices, global_count)
        self.sync.synchronize()
        if self.scaler.is_enabled():
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        return loss

    def _forward_backward(self, indices: torch.Tensor, global_count: int) -> torch.Tensor:
        x, y = self.batch(indices)
        with self._forward_context():
            output = self.model(x)
        if len(indices) * self.ctx.world_size == global_count:
            # Even split: the per-rank mean, averaged over ranks, is the global mean.
            loss = self.batch_loss(output, x, y, "mean")
            self.scaler.scale(loss).backward()
            return loss.detach()
        # Uneven last batch: weight each rank by its share of the global batch.
        summed = self.batch_loss(output, x, y, "sum")
        self.scaler.scale(summed * (self.ctx.world_size / global_count)).backward()
        return summed.detach() / max(len(indices), 1)

    def _accumulate(self, indices: torch.Tensor, global_count: int) -> torch.Tensor:
        scale = self.ctx.world_size / global_count
        micro_batches = torch.tensor_split(indices, self.cfg.grad_accum_steps)
        total = torch.zeros((), device=self.ctx.device)
        for i, micro in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            sync = contextlib.nullcontext() if last else self.sync.accumulating()
            with sync:
                x, y = self.batch(micro)
                with self._forward_context():
                    summed = self.batch_loss(self.model(x), x, y, "sum")
                self.scaler.scale(summed * scale).backward()
            total += summed.detach()
        return total / max(len(indices), 1)

    def train_epoch(self) -> None:
        """Train the rest of epoch ``state.completed_epochs`` from ``state.step_in_epoch``."""
        state, sampler = self.state, self.sampler
        epoch = state.completed_epochs
        self.model.train()
        bar = self._progress_bar(epoch)
        running = torch.zeros((), device=self.ctx.device)
        window_samples, window_start = 0, time.perf_counter()
        start = self.epoch_start_time = time.perf_counter()
        try:
            for indices in sampler.epoch(epoch, state.step_in_epoch):
                global_count = sampler.global_batch_length(state.step_in_epoch)
                running += self.train_step(indices, global_count)
                state.step_in_epoch += 1
                state.global_step += 1
                state.samples_seen += global_count
                window_samples += global_count
                if state.global_step % self.cfg.log_every == 0:
                    window_start, window_samples, running = self._log_window(bar, running, window_samples, window_start)
                for callback in self.step_callbacks:
                    callback(self)
        finally:  # also when a callback stops training mid-epoch
            state.train_time += time.perf_counter() - start
            if bar is not None:
                bar.close()
        state.completed_epochs += 1
        state.step_in_epoch = 0

    def _log_window(self, bar, running, window_samples, window_start):
        now = time.perf_counter()
        if self.ctx.is_main_process:
            # Rank 0's mean loss over the window's steps: a cheap estimate of the global loss.
            loss = running.item() / self.cfg.log_every
            rate = window_samples / max(now - window_start, 1e-9)
            self.metrics.write(
                "train", epoch=self.state.completed_epochs, global_step=self.state.global_step,
                loss=round(loss, 6), samples_per_s=round(rate, 1),
            )
            if bar is not None:
                bar.update(self.cfg.log_every)
                bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:,.0f}")
        return now, 0, torch.zeros((), device=self.ctx.device)

    def _progress_bar(self, epoch: int):
        if not (self.ctx.is_main_process and self.cfg.progress and sys.stderr.isatty()):
            return None
        return tqdm(
            total=self.sampler.steps_per_epoch, initial=self.state.step_in_epoch,
            desc=f"epoch {epoch + 1}/{self.cfg.epochs}", unit="step", leave=False, file=sys.stderr,
        )

    # -- evaluation -----------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, split: str = "test") -> dict[str, float]:
        """Exact loss and accuracy (classification) or MSE (reconstruction) on ``split``.

        Each rank evaluates a contiguous shard; sums and counts are reduced,
        so every sample counts once whatever the world size.
        """
        images = getattr(self.dataset, f"{split}_images")
        labels = getattr(self.dataset, f"{split}_labels")
        start, stop = shard_range(len(labels), self.ctx.rank, self.ctx.world_size)
        self.model.eval()
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.ctx.device)
        correct = torch.zeros((), dtype=torch.int64, device=self.ctx.device)
        for begin in range(start, stop, EVAL_BATCH):
            end = min(begin + EVAL_BATCH, stop)
            x, y = self.inputs(images[begin:end]), labels[begin:end]
            with self._forward_context():
                output = self.module(x)
            loss_sum += self.batch_loss(output, x, y, "sum").double()
            if self.spec.task == "classification":
                correct += (output.argmax(1) == y).sum()
        sums = reduce_sums({"loss": loss_sum.item(), "correct": correct.item(), "count": stop - start})
        result = {"loss": sums["loss"] / sums["count"]}
        if self.spec.task == "classification":
            result["accuracy"] = sums["correct"] / sums["count"]
        else:
            result["mse"] = result["loss"]
        return result

    # -- the whole run --------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Train until ``cfg.epochs`` are complete and return the run summary."""
        log = get_logger()
        log.info(self.sync.describe())
        test: dict[str, float] = {}
        tested_at = -1
        try:
            while self.state.completed_epochs < self.cfg.epochs:
                if self.cfg.max_steps and self.state.global_step >= self.cfg.max_steps:
                    raise StopTraining(f"max_steps={self.cfg.max_steps} reached")
                self.train_epoch()
                epoch = self.state.completed_epochs
                evaluated: dict[str, float] = {}
                if self.cfg.eval_every_epoch or epoch == self.cfg.epochs:
                    test = evaluated = self.evaluate("test")
                    tested_at = self.state.global_step
                    self.metrics.write("eval", epoch=epoch, global_step=self.state.global_step, split="test", **test)
                    log.info(f"epoch {epoch}/{self.cfg.epochs}: test " + _format(test) + f" (train time {self.state.train_time:.2f}s)")
                for callback in self.epoch_callbacks:
                    callback(self, evaluated)
        except StopTraining as stop:
            log.info(f"stopped after global step {self.state.global_step} (epoch {self.state.completed_epochs + 1}, "
                     f"step {self.state.step_in_epoch}): {stop}")
        if tested_at != self.state.global_step:  # stopped mid-epoch, or resumed with nothing left to train
            test = self.evaluate("test")
            log.info("test " + _format(test))
        summary = self.summary(test)
        self.metrics.write("summary", **summary)
        self.metrics.close()
        return summary

    def summary(self, test: dict[str, float]) -> dict[str, Any]:
        """Train time, throughput and final metrics of the run."""
        train = self.evaluate("train")
        return {
            "model": self.cfg.model,
            "dataset": self.dataset.name,
            "world_size": self.ctx.world_size,
            "allreduce": self.allreduce if self.ctx.world_size > 1 else "none",
            "grad_sync": self.sync.mode,
            "epochs": self.state.completed_epochs,
            "global_steps": self.state.global_step,
            "train_time_s": round(self.state.train_time, 4),
            "samples_per_s": round(self.state.samples_seen / max(self.state.train_time, 1e-9), 1),
            "train": train,
            "test": test,
            "config": to_dict(self.cfg),
        }


def _stop_at_max_steps(trainer: Trainer) -> None:
    # At an epoch's last step the epoch ends first (evaluation, epoch callbacks); fit stops after it.
    state = trainer.state
    if state.global_step >= trainer.cfg.max_steps and state.step_in_epoch < trainer.sampler.steps_per_epoch:
        raise StopTraining(f"max_steps={trainer.cfg.max_steps} reached")


def _format(metrics: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.4f}" if k != "accuracy" else f"accuracy {100 * v:.2f}%" for k, v in metrics.items())
