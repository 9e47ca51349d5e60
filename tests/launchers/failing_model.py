"""Models that fail on purpose, named by import path in launcher tests."""

import os

from torch import nn


def fails_on_rank_one() -> nn.Module:
    """Builds an MLP, except on global rank 1, which raises."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("model construction failed on purpose")
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))


def killed_on_rank_one() -> nn.Module:
    """Builds an MLP, except on global rank 1, which dies without a word (SIGKILL)."""
    if os.environ.get("RANK") == "1":
        os.kill(os.getpid(), 9)
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))
