"""``hvd.init`` and ``hvd.shutdown``, and what torch was built with: ``nccl_built``, ``gloo_enabled`` and the rest.

``hvd.init()`` is ``ddpkit.init()`` (which detects mpirun, srun, torchrun
and ``ddpkit run`` from their variables, binds the local GPU and forms the
process group) followed by the start of the background thread that runs the
collectives. Ranks and sizes are read in :mod:`ddpkit.horovod.ranks`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ddpkit import distributed
from ddpkit.comm.grad_sync import choose_allreduce
from ddpkit.comm.registry import COLLECTIVES, builtin_all_reduce, resolve_allreduce
from ddpkit.horovod import engine, process_sets
from ddpkit.horovod.ranks import initialized_context, is_initialized
from ddpkit.horovod.unsupported import COMM, HorovodUnsupportedError

_homogeneous = True


def init(comm: object = None, process_sets: Sequence[object] | None = None) -> None:
    """Join the job (``ddpkit.init()``) and start the collectives' background thread; a second call does nothing.

    A collective: every rank calls it.

    Args:
        comm: not supported (Horovod's MPI communicator or list of ranks).
        process_sets: None, or a list holding only ``hvd.global_process_set``.

    Raises:
        HorovodUnsupportedError: ``comm`` given, or process sets beyond the global one.
        ValueError, RuntimeError: as ``ddpkit.init()``.
    """
    global _homogeneous
    if comm is not None:
        raise HorovodUnsupportedError(COMM)
    for process_set in process_sets or ():
        _check_process_set(process_set)
    if is_initialized():
        return
    ctx = distributed.init()
    name = choose_allreduce("auto", ctx)  # a collective: every rank picks the same algorithm
    all_reduce = builtin_all_reduce if name == "builtin" else resolve_allreduce(name)
    _homogeneous = _same_on_every_node(ctx.local_world_size)
    engine.start(engine.Engine(ctx.rank, ctx.world_size, ctx.device, distributed.control_device(), all_reduce))


def shutdown() -> None:
    """Finish the queued collectives, stop the background thread and leave the process group."""
    engine.stop()
    distributed.shutdown()


def is_homogeneous() -> bool:
    """Whether every node runs the same number of processes."""
    initialized_context()
    return _homogeneous


def mpi_threads_supported() -> bool:
    """False: ddpkit.horovod does not run on MPI (mpirun only starts the processes)."""
    initialized_context()
    return False


def mpi_enabled() -> bool:
    """False: the collectives run on torch.distributed, not MPI."""
    return False


def mpi_built() -> bool:
    """False: no MPI library is used."""
    return False


def gloo_enabled() -> bool:
    """Whether the process group uses gloo."""
    return "gloo" in initialized_context().backend


def gloo_built() -> bool:
    """Whether torch.distributed was built with gloo."""
    return dist.is_gloo_available()


def nccl_built() -> int:
    """NCCL's version code (as NCCL_VERSION_CODE) when torch has NCCL and CUDA, else 0."""
    if not (dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = (int(part) for part in torch.cuda.nccl.version())
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


def cuda_built() -> bool:
    """Whether torch was built with CUDA."""
    return torch.version.cuda is not None


def rocm_built() -> bool:
    """Whether torch was built with ROCm."""
    return torch.version.hip is not None


def ddl_built() -> bool:
    """False: IBM DDL is not used."""
    return False


def ccl_built() -> bool:
    """False: oneCCL is not used."""
    return False


def _check_process_set(process_set: object) -> None:
    process_sets.check(process_set)


def _same_on_every_node(local_world_size: int) -> bool:
    device = distributed.control_device()
    mine = torch.tensor([local_world_size], dtype=torch.int64, device=device)
    gathered = torch.empty(dist.get_world_size(), dtype=torch.int64, device=device)
    COLLECTIVES["all_gather_into_tensor"]["builtin"](gathered, mine)
    return len(set(gathered.tolist())) == 1
