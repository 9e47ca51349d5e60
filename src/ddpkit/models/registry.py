"""The model registry: reference models and the user's own, by name.

A model is registered with what training needs to know besides its layers:
whether it classifies, regresses or reconstructs its input, and the training recipe (optimizer, learning rate, batch, epochs) used when
the user does not override it::

    @register_model("tiny", task="classification", recipe={"lr": 0.01})
    def tiny() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

A model can also be named by import path, ``model=my_package.models:build``:
the function is imported in every worker and called to build the model (a
classifier with the default recipe, unless it was registered).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ddpkit.errors import UserError
from ddpkit.names import TASKS


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


MODELS: dict[str, ModelSpec] = {}


def register_model(
    name: str,
    task: str = "classification",
    recipe: Mapping[str, Any] | None = None,
) -> Callable[[Callable[[], nn.Module]], Callable[[], nn.Module]]:
    """Decorator registering a model builder under ``name``.

    Raises:
        ValueError: ``task`` is not one of TASKS.
    """
    if task not in TASKS:
        raise UserError(f"task={task!r} is not valid; choose one of: {', '.join(TASKS)}")

    def add(build: Callable[[], nn.Module]) -> Callable[[], nn.Module]:
        MODELS[name] = ModelSpec(name, build, task, dict(recipe or {}))
        return build

    return add


def get_model_spec(name: str) -> ModelSpec:
    """The registered model ``name``.

    Raises:
        ValueError: no model has that name (the message lists those that do).
    """
    _register_reference_models()
    if ":" in name and name not in MODELS:
        return _import_model(name)
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}, or give module:function")
    return MODELS[name]


def _import_model(path: str) -> ModelSpec:
    module_name, _, attr = path.partition(":")
    try:
        build = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise UserError(f"model {path!r} cannot be imported ({e}); check the module:function path") from None
    registered = next((spec for spec in MODELS.values() if spec.build is build), None)
    return registered or ModelSpec(path, build, "classification")


def _register_reference_models() -> None:
    # Imported for their registration side effect; here rather than at the top
    # so the registry module stays importable from the model modules.
    from ddpkit.models import autoencoder, cnn, mlp  # noqa: F401
