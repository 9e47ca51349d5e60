"""What the registry knows about a model: how to build it and how to train it by default.

A leaf of ``ddpkit.models``: the reference models declare their specs with
it, and the registry (:mod:`ddpkit.models.registry`) holds them, so neither
imports the other.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: how to build it and how to train it by default."""

    name: str
    """Registry name, as in model=NAME."""
    build: Callable[[], nn.Module]
    """Returns a new, randomly initialised model."""
    task: str
    """classification (cross-entropy, accuracy), regression (MSE to the target) or reconstruction (MSE to the input)."""
    recipe: Mapping[str, Any] = field(default_factory=dict)
    """TrainConfig values used unless the user overrides them."""
