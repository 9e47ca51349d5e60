"""Starting every rank alike: ``broadcast_parameters``, ``broadcast_optimizer_state``, and Python objects.

Horovod scripts start training with::

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Objects travel pickled, as uint8 tensors, through the same collectives as
tensors (so a rank that has joined takes part in them too).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ddpkit.distributed import control_device
from ddpkit.horovod import ranks
from ddpkit.horovod.exchange import allgather, broadcast_, broadcast_async_
from ddpkit.horovod.ops import synchronize
from ddpkit.horovod.process_sets import check as check_process_set, global_process_set


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[Any], root_rank: int, process_set: object = global_process_set
) -> None:
    """Overwrite every rank's tensors with rank ``root_rank``'s, in place.

    Args:
        params: ``model.state_dict()`` (sorted by name, as Horovod does), or
            ``model.named_parameters()`` / ``model.parameters()``.
        root_rank: the rank whose values win.
        process_set: the global process set only.
    """
    check_process_set(process_set)
    if isinstance(params, Mapping):
        named = sorted(params.items())
    else:
        named = [p if isinstance(p, tuple) else (None, p) for p in params]
    handles = [broadcast_async_(p.detach(), root_rank, name) for name, p in named]
    for handle in handles:
        synchronize(handle)


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, process_set: object = global_process_set
) -> None:
    """Give every rank rank ``root_rank``'s optimizer state and hyperparameters (lr, momentum buffers, Adam moments).

    The root's ``state_dict()`` travels pickled and every other rank loads it,
    so the result is what ``optimizer.load_state_dict`` makes of it (state on
    each parameter's device). A root without state yet (before its first
    step) leaves every rank without state: they all start alike.
    """
    check_process_set(process_set)
    state = broadcast_object(_to_cpu(optimizer.state_dict()) if _rank() == root_rank else None, root_rank)
    if _rank() != root_rank:
        optimizer.load_state_dict(state)


def broadcast_object(
    obj: Any, root_rank: int = 0, name: str | None = None, process_set: object = global_process_set
) -> Any:
    """Rank ``root_rank``'s ``obj`` (picklable), returned on every rank."""
    check_process_set(process_set)
    device = control_device()  # nccl moves CUDA tensors only
    payload = _to_bytes(obj).to(device) if _rank() == root_rank else torch.empty(0, dtype=torch.uint8)
    length = broadcast_(
        torch.tensor([payload.numel()], dtype=torch.int64, device=device),
        root_rank,
        name=f"{name}.length" if name else None,
    )
    if _rank() != root_rank:
        payload = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    broadcast_(payload, root_rank, name=name)
    return _from_bytes(payload)


def allgather_object(obj: Any, name: str | None = None, process_set: object = global_process_set) -> list[Any]:
    """Every rank's ``obj`` (picklable), as a list in rank order."""
    check_process_set(process_set)
    device = control_device()
    payload = _to_bytes(obj).to(device)
    lengths = allgather(
        torch.tensor([payload.numel()], dtype=torch.int64, device=device), name=f"{name}.lengths" if name else None
    )
    gathered = allgather(payload, name=name)
    return [_from_bytes(part) for part in torch.split(gathered, lengths.tolist())]


def _to_bytes(obj: Any) -> torch.Tensor:
    buffer = io.BytesIO()
    pickle.dump(obj, buffer)
    return torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)


def _from_bytes(payload: torch.Tensor) -> Any:
    return pickle.loads(payload.cpu().numpy().tobytes())


def _to_cpu(value: Any) -> Any:
    """``value`` with its tensors on the CPU (a CUDA tensor would be unpickled onto the root's GPU)."""
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


def _rank() -> int:
    return ranks.rank()
