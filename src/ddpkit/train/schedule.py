"""Learning-rate schedules of ``ddpkit train``, stepped once per optimizer step.

All are torch's own schedulers (their state_dict is plain numbers, so a
checkpoint restores them exactly): ``step`` is StepLR, ``cosine``
CosineAnnealingLR to 0 at the last step, ``onecycle`` OneCycleLR (its own
warm-up is ``warmup_steps`` when given), and ``warmup_steps`` puts a LinearLR
from lr/100 in front of the others. ``constant`` without warm-up has no
scheduler at all: nothing to step, nothing to save.
"""

from __future__ import annotations

import torch
from torch.optim import lr_scheduler

WARMUP_START_FACTOR = 0.01
"""The warm-up starts at this fraction of the learning rate."""


def build_scheduler(
    name: str,
    optimizer: torch.optim.Optimizer,
    total_steps: int,
    steps_per_epoch: int,
    warmup_steps: int = 0,
    step_epochs: int = 1,
    gamma: float = 0.1,
) -> lr_scheduler.LRScheduler | None:
    """The scheduler for ``lr_schedule=name``, or None for a constant rate.

    Args:
        name: constant, step, cosine or onecycle.
        optimizer: the optimizer whose rate it sets.
        total_steps: optimizer steps of the whole run.
        steps_per_epoch: optimizer steps per epoch.
        warmup_steps: steps of linear warm-up first.
        step_epochs: epochs between two decays (step).
        gamma: decay factor (step).
    """
    if name == "onecycle":
        pct = warmup_steps / total_steps if warmup_steps else 0.3
        return lr_scheduler.OneCycleLR(
            optimizer,
            max_lr=[g["lr"] for g in optimizer.param_groups],
            total_steps=max(total_steps, 1),
            pct_start=min(pct, 0.99),
        )
    main = _main_schedule(name, optimizer, total_steps - warmup_steps, steps_per_epoch * step_epochs, gamma)
    if not warmup_steps:
        return main
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=WARMUP_START_FACTOR, total_iters=warmup_steps)
    if main is None:
        return warmup
    return lr_scheduler.SequentialLR(optimizer, [warmup, main], milestones=[warmup_steps])


def _main_schedule(
    name: str, optimizer: torch.optim.Optimizer, steps: int, step_size: int, gamma: float
) -> lr_scheduler.LRScheduler | None:
    if name == "step":
        return lr_scheduler.StepLR(optimizer, step_size=max(step_size, 1), gamma=gamma)
    if name == "cosine":
        return lr_scheduler.CosineAnnealingLR(optimizer, T_max=max(steps, 1))
    assert name == "constant", name
    return None
