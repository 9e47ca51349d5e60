"""Sharded data parallelism: torch's FSDP2 (``fully_shard``) on a model's repeated blocks and its root.

With ``ddpkit.prepare_model(model, shard=True)`` each rank keeps ``1/world_size``
of every parameter, of its gradient and of the optimizer's state for it
(parameters become ``DTensor`` shards on a one-dimensional device mesh of
the job's device type: CPU with gloo, CUDA with nccl). A block's full
parameters exist only while it runs::

    forward of block i:   all_gather(shards of block i) -> full weights -> compute -> free (reshard)
    backward of block i:  all_gather again (unless reshard_after_forward=False kept them)
                          -> gradients -> reduce_scatter -> this rank's gradient shard

Per rank and step, for P parameter bytes: about 2 P gathered and P/world_size
kept (parameters), one reduce_scatter of P (gradients), and the optimizer
steps P/world_size of state. The unit of gathering is a *block*: every
module whose class occurs at least twice among the modules holding
parameters and never inside another such class (the layers of a
transformer, not their Linears), found automatically (torch's containers, ``Sequential``,
``ModuleList``, ``ModuleDict``, are walked into, never taken as blocks) or
named with ``shard_blocks`` (classes or class names). The root is sharded
last and holds what no block holds (embeddings, the head).

What changes for a training loop:

- build the optimizer after ``prepare_model``: the parameters it must hold are the sharded ones;
- gradient accumulation: ``ddpkit.no_sync(model)`` (FSDP2's ``set_requires_gradient_sync(False)``
  inside it): the micro-batches' gradients accumulate unsharded-reduced, the last backward reduces them;
- ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` works as it is (the norm is a DTensor,
  reduced over the ranks);
- ``model.state_dict()`` holds shards: save with the :class:`ddpkit.Checkpointer` (each rank writes its
  shards) and get full weights with ``ddpkit export``; ``torch.save(model.state_dict(), path)`` stops
  with one line saying so (:mod:`ddpkit.comm.sharded_state`) instead of writing rank 0's shards alone.

Where the model is: on the CPU (each block reaches the device as it is
sharded, so the whole model need never fit on one device), and on the
ranks other than 0 on the meta device if they like (rank 0's weights reach
them a block at a time); on the meta device on rank 0 too, each module is
initialised by its ``reset_parameters()``.

Mixed precision (``mixed_precision="bf16"``): parameters gathered and
computed in bfloat16, gradients reduced in float32, the optimizer's
parameters and state kept in float32.
"""

from __future__ import annotations

import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from ddpkit.comm.sharded_state import refuse_saving_shards
from ddpkit.errors import UserError

__all__ = [
    "SHARD_CHOICES",
    "find_blocks",
    "is_sharded",
    "mixed_precision_policy",
    "shard_model",
    "sharded_no_sync",
    "wants_sharding",
]

SHARD_CHOICES = (True, False, "auto")
"""``shard=``: True (FSDP), False (replicated parameters: DDP or ddpkit's all_reduce), auto (FSDP when a
replica's training state would take more than half of a worker's share of device memory)."""

MIXED_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
"""``mixed_precision=`` names: the dtype parameters are gathered and computed in (gradients reduced in fp32)."""

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
"""torch's containers: their class says nothing of a model's structure, so they are walked into."""

_AUTO_FRACTION = 0.5
"""shard=auto shards when parameters + gradients + Adam's two states exceed this share of the device memory."""


def is_sharded(model: object) -> bool:
    """True when ``model`` (or the module torch.compile wrapped) was sharded by ``fully_shard``."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", None)
    return isinstance(inner if isinstance(inner, nn.Module) else model, FSDPModule)


def wants_sharding(shard: bool | str, model: nn.Module, device: torch.device, local_world_size: int) -> bool:
    """Whether ``shard`` (True, False or "auto") shards ``model`` on ``device``.

    Raises:
        ValueError: ``shard`` is none of True, False, "auto".
    """
    if isinstance(shard, str) and shard.lower() in ("true", "false"):
        shard = shard.lower() == "true"
    if shard not in SHARD_CHOICES:
        raise UserError(f"shard={shard!r} is not valid; choose True, False or 'auto'")
    if shard != "auto":
        return bool(shard)
    state_bytes = 4 * sum(p.numel() * p.element_size() for p in model.parameters())  # + grads, Adam's 2 states
    return state_bytes > _AUTO_FRACTION * _device_memory(device) / max(1, local_world_size)


def _device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def find_blocks(model: nn.Module, names: Sequence[type | str] | None = None) -> list[nn.Module]:
    """The modules to shard one by one before the root, outermost first.

    Args:
        model: the plain module.
        names: the block classes (classes or class names); None: every class that occurs at least twice
            among the modules holding parameters (torch's containers excepted).

    Raises:
        ValueError: ``names`` matches no module of ``model``.
    """
    if names is None:
        counts = Counter(
            type(m) for m in model.modules() if m is not model and not isinstance(m, _CONTAINERS) and _has_params(m)
        )
        repeated = {cls for cls, n in counts.items() if n >= 2}
        # A repeated class found inside another one's instances (the Linears of a transformer's layers)
        # is part of the block, not the block.
        inner = {cls for cls in repeated for m in _inside(model, repeated) if type(m) is cls}
        chosen = repeated - inner

        def is_block(m: nn.Module) -> bool:
            return type(m) in chosen

    else:
        wanted = {n for n in names if isinstance(n, str)}
        classes = tuple(n for n in names if isinstance(n, type))

        def is_block(m: nn.Module) -> bool:
            return type(m).__name__ in wanted or isinstance(m, classes)

    blocks = list(_outermost(model, is_block, root=True))
    if names is not None and not blocks:
        spelled = ", ".join(n if isinstance(n, str) else n.__name__ for n in names)
        present = sorted({type(m).__name__ for m in model.modules()})
        raise UserError(f"shard_blocks={spelled} matches no module of the model; its classes: {', '.join(present)}")
    return blocks


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def _inside(model: nn.Module, classes: set[type]) -> Iterator[nn.Module]:
    """The modules below an instance of ``classes`` (descendants of a block, not the block)."""
    for m in model.modules():
        if type(m) in classes:
            yield from (d for d in m.modules() if d is not m)


def _outermost(module: nn.Module, is_block: Any, root: bool = False) -> Iterator[nn.Module]:
    if not root and is_block(module):
        yield module
        return
    for child in module.children():
        yield from _outermost(child, is_block)


def mixed_precision_policy(mixed_precision: Any) -> Any:
    """FSDP2's ``MixedPrecisionPolicy`` for ``mixed_precision``: None, "bf16", "fp16", or a policy as it is.

    Raises:
        ValueError: an unknown name.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision or MixedPrecisionPolicy()
    if mixed_precision not in MIXED_PRECISION:
        raise UserError(
            f"mixed_precision={mixed_precision!r} is not valid; choose one of {', '.join(MIXED_PRECISION)}, "
            "None, or a torch.distributed.fsdp.MixedPrecisionPolicy"
        )
    return MixedPrecisionPolicy(param_dtype=MIXED_PRECISION[mixed_precision], reduce_dtype=torch.float32)


def shard_model(
    model: nn.Module,
    device: torch.device,
    world_size: int,
    *,
    blocks: Sequence[type | str] | None = None,
    mixed_precision: Any = None,
    reshard_after_forward: bool = True,
) -> tuple[nn.Module, list[str]]:
    """Shard ``model`` (wherever it is, the CPU say) onto ``device`` from rank 0's weights: each block, then
    the root.

    A block goes to ``device`` only when it is sharded, and leaves there only its shard: the device never
    holds more than the shards so far and one block whole, so a model larger than one device can be
    sharded over several (the whole model stays in CPU memory until then).

    Returns:
        The same module, now an ``FSDPModule`` (its class gains torch's mixin), and the block classes.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    policy = mixed_precision_policy(mixed_precision)
    found = find_blocks(model, blocks)
    classes = sorted({type(b).__name__ for b in found})  # before fully_shard renames them (FSDP<name>)
    rank = dist.get_rank() if dist.is_initialized() else 0
    _check_initialisable(model, rank, world_size)
    for block in found:
        _place_from_rank_zero(block, device, world_size, rank)
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    _place_from_rank_zero(model, device, world_size, rank)  # what no block holds (embeddings, the head)
    # The root's parameters are gathered first in forward and needed last in backward: kept unsharded
    # between the two, as torch's examples do.
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False if found else reshard_after_forward)
    refuse_saving_shards(model)  # torch.save(model.state_dict()) on rank 0 would write rank 0's shards alone
    return model, classes


def _place_from_rank_zero(module: nn.Module, device: torch.device, world_size: int, rank: int) -> None:
    """Move ``module``'s tensors not yet sharded to ``device``, holding rank 0's values.

    Every rank starts from rank 0's weights, as with DDP: a model initialised with a per-rank seed would
    otherwise hold a mix of initialisations. The shards of blocks sharded before are left as they are.
    Tensors on the meta device get memory first (:func:`_materialize`).
    """
    from torch.distributed.tensor import DTensor

    _materialize(module, rank)
    module.to(device)  # (a sharded block's DTensors are on the device already)
    if world_size == 1:
        return
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if not isinstance(tensor, DTensor):
                dist.broadcast(tensor, src=0)


def _materialize(module: nn.Module, rank: int) -> None:
    """Give the tensors of ``module`` (outside blocks sharded already) that are on the meta device memory on the
    CPU; on rank 0, initialise them with their module's ``reset_parameters()``.

    A model built on the meta device by the ranks other than 0 (rank 0 holding the weights: pretrained,
    or initialised its own way) costs them one block of CPU memory at a time, not the whole model: the
    broadcast that follows gives them rank 0's values. A model on the meta device on rank 0 too is
    initialised module by module by torch's defaults.
    """
    for child in reversed(list(_not_sharded(module))):  # the children before their parent
        own = [*child.parameters(recurse=False), *child.buffers(recurse=False)]
        if not any(tensor.is_meta for tensor in own):
            continue
        child.to_empty(device="cpu", recurse=False)
        if rank == 0:
            reset = cast(Callable[[], None], child.reset_parameters)  # (there: _check_initialisable)
            with torch.no_grad():
                reset()


def _check_initialisable(model: nn.Module, rank: int, world_size: int) -> None:
    """Every rank, before any tensor moves: fail alike when rank 0's model has a module on the meta device that
    :func:`_materialize` cannot initialise (a collective: rank 0 tells the others).

    Raises:
        UserError: the module's class and the fix.
    """
    problem = [""]
    if rank == 0:
        for module in model.modules():
            own = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            if any(t.is_meta for t in own) and not callable(getattr(module, "reset_parameters", None)):
                problem[0] = (
                    f"{type(module).__name__} of the model is on the meta device on rank 0 and has no "
                    "reset_parameters() to initialise it; build the model with its weights on rank 0 (the "
                    "other ranks may use the meta device) or give the module a reset_parameters()"
                )
                break
    if world_size > 1:
        dist.broadcast_object_list(problem, src=0)
    if problem[0]:
        raise UserError(problem[0])


def _not_sharded(module: nn.Module) -> Iterator[nn.Module]:
    """``module`` and its descendants, leaving out the blocks sharded already (and what they hold)."""
    from torch.distributed.fsdp import FSDPModule

    yield module
    for child in module.children():
        if not isinstance(child, FSDPModule):
            yield from _not_sharded(child)


@contextlib.contextmanager
def sharded_no_sync(model: nn.Module) -> Iterator[None]:
    """Backwards inside only accumulate gradients; the next backward outside reduces them all (FSDP2's switch)."""
    from torch.distributed.fsdp import FSDPModule

    inner = getattr(model, "_orig_mod", model)
    assert isinstance(inner, FSDPModule), "called for sharded models only"
    inner.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        inner.set_requires_gradient_sync(True)
