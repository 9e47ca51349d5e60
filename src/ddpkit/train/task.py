"""What ``ddpkit train`` optimizes and reports: the loss and the metrics of a task.

Every loss is a sum over the samples of a batch: the training loop turns it
into the exact mean over the global batch (``ddpkit.DataLoader.global_mean``)
and evaluation adds sums and counts over the ranks (``ddpkit.reduce_sums``),
so neither depends on the number of workers.

- classification: cross-entropy of the output (logits) and the integer label;
  metrics loss and accuracy.
- regression: squared error of the output and the target, averaged over the
  values of one sample; metrics loss and mse.
- reconstruction: the same against the input (autoencoders); metrics loss and mse.
- ``loss=module:function``: ``function(output, target)`` returns the loss of
  each sample (shape ``(N,)``); the task still names the metrics.

A batch is what the DataLoader yields: ``(input, target, ...)`` or the input alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ddpkit.errors import UserError
from ddpkit.names import TASKS

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Task:
    """The loss and metrics of one task (see the module docstring)."""

    name: str
    """classification, regression or reconstruction."""
    custom_loss: LossFn | None = None
    """A user's per-sample loss, or None for the task's own."""

    @property
    def quality_metric(self) -> str:
        """The metric that judges the model: accuracy (higher is better) or mse (lower)."""
        return "accuracy" if self.name == "classification" else "mse"

    def target(self, inputs: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """What the output is compared with."""
        if self.name == "reconstruction":
            return inputs
        if target is None:
            raise UserError(
                f"task={self.name} needs (input, target) samples, but the dataset yields inputs only; "
                "return (input, target) pairs or use task=reconstruction"
            )
        return target

    def loss_sum(self, output: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """The batch's loss summed over its samples (a scalar tensor)."""
        goal = self.target(inputs, target)
        if self.custom_loss is not None:
            return self.custom_loss(output, goal).sum()
        if self.name == "classification":
            return F.cross_entropy(output.float(), goal, reduction="sum")
        per_value = F.mse_loss(output.float(), goal.float().view_as(output), reduction="sum")
        return per_value / max(output[0].numel(), 1) if len(output) else per_value

    def loss_mean(self, output: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
        """The batch's loss averaged over its samples: ``loss_sum / len(output)`` in one operation.

        The batch must not be empty (the mean of no samples is NaN).
        """
        goal = self.target(inputs, target)
        if self.custom_loss is not None:
            return self.custom_loss(output, goal).mean()
        if self.name == "classification":
            return F.cross_entropy(output.float(), goal)
        return F.mse_loss(output.float(), goal.float().view_as(output))

    def metric_sums(self, output: torch.Tensor, inputs: torch.Tensor, target: torch.Tensor | None) -> dict[str, Any]:
        """Sums over the batch's samples from which ``metrics`` computes the task's metrics."""
        sums = {"loss": self.loss_sum(output, inputs, target).double(), "count": len(output)}
        if self.name == "classification":
            assert target is not None  # a classification batch has its labels
            sums["correct"] = torch.eq(output.argmax(1), target).sum()
        return sums

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        """loss, and accuracy or mse, from sums added over every rank."""
        count = max(sums["count"], 1)
        result = {"loss": sums["loss"] / count}
        if self.name == "classification":
            result["accuracy"] = sums["correct"] / count
        else:
            result["mse"] = result["loss"]
        return result


def resolve_task(task: str, model_task: str, loss: str = "") -> Task:
    """The Task for ``task=`` (auto: the model's registered task) and ``loss=``.

    Raises:
        ValueError: an unknown task, or a loss function that cannot be imported.
    """
    name = model_task if task == "auto" else task
    if name not in TASKS:
        raise UserError(f"task={name!r} is not valid; choose one of: {', '.join(TASKS)}")
    return Task(name, _import_loss(loss) if loss else None)


def _import_loss(path: str) -> LossFn:
    module_name, _, attr = path.partition(":")
    if not attr:
        raise UserError(f"loss={path!r} is not module:function; name a function returning per-sample losses")
    try:
        loss: LossFn = getattr(importlib.import_module(module_name), attr)
        return loss
    except (ImportError, AttributeError) as e:
        raise UserError(f"loss {path!r} cannot be imported ({e}); check the module:function path") from None


def split_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(input, target or None) of a DataLoader batch."""
    if isinstance(batch, torch.Tensor):
        return batch, None
    if isinstance(batch, (list, tuple)) and batch:
        return batch[0], (batch[1] if len(batch) > 1 else None)
    raise UserError(
        f"a batch of type {type(batch).__name__} is neither a tensor nor (input, target); "
        "make the dataset return (input, target) pairs of tensors"
    )
