"""Checks made once, before any worker starts, so bad input fails fast and clearly."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ddpkit import allocator, get_model_spec
from ddpkit.checkpoint import RESUME_MODES, check_resume, restart_count, stored_checkpoints
from ddpkit.comm.registry import resolve_allreduce
from ddpkit.comm.shm import segment_bytes
from ddpkit.data.datasets import FASHION_MNIST, MNIST, dataset_function, dataset_names
from ddpkit.data.sources import locate
from ddpkit.distributed import gpu_shortage, resolve_backend, resolve_device
from ddpkit.env import shared_memory
from ddpkit.errors import UserError
from ddpkit.train.config import TrainConfig
from ddpkit.train.loop import global_batch_size
from ddpkit.train.metrics_file import check_logger
from ddpkit.train.run import checkpoint_root, data_options
from ddpkit.train.run_folder import check_fresh_run_folder, check_run_folder
from ddpkit.train.task import resolve_task

_FILE_DATASETS = {"fashion-mnist": FASHION_MNIST, "mnist": MNIST}

SYNC_BATCHNORM_NEEDS_CUDA = (
    "sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm supports CUDA only); drop it on CPU"
)


def check_before_launch(cfg: TrainConfig, world_size: int) -> None:
    """Validate ``cfg`` for ``world_size`` workers and fetch the dataset once.

    Raises:
        UserError: an unknown name (model, dataset, task, device, backend, allreduce...), a batch that
            does not divide, sync_batchnorm on the CPU, or more workers per node than GPUs with device auto or cuda.
        DataNotFoundError: the dataset is missing and cannot be downloaded.
        CheckpointError: ``resume`` cannot work with the checkpoints folder.
    """
    _check_names(cfg)
    allocator.setting(os.environ)  # DDPKIT_MALLOC: every worker's init would refuse a bad one
    shortage = gpu_shortage(cfg.nproc, torch.cuda.device_count(), cfg.device)  # NVML's count: CUDA stays uninitialized
    if shortage is not None:
        raise UserError(shortage)
    _check_shared_memory(cfg)
    if cfg.sync_batchnorm and (cfg.device == "cpu" or (cfg.device == "auto" and not torch.cuda.is_available())):
        raise UserError(SYNC_BATCHNORM_NEEDS_CUDA)
    check_logger(cfg.logger)
    spec = get_model_spec(cfg.model)
    resolve_task(cfg.task, spec.task, cfg.loss)
    if cfg.dataset not in dataset_names():
        dataset_function(cfg.dataset)  # importable here, so not N workers fail at once
    batch = global_batch_size(cfg, world_size)
    if batch < world_size or batch % world_size:
        raise UserError(
            f"global batch size {batch} does not divide among {world_size} workers; "
            f"use a multiple of {world_size} (batch_size=...) or batch_scope=per_worker"
        )
    if cfg.output_dir:
        check_run_folder(Path(cfg.output_dir))
    # (checkpoints off: only a path to check; no run folder: node 0's launcher checks it)
    if (cfg.checkpoint.enabled or cfg.resume not in RESUME_MODES) and (cfg.output_dir or cfg.checkpoint.dir):
        # A restarted or requeued job resumes its newest checkpoint whatever `resume` says (as its workers do).
        check_resume(checkpoint_root(cfg), "auto" if restart_count(os.environ) else cfg.resume)
    # An elastic job's nodes share one run folder, named alike on each, and a node that joins finds the job's files
    if cfg.output_dir and not _resumes(cfg) and not cfg.nodes.elastic:
        check_fresh_run_folder(Path(cfg.output_dir))
    if cfg.dataset in _FILE_DATASETS:
        # Here, once, rather than in N workers at the same time.
        options = data_options(cfg)
        locate(_FILE_DATASETS[cfg.dataset], options.data_dir, options.download, options.mirrors)


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity: a container's or a job's share, not the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def oversubscribed(nproc: int, device: str, cores: int) -> str | None:
    """One line when a CPU run starts more workers here than there are ``cores`` (a warning: it still runs), else None.

    Args:
        nproc: the workers started on this machine.
        device: the run's ``device`` option (auto, cpu, cuda).
        cores: the CPU cores the run may use (:func:`cpu_cores`).

    The workers then take turns on the cores, and each all_reduce waits for the slowest: 8 workers on 2 cores
    trained W1 at 3,524 samples/s against about 50,000 with 2.
    """
    on_cpu = device == "cpu" or (device == "auto" and not torch.cuda.is_available())
    if not on_cpu or nproc <= cores:
        return None
    return (
        f"nproc={nproc} is more than the {cores} CPU core(s) this machine gives the run: the workers take turns "
        f"on them and train far slower than nproc={cores} would"
    )


def _resumes(cfg: TrainConfig) -> bool:
    """Whether the run continues one: a checkpoint's path, resume=auto with a checkpoint, or a restarted job."""
    if restart_count(os.environ) or cfg.resume not in RESUME_MODES:
        return True
    return cfg.resume == "auto" and bool(stored_checkpoints(checkpoint_root(cfg)))  # a URL: the bucket's


def _check_shared_memory(cfg: TrainConfig) -> None:
    """allreduce=shm or hierarchical asked for: this node's /dev/shm must hold the segment of its nproc workers.

    (allreduce=auto falls back to gloo's all_reduce instead, see ddpkit.comm.grad_sync.)
    """
    if cfg.allreduce not in ("shm", "hierarchical"):
        return
    need, space = segment_bytes(cfg.nproc), shared_memory.measure()
    if space is not None and not space.fits(need):
        what = f"allreduce={cfg.allreduce} with nproc={cfg.nproc}"
        raise shared_memory.SharedMemoryError(shared_memory.too_small(what, need, space) + "; or allreduce=auto")


def _check_names(cfg: TrainConfig) -> None:
    """The names the config dataclass cannot check alone: device, backend and all_reduce, against this machine.

    (optimizer, precision, grad_sync, task and lr_schedule are checked when the config is parsed; model and
    dataset by check_before_launch.)
    """
    device = resolve_device(cfg.device, 0, torch.cuda.is_available())
    resolve_backend(cfg.backend, device)
    if cfg.allreduce != "auto":
        resolve_allreduce(cfg.allreduce)
