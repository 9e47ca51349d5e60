"""What allreduce=auto and grad_sync=auto choose, decided together by real gloo ranks."""

import torch

from ddpkit.distributed import Context
from ddpkit.env.base import ClusterEnvironment
from ddpkit.train.grad_sync import choose_allreduce
from tests.helpers.workers import run_on_ranks


def _choices(rank: int, world_size: int) -> list[str]:
    """auto's choice for 4 ranks laid out as 1 node, 2 nodes of 2, and 4 nodes of 1."""
    choices = []
    for num_nodes in (1, 2, 4):
        per_node = world_size // num_nodes
        env = ClusterEnvironment("test", rank, rank % per_node, world_size, per_node, rank // per_node, num_nodes,
                                 "127.0.0.1", 1)
        choices.append(choose_allreduce("auto", Context(env, torch.device("cpu"), "gloo")))
    choices.append(choose_allreduce("ring", Context(env, torch.device("cpu"), "gloo")))
    return choices


def test_auto_takes_shm_on_one_node_hierarchical_across_shared_nodes_builtin_otherwise():
    results = run_on_ranks(_choices, 4, timeout=120)
    assert all(r == ["shm", "hierarchical", "builtin", "ring"] for r in results), results
