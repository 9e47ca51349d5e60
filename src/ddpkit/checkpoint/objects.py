"""The objects a Checkpointer holds: named, checked for the state_dict protocol, and the files they become.

Every object is saved as ``<name>.pt``, the return value of its
``state_dict()``, and restored with ``load_state_dict()``. A model is saved
unwrapped (no DDP ``module.`` or torch.compile ``_orig_mod.`` prefix), so a
checkpoint does not depend on the gradient sync or the world size.

An object whose ``state_dict()`` is a collective (``state_dict_is_collective``
is True: a stream's loader gathers every rank's position) is asked on every
rank; rank 0 writes what it returned.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn

from ddpkit.errors import UserError
from ddpkit.prepare import unwrap_model

__all__ = ["CollectiveState", "collect_objects", "is_collective", "model_devices"]

TRAIN_FILE = "train.pt"
"""The Checkpointer's own counters (global step, completed epochs)."""
RNG_FILE = "rng.pt"
"""Every rank's generator states."""
_RESERVED = {"train", "rng", "manifest", "config"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@runtime_checkable
class CollectiveState(Protocol):
    """An object whose ``state_dict()`` may be a collective: it says so in ``state_dict_is_collective``."""

    @property
    def state_dict_is_collective(self) -> bool:
        """True when ``state_dict()`` must be called on every rank."""
        ...


def is_collective(obj: Any) -> bool:
    """True when ``obj.state_dict()`` is a collective (call it on every rank)."""
    return isinstance(obj, CollectiveState) and obj.state_dict_is_collective


def model_devices(objects: Mapping[str, Any]) -> set[torch.device]:
    """The devices the held modules' parameters and buffers are on (a GPU model: background writes by default)."""
    return {
        tensor.device
        for obj in objects.values()
        if isinstance(obj, nn.Module)
        for tensor in (*obj.parameters(), *obj.buffers())
    }


def collect_objects(
    model: Any, optimizer: Any, scheduler: Any, scaler: Any, loader: Any, extra: Mapping[str, Any]
) -> dict[str, Any]:
    """The Checkpointer's objects by file name stem, the model unwrapped.

    Raises:
        UserError: an extra's name is not an identifier or is taken, or an object lacks the state_dict protocol.
    """
    named = {
        "model": unwrap_model(model) if isinstance(model, nn.Module) else model,
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "loader": loader,
    }
    objects = {name: obj for name, obj in named.items() if obj is not None}
    for name, obj in extra.items():
        if not _NAME.match(name) or name in _RESERVED or name in named:
            raise UserError(
                f"extra object name {name!r} is not usable; use an identifier other than "
                f"{', '.join(sorted(_RESERVED | set(named)))}"
            )
        objects[name] = obj
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(
                f"Checkpointer: {name}={type(obj).__name__} has no state_dict()/load_state_dict(); "
                "pass objects with both (a model, optimizer, scheduler, ...) or wrap it in one that has"
            )
    return objects
