"""ddpkit: data-parallel PyTorch training from one command, anywhere.

Your own script, made distributed and resumable::

    import ddpkit

    ctx = ddpkit.init()                                   # rank, world_size, device, backend...
    model = ddpkit.prepare_model(MyNet())                 # device, rank 0's weights, gradient sync
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ddpkit.DataLoader(train_set, global_batch_size=64, shuffle=True, seed=0, num_workers=2)
    ckpt = ddpkit.Checkpointer("runs/mine", model=model, optimizer=opt, loader=loader, every_steps=500)
    start = ckpt.resume("auto")
    for epoch in range(start.epoch, epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            loss.backward(); opt.step(); opt.zero_grad()
            ckpt.step()

Launch it with ``ddpkit run nproc=2 train.py``, or unchanged under torchrun, srun or mpirun; from
Python, a REPL or a notebook cell, ``ddpkit.launch(train, nproc=2)`` runs a function ``train`` so.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING, Any

from ddpkit.version import __version__

_PUBLIC = {
    # joining the job
    "Context": "ddpkit.distributed",
    "context": "ddpkit.distributed",
    "init": "ddpkit.distributed",
    "main_process_first": "ddpkit.distributed",
    "shutdown": "ddpkit.distributed",
    # starting the workers from Python: a script, a REPL, a notebook cell
    "launch": "ddpkit.launchers.function",
    # the model and its gradients
    "prepare_model": "ddpkit.prepare",
    "no_sync": "ddpkit.prepare",
    "unwrap_model": "ddpkit.prepare",
    "gradient_sync": "ddpkit.prepare",
    "GradientSync": "ddpkit.comm.grad_sync",
    "is_sharded": "ddpkit.comm.fsdp",
    # models by name: the reference models and the user's own, as model=NAME takes them
    "ModelSpec": "ddpkit.models.spec",
    "get_model_spec": "ddpkit.models.registry",
    "register_model": "ddpkit.models.registry",
    # data
    "DataLoader": "ddpkit.data.loader",
    "GlobalBatchSampler": "ddpkit.data.sampler",
    # data that each node holds only its own part of
    "NodeShards": "ddpkit.data.node_shards",
    "stage_node_shards": "ddpkit.data.node_shards",
    "write_shards": "ddpkit.data.node_shards",
    # checkpoints
    "Checkpointer": "ddpkit.checkpoint",
    "CheckpointOptions": "ddpkit.checkpoint",
    "ResumePoint": "ddpkit.checkpoint",
    "CheckpointError": "ddpkit.checkpoint",
    "Preempted": "ddpkit.checkpoint",
    "list_checkpoints": "ddpkit.checkpoint",
    "CheckpointInfo": "ddpkit.checkpoint",
    "FolderLock": "ddpkit.checkpoint",
    "FolderInUseError": "ddpkit.checkpoint",
    # repeatable runs, trained weights in and out
    "seed_everything": "ddpkit.checkpoint",
    "export_checkpoint": "ddpkit.checkpoint",
    "apply_transfer": "ddpkit.checkpoint",
    "TransferReport": "ddpkit.checkpoint",
    # exit statuses a launcher or a job script tests for
    "EXIT_PREEMPTED": "ddpkit.names",
    "EXIT_INTERRUPTED": "ddpkit.names",
    "EXIT_STORAGE": "ddpkit.names",
    "EXIT_DIVERGED": "ddpkit.names",
    # exact metrics
    "reduce_sums": "ddpkit.reduce",
    # experiment tracking (CSV, TensorBoard, MLflow, W&B), continued across restarts
    "Tracker": "ddpkit.tracking.tracker",
    # errors that are the user's to fix: one line, exit status 2
    "UserError": "ddpkit.errors",
}

__all__ = [*_PUBLIC, "__version__"]

if TYPE_CHECKING:
    # What editors and type checkers read (the lazy loading below is invisible to them); a test checks
    # that these imports and _PUBLIC name the same objects.
    # isort would join these three lines into one import, which that test does not read.
    # isort: off
    from ddpkit.checkpoint import Checkpointer, CheckpointError, CheckpointInfo, CheckpointOptions, ResumePoint
    from ddpkit.checkpoint import FolderInUseError, FolderLock, Preempted, TransferReport, apply_transfer
    from ddpkit.checkpoint import export_checkpoint, list_checkpoints, seed_everything

    # isort: on
    from ddpkit.comm.fsdp import is_sharded
    from ddpkit.comm.grad_sync import GradientSync
    from ddpkit.data.loader import DataLoader
    from ddpkit.data.node_shards import NodeShards, stage_node_shards, write_shards
    from ddpkit.data.sampler import GlobalBatchSampler
    from ddpkit.distributed import Context, context, init, main_process_first, shutdown
    from ddpkit.errors import UserError
    from ddpkit.launchers.function import launch
    from ddpkit.models.registry import get_model_spec, register_model
    from ddpkit.models.spec import ModelSpec
    from ddpkit.names import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_STORAGE
    from ddpkit.prepare import gradient_sync, no_sync, prepare_model, unwrap_model
    from ddpkit.reduce import reduce_sums
    from ddpkit.tracking.tracker import Tracker


def __getattr__(name: str) -> Any:
    # Imported on first use: `ddpkit slurm` and `ddpkit --help` need not wait for torch.
    if name in _PUBLIC:
        return getattr(importlib.import_module(_PUBLIC[name]), name)
    raise AttributeError(f"module 'ddpkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, the module's dunders and ddpkit's submodules already imported (not this file's helpers)."""
    own = {name for name, value in globals().items() if name.startswith("__") or _is_submodule(value)}
    return sorted(own | set(__all__))


def _is_submodule(value: Any) -> bool:
    return isinstance(value, types.ModuleType) and value.__name__.startswith("ddpkit.")
