"""Who this process is in the job, as Horovod asks: ``hvd.rank``, ``size``, ``local_rank`` and the rest.

Read from ddpkit's context once ``hvd.init()`` (:mod:`ddpkit.horovod.basics`)
has run. Horovod's ranks map onto ddpkit's environment:

==============  ===========================================
rank, size      ``Context.rank``, ``Context.world_size``
local_rank      ``Context.local_rank`` (rank on this node)
local_size      ``Context.local_world_size``
cross_rank      ``Context.node_rank`` (index of this node)
cross_size      ``env.num_nodes``
==============  ===========================================
"""

from __future__ import annotations

from ddpkit import distributed
from ddpkit.horovod import engine


def is_initialized() -> bool:
    """Whether ``init()`` has been called (and ``shutdown()`` not since)."""
    try:
        engine.current()
    except ValueError:
        return False
    return True


def rank() -> int:
    """This process's global rank."""
    return initialized_context().rank


def size() -> int:
    """The number of processes in the job."""
    return initialized_context().world_size


def local_rank() -> int:
    """This process's rank among the processes of its node (the GPU to use)."""
    return initialized_context().local_rank


def local_size() -> int:
    """The number of processes on this node."""
    return initialized_context().local_world_size


def cross_rank() -> int:
    """The index of this process's node (its rank among the processes with its local rank)."""
    return initialized_context().node_rank


def cross_size() -> int:
    """The number of nodes."""
    return initialized_context().env.num_nodes


def initialized_context() -> distributed.Context:
    """The job's context; raises unless ``hvd.init()`` has been called."""
    if not is_initialized():
        raise ValueError("ddpkit.horovod is not initialized; call hvd.init() first")
    return distributed.context()
