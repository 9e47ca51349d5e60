"""Hierarchical all_reduce for multi-node CPU jobs: shared memory inside each node, gloo between nodes.

Algorithm (3 phases)::

    node 0:  r0  r1  --shm all_reduce-->  every rank of node 0 holds node 0's sum
    node 1:  r2  r3  --shm all_reduce-->  every rank of node 1 holds node 1's sum
                     leaders r0, r2: gloo all_reduce of the node sums -> the result
    node 0:  r0 (result) r1 (zeros) --shm SUM-->  r0, r1 hold the result
    node 1:  r2 (result) r3 (zeros) --shm SUM-->  r2, r3 hold the result

Steps: two shared-memory all_reduces inside each node and one gloo
all_reduce among the ``num_nodes`` leaders (local rank 0 of each node). Bytes
per rank: the shared-memory phases copy about 2 x N bytes through memory; only
the leaders send over the network, ``2 (num_nodes - 1) / num_nodes x N`` with
gloo's ring, instead of every rank of every node. Phase 3 spreads the leader's
result by a sum in which the other ranks contribute zeros, so it serves every
operator (``x + 0 == x``) with the shared-memory all_reduce alone.

Nodes are told apart by ``ddpkit.init()``'s node rank when ddpkit started the
worker, else by host name; only the world group is supported.
"""

from __future__ import annotations

import socket
from collections.abc import Hashable, Sequence

import torch
import torch.distributed as dist

from ddpkit.comm import chunks, ops
from ddpkit.comm.ops import Op, ReduceOp


class HierarchicalAllReduce:
    """The groups of a hierarchical all_reduce; build it on every rank at the same time.

    Args:
        node_keys: for every global rank, a key naming its node (ranks with
            equal keys share a node), identical on every rank.
    """

    def __init__(self, node_keys: Sequence[Hashable]):
        rank = dist.get_rank()
        nodes = list(dict.fromkeys(node_keys))  # node order: by lowest rank
        ranks_by_node = [[r for r, key in enumerate(node_keys) if key == node] for node in nodes]
        self.world_size = len(node_keys)
        self.num_nodes = len(nodes)
        self.local_group: dist.ProcessGroup | None = None
        for ranks in ranks_by_node:  # every rank creates every group, in the same order
            group = dist.new_group(ranks)
            if rank in ranks:
                self.local_group, self.local_size = group, len(ranks)
        leaders = [ranks[0] for ranks in ranks_by_node]
        self.leader_group = dist.new_group(leaders)
        self.is_leader = rank in leaders

    def all_reduce(self, tensor: torch.Tensor, op: Op = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` in place across all ranks (see the module docstring)."""
        from ddpkit.comm import shm

        op = ops.check(op, tensor.dtype)
        inner = ReduceOp.SUM if op == ReduceOp.AVG else op
        with chunks.flat_view(tensor) as flat:
            if self.local_size > 1:
                shm.all_reduce(flat, op=inner, group=self.local_group)
            if self.num_nodes > 1:
                if self.is_leader:
                    dist.all_reduce(flat, op=inner, group=self.leader_group)
                if self.local_size > 1:
                    if not self.is_leader:
                        flat.zero_()
                    shm.all_reduce(flat, op=ReduceOp.SUM, group=self.local_group)
        ops.finish(tensor, op, self.world_size)


_instance: HierarchicalAllReduce | None = None


def node_key() -> Hashable:
    """This process's node: ddpkit's node rank when ddpkit.init() ran, else the host name."""
    from ddpkit import distributed

    ctx = distributed._context
    return ("node", ctx.node_rank) if ctx is not None else ("host", socket.gethostname())


def all_reduce(tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Reduce ``tensor`` across all ranks in place: shared memory per node, gloo between nodes.

    The first call is collective on every rank: it learns each rank's node
    and creates the groups.

    Args:
        tensor: input and output; a CPU tensor, same size and dtype on every rank.
        op: reduction operator (see :mod:`ddpkit.comm.ops`).
        group: must be None (the world group).

    Raises:
        ValueError: a tensor not on the CPU, a group other than the world group, or an unsupported op.
    """
    global _instance
    if not tensor.is_cpu:  # before the first call's collective setup: the shared-memory phases take CPU memory
        raise ValueError(
            f"ddpkit.comm.hierarchical.all_reduce takes CPU tensors, got one on {tensor.device}; "
            "use allreduce=builtin (the backend's own, nccl) for CUDA tensors"
        )
    if group is not None and group != dist.group.WORLD:
        raise ValueError("the hierarchical all_reduce runs on the world group only; pass group=None")
    if _instance is None:
        keys: list[Hashable] = [None] * dist.get_world_size()
        dist.all_gather_object(keys, node_key())
        _instance = HierarchicalAllReduce(keys)
    _instance.all_reduce(tensor, op)
