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

import functools
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ddpkit.errors import UserError
from ddpkit.models.spec import ModelSpec
from ddpkit.names import TASKS

REFERENCE_MODELS = {
    "autoencoder": "ddpkit.models.autoencoder:AUTOENCODER",
    "cnn": "ddpkit.models.cnn:CNN",
    "cnn_bn": "ddpkit.models.cnn:CNN_BN",
    "mlp": "ddpkit.models.mlp:MLP",
}
"""The reference models by name: where each one's :class:`ModelSpec` is, as ``module:attribute``.

Imported on first use (:func:`get_model_spec`), so the registry imports no model
module and no model module imports the registry.
"""

MODELS: dict[str, ModelSpec] = {}


def register_model(
    name: str,
    task: str = "classification",
    recipe: Mapping[str, Any] | None = None,
) -> Callable[[Callable[[], nn.Module]], Callable[[], nn.Module]]:
    """Decorator registering a model builder under ``name``.

    Raises:
        UserError: ``task`` is not one of TASKS.
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
        UserError: no model has that name (the message lists those that do), or a ``module:function`` name
            that cannot be imported.
    """
    _register_reference_models()
    if ":" in name and name not in MODELS:
        return _import_model(name)
    if name not in MODELS:
        raise UserError(f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}, or give module:function")
    return MODELS[name]


def _import_model(path: str) -> ModelSpec:
    module_name, _, attr = path.partition(":")
    if not module_name.strip(".") or not attr:  # .:x, :x and m: name no module or no function to import
        raise UserError(
            f"model {path!r} names no module or no function; write module:function, e.g. model=my_models:build "
            "(my_models.py in the current folder)"
        )
    try:
        build = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, TypeError, ValueError) as e:  # TypeError, ValueError: a relative name
        raise UserError(f"model {path!r} cannot be imported ({e}); check the module:function path") from None
    registered = next((spec for spec in MODELS.values() if spec.build is build), None)
    return registered or ModelSpec(path, build, "classification")


@functools.cache  # once per process: a model the user registers later under the same name wins
def _register_reference_models() -> None:
    for name, path in REFERENCE_MODELS.items():
        module_name, _, attr = path.partition(":")
        spec = getattr(importlib.import_module(module_name), attr)
        assert isinstance(spec, ModelSpec) and spec.name == name, path
        MODELS[name] = spec
