"""The objects a Checkpointer holds: named, checked for the state_dict protocol, and the files they become.

Every object is saved as ``<name>.pt``, the return value of its
``state_dict()``, and restored with ``load_state_dict()``. A model is saved
unwrapped (no DDP ``module.`` or torch.compile ``_orig_mod.`` prefix), so a
checkpoint does not depend on the gradient sync or the world size.

Plain values go in a dict (:class:`PlainValues`), restored in place. What
differs between ranks (a prefetched batch, a per-rank buffer) is passed as
``per_rank=``: every rank's state is saved, and each rank gets its own back.

An object whose ``state_dict()`` is a collective (``state_dict_is_collective``
is True: a stream's loader gathers every rank's position) is asked on every
rank; rank 0 writes what it returned.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, MutableMapping
from typing import Any, Protocol, runtime_checkable

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.errors import UserError
from ddpkit.prepare import gradient_sync, unwrap_model

__all__ = [
    "CollectiveState",
    "PlainValues",
    "collect_objects",
    "is_collective",
    "model_devices",
    "state_to_agree",
    "tensor_digest",
]

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


def state_to_agree(obj: Any) -> Any:
    """The part of ``obj``'s state that must be the same on every rank for rank 0's to stand for all.

    A module prepared by ``prepare_model`` whose buffers are rank 0's again at its next training forward
    (DDP's ``broadcast_buffers``, ddpkit's flat and manual modes) contributes its parameters only: its
    BatchNorm statistics differ between the ranks after each forward, and a resumed run broadcasts rank 0's
    before the first, as the uninterrupted run does.
    """
    sync = gradient_sync(obj) if isinstance(obj, nn.Module) else None
    if sync is not None and (sync.mode in ("flat", "manual") or (isinstance(obj, DDP) and obj.broadcast_buffers)):
        return dict(unwrap_model(obj).named_parameters())
    return obj.state_dict()


def tensor_digest(state: Any) -> str:
    """SHA-256 of the tensors in ``state``, in the order met (what differs between ranks that matters most)."""
    digest = hashlib.sha256()

    def walk(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            data = value.detach().cpu().contiguous()
            digest.update(str((data.dtype, tuple(data.shape))).encode())
            digest.update(data.view(-1).view(torch.uint8).numpy().tobytes() if data.numel() else b"")
        elif isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)

    walk(state)
    return digest.hexdigest()


def model_devices(objects: Mapping[str, Any]) -> set[torch.device]:
    """The devices the held modules' parameters and buffers are on (a GPU model: background writes by default)."""
    return {
        tensor.device
        for obj in objects.values()
        if isinstance(obj, nn.Module)
        for tensor in (*obj.parameters(), *obj.buffers())
    }


class PlainValues:
    """A dict of the user's plain values (numbers, strings, lists, tensors) as a Checkpointer object.

    ``extra={"progress": progress}`` with ``progress = {"iter_num": 0, "best_acc1": 0.0}``:
    the dict is saved as it is at each save, and restored in place on resume
    (the loop reads ``progress["iter_num"]``), so no class needs writing. A
    restored tensor goes to the device of the tensor it replaces.
    """

    def __init__(self, values: MutableMapping[str, Any]):
        self.values = values

    def state_dict(self) -> dict[str, Any]:
        """A shallow copy of the values."""
        return dict(self.values)

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Put the saved values back into the same dict."""
        restored = {}
        for key, value in state.items():
            current = self.values.get(key)
            if isinstance(value, torch.Tensor) and isinstance(current, torch.Tensor):
                value = value.to(current.device)
            restored[key] = value
        self.values.clear()
        self.values.update(restored)


def collect_objects(
    model: Any,
    optimizer: Any,
    scheduler: Any,
    scaler: Any,
    loader: Any,
    extra: Mapping[str, Any],
    per_rank: Mapping[str, Any],
) -> dict[str, Any]:
    """The Checkpointer's objects by file name stem, the model unwrapped, plain dicts as :class:`PlainValues`.

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
    for keyword, group in (("extra", extra), ("per_rank", per_rank)):
        for name, obj in group.items():
            if not _NAME.match(name) or name in _RESERVED or name in objects or name in named:
                raise UserError(
                    f"{keyword} object name {name!r} is not usable; use an identifier other than "
                    f"{', '.join(sorted(_RESERVED | set(named) | set(objects)))}"
                )
            objects[name] = PlainValues(obj) if _plain(obj) else obj
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(
                f"Checkpointer: {name}={type(obj).__name__} has no state_dict()/load_state_dict(); "
                "pass objects with both (a model, optimizer, scheduler, ...), or plain values in a dict "
                "(extra={'progress': {'iter_num': 0}}), restored in place"
            )
    return objects


def _plain(obj: Any) -> bool:
    """A dict of values without the state_dict protocol of its own (an OrderedDict state is a dict too)."""
    return isinstance(obj, MutableMapping) and not callable(getattr(obj, "load_state_dict", None))
