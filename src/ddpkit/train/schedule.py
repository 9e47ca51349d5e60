"""Learning-rate schedules of ``ddpkit train``, stepped once per optimizer step.

All are torch's own schedulers (their state_dict is plain numbers, so a
checkpoint restores them exactly): ``step`` is StepLR, ``cosine``
CosineAnnealingLR to 0 at the last step, ``onecycle`` OneCycleLR (its own
warm-up is ``warmup_steps`` when given), and ``warmup_steps`` puts a LinearLR
from lr/100 in front of the others. ``constant`` without warm-up has no
scheduler at all: nothing to step, nothing to save.

A resumed optimizer takes its learning rate, momentum and weight decay from
the checkpoint (``load_state_dict`` restores its parameter groups); a
command that changed them (``resume=auto lr=1e-4`` after a divergence) gets
them back with :func:`apply_changed_rates`, the schedule scaled along.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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


LR_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
"""A parameter group's learning rates: its current one and those a schedule derives from the base (OneCycleLR's)."""
SETTINGS = ("momentum", "weight_decay")
"""Other settings of the config that a parameter group holds."""


def base_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    """Each parameter group's base learning rate (a schedule's ``initial_lr``, else ``lr``)."""
    return [float(group.get("initial_lr", group["lr"])) for group in optimizer.param_groups]


def apply_changed_rates(
    optimizer: torch.optim.Optimizer,
    scheduler: lr_scheduler.LRScheduler | None,
    configured: list[float],
    settings: Mapping[str, Any],
) -> list[str]:
    """After a resume: the base learning rates ``configured`` (:func:`base_rates` before it) and the ``settings``
    the command changed, in place of those the checkpoint's optimizer held; return what changed, as words.

    A changed base rate scales every rate of the group and of the schedule by the same ratio, so the
    schedule goes on from where it was, scaled (a warm-up or decay keeps its shape).
    """
    changed = []
    for index, (group, base, wanted) in enumerate(zip(optimizer.param_groups, base_rates(optimizer), configured)):
        if base and wanted != base:
            ratio = wanted / base
            for key in LR_KEYS:
                if key in group:
                    group[key] *= ratio
            for schedule in _schedules(scheduler):
                for rates in (getattr(schedule, "base_lrs", None), getattr(schedule, "_last_lr", None)):
                    if rates:  # (a SequentialLR has no base_lrs of its own: its schedules have)
                        rates[index] *= ratio
            changed.append(f"lr {base:g} -> {wanted:g}")
        for key, value in settings.items():
            if key in group and group[key] != value:
                changed.append(f"{key} {group[key]:g} -> {value:g}")
                group[key] = value
    return sorted(set(changed), key=changed.index)


def _schedules(scheduler: lr_scheduler.LRScheduler | None) -> list[Any]:
    """``scheduler`` and, for a SequentialLR, the schedules it runs in turn."""
    if scheduler is None:
        return []
    return [scheduler, *getattr(scheduler, "_schedulers", [])]
