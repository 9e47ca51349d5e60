"""Horovod's PyTorch API on torch.distributed: a Horovod script runs with its import changed.

::

    import ddpkit.horovod as hvd            # instead of: import horovod.torch as hvd

    hvd.init()
    torch.cuda.set_device(hvd.local_rank())
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.fp16)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

Launch it with ``mpirun -np 4 python train.py`` (OpenMPI; MPI only starts
the processes, ``hvd.init()`` reads their ranks from its variables), srun,
torchrun or ``ddpkit run nproc=4 train.py``.

Where things live: :mod:`~ddpkit.horovod.basics` (init, shutdown, what torch was built with),
:mod:`~ddpkit.horovod.ranks` (ranks and sizes),
:mod:`~ddpkit.horovod.ops` (handles and allreduce), :mod:`~ddpkit.horovod.exchange` (the other collectives),
:mod:`~ddpkit.horovod.engine` (the background thread and join),
:mod:`~ddpkit.horovod.optimizer` (DistributedOptimizer),
:mod:`~ddpkit.horovod.functions` (broadcasting parameters, optimizer state,
objects), :mod:`~ddpkit.horovod.compression`. Not supported, each with a
one-line :class:`HorovodUnsupportedError` naming the alternative: Adasum,
``hvd.elastic``, process sets other than the global one, ``SyncBatchNorm``.
"""

from __future__ import annotations

from typing import NoReturn

from ddpkit.horovod import elastic
from ddpkit.horovod.basics import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
    shutdown,
)
from ddpkit.horovod.compression import Compression
from ddpkit.horovod.exchange import (
    allgather,
    allgather_async,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    join,
)
from ddpkit.horovod.functions import (
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
)
from ddpkit.horovod.ops import (
    Adasum,
    Average,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    poll,
    synchronize,
)
from ddpkit.horovod.optimizer import DistributedOptimizer
from ddpkit.horovod.process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from ddpkit.horovod.ranks import cross_rank, cross_size, is_initialized, local_rank, local_size, rank, size
from ddpkit.horovod.unsupported import SYNC_BATCH_NORM, HorovodUnsupportedError

__all__ = [
    "Adasum",
    "Average",
    "Compression",
    "DistributedOptimizer",
    "HorovodUnsupportedError",
    "Max",
    "Min",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "synchronize",
]


def __getattr__(name: str) -> NoReturn:
    if name == "SyncBatchNorm":
        raise HorovodUnsupportedError(SYNC_BATCH_NORM)
    raise AttributeError(f"module 'ddpkit.horovod' has no attribute {name!r}")
