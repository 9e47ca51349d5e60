"""Any model, ddpkit's gradient synchronisation, and a training loop that stays plain torch.

::

    ctx = ddpkit.init()
    model = ddpkit.prepare_model(Net())        # on ctx.device, rank 0's weights on every rank
    optimizer = torch.optim.AdamW(model.parameters())
    for x, y in loader:
        loss_fn(model(x), y).backward()        # when it returns, gradients are the mean over ranks
        optimizer.step()
        optimizer.zero_grad()
    torch.save(ddpkit.unwrap_model(model).state_dict(), "model.pt")

What ``ddpkit train`` does, a user's script gets the same way: the all_reduce
(``allreduce=auto``: shared memory on one CPU node, hierarchical across
nodes, the backend's built-in otherwise) and the synchronisation
(``grad_sync=auto``: one flat all_reduce with shared memory, or for
gradients up to DDP's first bucket; torch's DDP otherwise), both explained in
:mod:`ddpkit.comm.grad_sync`.

Gradient accumulation: run the forward and backward of every micro-batch but
the last inside ``ddpkit.no_sync(model)``::

    for i, (x, y) in enumerate(micro_batches):
        with ddpkit.no_sync(model) if i < len(micro_batches) - 1 else contextlib.nullcontext():
            (loss_fn(model(x), y) / len(micro_batches)).backward()
    optimizer.step()

A script written for DDP runs as it is, whichever synchronisation was
chosen: the module returned answers what scripts ask of DDP's.
``model.require_backward_grad_sync = False`` (nanoGPT's gradient
accumulation) makes the next backward only accumulate, ``with
model.no_sync():`` does the same for a block, and ``model.module`` is the
plain module (for ``flat``, ``manual`` and one worker, the module itself).
A module that has its own ``module`` or ``no_sync`` keeps it, with one
warning (``ddpkit.unwrap_model`` and ``ddpkit.no_sync`` then do the same).

Models larger than one device: ``prepare_model(model, shard=True)`` shards
parameters, gradients and optimizer state over the ranks (torch's FSDP2; see
:mod:`ddpkit.comm.fsdp`); build the optimizer after it, ``no_sync`` works as above.

Mixed precision works unchanged (``torch.autocast``, ``GradScaler``: the
scaled gradients are averaged, then unscaled alike on every rank). Freeze
parameters (``requires_grad_(False)``) before ``prepare_model``.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Sequence
from typing import Any

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm.fsdp import is_sharded, shard_model, sharded_no_sync, wants_sharding
from ddpkit.comm.grad_sync import GradientSync, choose_allreduce, choose_grad_sync, no_sync_of, wrap_ddp
from ddpkit.distributed import Context, context
from ddpkit.errors import UserError
from ddpkit.log import get_logger
from ddpkit.names import GRAD_SYNC_MODES

_SYNCS: weakref.WeakKeyDictionary[nn.Module, GradientSync] = weakref.WeakKeyDictionary()
"""The synchronisation of every module prepare_model returned, gone with the module."""


def prepare_model(
    model: nn.Module,
    *,
    allreduce: str = "auto",
    grad_sync: str = "auto",
    sync_batchnorm: bool = False,
    shard: bool | str = False,
    shard_blocks: Sequence[type | str] | None = None,
    mixed_precision: Any = None,
    reshard_after_forward: bool = True,
) -> nn.Module:
    """Make ``model`` train data-parallel: on this worker's device, from rank 0's weights, gradients averaged.

    A collective: every rank calls it, with the same arguments. After it, each
    ``backward()`` leaves every trainable parameter's ``.grad`` the mean over
    the ranks (except inside :func:`no_sync`).

    Args:
        model: the plain module, the same architecture on every rank.
        allreduce: auto, or an algorithm of ``ddpkit.comm.ALLREDUCE_ALGORITHMS``
            (builtin, ring, shm, ...).
        grad_sync: auto, ddp (torch's DDP, with ``allreduce`` as its communication
            hook unless builtin), flat (one all_reduce of one buffer at the end of
            backward) or manual (one all_reduce per parameter at the end of backward).
        sync_batchnorm: convert BatchNorm layers to SyncBatchNorm (needs ddp or auto, and CUDA).
        shard: True: shard parameters, gradients and optimizer state over the ranks (torch's FSDP2,
            :mod:`ddpkit.comm.fsdp`; build the optimizer after this call); "auto": when a replica's
            training state would not fit in half of a worker's share of device memory; False: replicate.
        shard_blocks: with ``shard``, the block classes (classes or class names) sharded one by one;
            None: every class that occurs twice or more (a transformer's layers).
        mixed_precision: with ``shard``, "bf16" or "fp16" (gathered and computed in it, gradients
            reduced in fp32), or an FSDP ``MixedPrecisionPolicy``; None: the parameters' dtype.
        reshard_after_forward: with ``shard``, free each block's gathered parameters after its
            forward (less memory; gathered again in backward).

    Returns:
        The module to train and call: for ddp, torch's ``DistributedDataParallel``
        around ``model``; for flat and manual, and with one worker, ``model`` itself,
        given DDP's ``module`` (itself), ``no_sync()`` and ``require_backward_grad_sync``,
        each with DDP's effect; sharded, ``model`` itself as an ``FSDPModule`` (torch's
        mixin added to its class).

    Raises:
        RuntimeError: ``ddpkit.init()`` has not been called.
        ValueError: unknown ``allreduce``, ``grad_sync``, ``shard`` or ``mixed_precision``,
            ``shard_blocks`` matching no module, SyncBatchNorm without DDP or on the CPU,
            or ``model`` already prepared or wrapped in DDP.
    """
    try:
        ctx = context()
    except RuntimeError as e:
        raise RuntimeError("ddpkit.prepare_model() needs the process group: call ddpkit.init() first") from e
    if not isinstance(model, nn.Module):
        raise UserError(
            f"prepare_model() takes a torch.nn.Module, got a {type(model).__name__}; pass the model itself "
            "(a function building it must return the module)"
        )
    if grad_sync not in GRAD_SYNC_MODES:
        raise UserError(f"grad_sync={grad_sync!r} is not valid; choose one of: {', '.join(GRAD_SYNC_MODES)}")
    if allreduce != "auto":
        from ddpkit.comm.registry import resolve_allreduce

        resolve_allreduce(allreduce)  # an unknown or unavailable name: ValueError naming the valid ones
    if sync_batchnorm and ctx.device.type == "cpu":
        raise UserError(
            "sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm supports CUDA only); drop it on CPU"
        )
    if sync_batchnorm and grad_sync in ("flat", "manual"):
        raise UserError(
            f"sync_batchnorm=True needs DDP (torch runs SyncBatchNorm inside DDP only) but "
            f"grad_sync={grad_sync!r}; pass grad_sync='ddp' or 'auto'"
        )
    if isinstance(model, DDP) or _uncompiled(model) in _SYNCS or is_sharded(model):
        raise UserError("this model was already prepared (or wrapped in DDP); pass the plain module, once")
    if wants_sharding(shard, model, ctx.device, ctx.local_world_size):
        # Moved block by block as it is sharded: the whole model need not fit on the device (nor, built on
        # the meta device by the ranks other than 0, in their memory).
        return _shard(model, ctx, shard_blocks, mixed_precision, reshard_after_forward, sync_batchnorm)
    if meta := next((name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta), None):
        raise UserError(
            f"the model's {meta} is on the meta device (no values): a replicated model needs initialised "
            "weights on every rank; build it on the CPU, or shard it (shard=True takes a model on the meta "
            "device on the ranks other than 0)"
        )
    model = model.to(ctx.device)
    if sync_batchnorm and ctx.world_size > 1:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    algorithm = choose_allreduce(allreduce, ctx)
    mode = choose_grad_sync(grad_sync, model, sync_batchnorm, algorithm)
    if mode == "ddp" and ctx.world_size > 1:
        # Wrapped here, not by GradientSync, which then holds it weakly (the registry's key).
        model = wrap_ddp(model, ctx, algorithm)
        _keys_of_the_plain_module(model)
    _SYNCS[model] = GradientSync(model, ctx, algorithm, mode)
    if not isinstance(model, DDP):
        _answer_like_ddp(model)
    return model


def _answer_like_ddp(model: nn.Module) -> None:
    """Give ``model`` (not wrapped: flat, manual, one worker) DDP's ``module`` and ``no_sync()``.

    Scripts written for DDP call them (``raw_model = model.module``, ``with
    model.no_sync():``); on a plain module they would raise AttributeError. Both
    are plain instance attributes, so the module keeps its class, its
    ``state_dict`` and its children: ``module`` is set past ``nn.Module``'s
    ``__setattr__`` (it is not a child: ``parameters()`` and ``state_dict()``
    do not see it), and ``no_sync`` is a partial of a module-level function,
    so ``copy.deepcopy(model)`` and ``torch.save(model)`` still work.
    ``require_backward_grad_sync`` is set by :class:`GradientSync`, which reads it.
    """
    taken = [name for name in ("module", "no_sync") if hasattr(model, name)]
    for name in taken:
        get_logger().warning(
            f"{type(model).__name__} has its own {name!r}: model.{name} is yours, not DDP's; "
            f"use ddpkit.{'unwrap_model(model)' if name == 'module' else 'no_sync(model)'} for DDP's"
        )
    if "module" not in taken:
        object.__setattr__(model, "module", model)
    if "no_sync" not in taken:
        object.__setattr__(model, "no_sync", functools.partial(no_sync_of, model))


def _shard(
    model: nn.Module,
    ctx: Context,
    blocks: Sequence[type | str] | None,
    mixed_precision: Any,
    reshard_after_forward: bool,
    sync_batchnorm: bool,
) -> nn.Module:
    """prepare_model with ``shard``: FSDP2 on the blocks and the root; one log line says which blocks."""
    if sync_batchnorm:
        raise UserError("sync_batchnorm=True needs DDP; it cannot be combined with shard=True")
    model, classes = shard_model(
        model,
        ctx.device,
        ctx.world_size,
        blocks=blocks,
        mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward,
    )
    if ctx.rank == 0:
        what = f"blocks {', '.join(classes)} then the root" if classes else "the root only (no repeated block)"
        get_logger().info(f"sharded (FSDP2) over {ctx.world_size} rank(s): {what}")
    return model


def _keys_of_the_plain_module(ddp: DDP) -> None:
    """Make ``ddp.state_dict()`` and ``ddp.load_state_dict()`` use the wrapped module's keys (no ``module.``).

    A user's ``torch.save(model.state_dict())`` then writes the same keys
    whichever synchronisation prepare_model chose (DDP for large models, the
    module itself for small ones), and loads into a plain module as it is.
    """

    def strip(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: dict[str, Any]) -> None:
        _replace_prefix(state_dict, prefix + "module.", prefix)
        metadata = getattr(state_dict, "_metadata", None)
        if metadata is not None:  # module paths: "module" -> "" (the root), "module.0" -> "0"
            inner = prefix + "module"
            renamed = {(prefix[:-1] if key == inner else key): value for key, value in metadata.items()}
            metadata.clear()
            metadata.update(renamed)
            _replace_prefix(metadata, inner + ".", prefix)

    def add(state_dict: dict[str, Any], prefix: str, *args: object) -> None:
        if not any(key.startswith(prefix + "module.") for key in state_dict):
            _replace_prefix(state_dict, prefix, prefix + "module.")

    ddp._register_state_dict_hook(strip)
    ddp._register_load_state_dict_pre_hook(add)


def _replace_prefix(mapping: dict[str, Any], old: str, new: str) -> None:
    """Replace ``old`` by ``new`` at the start of every key of ``mapping`` that has it, in place and in order."""
    items = list(mapping.items())
    mapping.clear()
    mapping.update((new + key[len(old) :] if key.startswith(old) else key, value) for key, value in items)


def no_sync(model: nn.Module) -> contextlib.AbstractContextManager[None]:
    """Gradient accumulation: backwards inside only accumulate; the next backward outside averages them all.

    Run the forward and backward of every micro-batch but the last inside it
    (DDP decides during the forward). Works in every mode; with one worker it
    does nothing.

    Raises:
        ValueError: ``model`` was not returned by :func:`prepare_model`.
    """
    if is_sharded(model):
        return sharded_no_sync(model)
    sync = _SYNCS.get(_uncompiled(model))
    if sync is None:
        raise UserError("no_sync(model) needs the module that ddpkit.prepare_model returned")
    return sync.no_sync()


def unwrap_model(model: nn.Module) -> nn.Module:
    """The plain module inside ``model``: what a checkpoint saves.

    Unwraps torch.compile's module (``_orig_mod``) and DDP's (``.module``), in
    any nesting, so a checkpoint of a compiled model loads into a plain one.
    """
    while True:
        inner = model.module if isinstance(model, DDP) else _uncompiled(model)
        if inner is model:
            return model
        model = inner


def gradient_sync(model: nn.Module) -> GradientSync | None:
    """How ``model``'s gradients are synchronised (mode, allreduce, nbytes, ``describe()`` for the log).

    Returns:
        The synchronisation of a module returned by :func:`prepare_model`, else None.
    """
    return _SYNCS.get(_uncompiled(model))


def _uncompiled(model: nn.Module) -> nn.Module:
    """The module torch.compile wrapped, else ``model``: ``torch.compile(prepare_model(net))`` keeps its sync."""
    inner = getattr(model, "_orig_mod", None)
    return inner if isinstance(inner, nn.Module) else model
