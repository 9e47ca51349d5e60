"""Collectives built only on point-to-point ``isend``/``irecv``, and the hooks that train with them.

Every function has the name and in-place signature of its
``torch.distributed`` counterpart, so code written against
``torch.distributed`` runs on these by changing the import::

    from ddpkit import comm

    comm.all_reduce(t)                               # ring, in place
    comm.all_reduce(t, op=comm.ReduceOp.MAX, group=g)
    comm.resolve_allreduce("butterfly")(t)           # any algorithm by name

Collectives and the algorithm behind each default name:

=========================  ===============================  ===================================
function                   algorithm                        module
=========================  ===============================  ===================================
all_reduce                 pipelined ring (2 ranks: swap)   :mod:`~ddpkit.comm.ring`
reduce, broadcast          pipelined binary tree            :mod:`~ddpkit.comm.tree`
all_gather(_into_tensor)   ring                             :mod:`~ddpkit.comm.ring`
reduce_scatter(_tensor)    ring                             :mod:`~ddpkit.comm.ring`
gather, scatter            linear (direct to/from root)     :mod:`~ddpkit.comm.linear`
all_to_all(_single)        pairwise, all posted at once     :mod:`~ddpkit.comm.pairwise`
barrier                    dissemination                    :mod:`~ddpkit.comm.dissemination`
=========================  ===============================  ===================================

More all_reduce algorithms, by name in :data:`ALLREDUCE_ALGORITHMS`:
``naive`` (through rank 0, :mod:`~ddpkit.comm.naive`), ``butterfly``
(recursive halving-doubling, :mod:`~ddpkit.comm.butterfly`), ``tree``, and
``shm`` (shared memory, :mod:`ddpkit.comm.shm`, where available). Each
module's docstring gives the algorithm, its steps and its bytes moved.

What holds for every collective here:

- Any world size and any tensor size: tensors are cut with
  ``torch.tensor_split``, so uneven chunks and empty tensors work.
- Ops SUM, PRODUCT, MIN, MAX, AVG (and BAND, BOR, BXOR on integers), on float
  and integer dtypes; AVG on integers rounds toward zero
  (:mod:`~ddpkit.comm.ops`).
- Ranks (``dst``, ``src``) are ranks *in the group*; with the default group
  they are the global ranks. (torch's own ``dst``/``src`` are global ranks.)
- Non-contiguous tensors work (through a contiguous copy).
- Synchronous: each call returns when this rank's part is done; there is no
  ``async_op``. Every rank of the group must make the same calls in the same
  order, as with ``torch.distributed``.
- Messages are tagged from ``p2p.COLLECTIVE_TAG`` (2**20) upwards; keep the
  tags of your own ``isend``/``irecv`` below it.

Training: :func:`allreduce_hook` turns any all_reduce into a DDP
communication hook (DDP's bucketing and backward overlap stay);
:func:`manual_gradient_sync` is the textbook per-parameter loop, started
from identical weights by :func:`broadcast_parameters`.
"""

from ddpkit.comm.dissemination import barrier
from ddpkit.comm.hooks import allreduce_hook, broadcast_parameters, manual_gradient_sync, register_allreduce_hook
from ddpkit.comm.linear import gather, scatter
from ddpkit.comm.ops import ReduceOp
from ddpkit.comm.pairwise import all_to_all, all_to_all_single
from ddpkit.comm.registry import (
    ALLREDUCE_ALGORITHMS,
    COLLECTIVES,
    available_allreduce_algorithms,
    resolve,
    resolve_allreduce,
)
from ddpkit.comm.ring import (
    all_gather,
    all_gather_into_tensor,
    all_gather_single,
    all_reduce,
    reduce_scatter,
    reduce_scatter_single,
    reduce_scatter_tensor,
)
from ddpkit.comm.tree import broadcast, reduce

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "COLLECTIVES",
    "ReduceOp",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "allreduce_hook",
    "available_allreduce_algorithms",
    "barrier",
    "broadcast",
    "broadcast_parameters",
    "gather",
    "manual_gradient_sync",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "register_allreduce_hook",
    "resolve",
    "resolve_allreduce",
    "scatter",
]
