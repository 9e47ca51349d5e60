"""Models, a loss and a model function for the fault matrix (tests/train/test_faults.py), driven by environment
variables so that a run in a subprocess can be steered:

- DDPKIT_TEST_WAIT_FOR: a path; importing this module waits (up to 120 s) until it exists, so that a run
  started first reaches its run folder after a run started later (the model is imported before any worker);
- DDPKIT_TEST_HOLD_UNTIL: a path; every training forward of ``held_mlp`` waits (up to 120 s) until it
  exists, so that a run holds its folder, having written nothing yet, for as long as a test needs;
- DDPKIT_TEST_NAN_FROM_STEP: ``nan_from_step`` returns NaN losses from this training step on (1-based).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _wait_for(variable: str) -> None:
    path = os.environ.get(variable, "")
    deadline = time.monotonic() + 120
    while path and not Path(path).exists() and time.monotonic() < deadline:
        time.sleep(0.05)


_wait_for("DDPKIT_TEST_WAIT_FOR")


class _Held(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Flatten(), nn.Linear(784, 16), nn.ReLU(), nn.Linear(16, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.is_grad_enabled():
            _wait_for("DDPKIT_TEST_HOLD_UNTIL")
        return self.net(x)


def held_mlp() -> nn.Module:
    """A small MLP whose training forward waits for DDPKIT_TEST_HOLD_UNTIL (see the module docstring)."""
    return _Held()


_TRAINING_CALLS = [0]


def nan_from_step(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross-entropy per sample, NaN from training step DDPKIT_TEST_NAN_FROM_STEP on (evaluation is left alone)."""
    losses = F.cross_entropy(output, target, reduction="none")
    if torch.is_grad_enabled():
        _TRAINING_CALLS[0] += 1
        threshold = int(os.environ.get("DDPKIT_TEST_NAN_FROM_STEP") or 0)
        if threshold and _TRAINING_CALLS[0] >= threshold:
            return losses * float("nan")
    return losses


def reset_steps() -> None:
    """Count nan_from_step's training steps from 0 again (a new run in the same process)."""
    _TRAINING_CALLS[0] = 0


def not_a_module() -> dict:
    """A model function that returns something else than a module (a user's mistake)."""
    return {"weight": torch.zeros(2)}
