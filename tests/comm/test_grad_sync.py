"""What allreduce=auto and grad_sync=auto choose (allreduce decided together by real gloo ranks)."""

import torch
from torch import nn

from ddpkit.comm.grad_sync import choose_allreduce, choose_grad_sync
from ddpkit.distributed import Context
from ddpkit.env.base import JobEnvironment
from tests.helpers.workers import run_on_ranks


def _choices(rank: int, world_size: int) -> list[str]:
    """auto's choice for 4 ranks laid out as 1 node, 2 nodes of 2, and 4 nodes of 1."""
    choices = []
    for num_nodes in (1, 2, 4):
        per_node = world_size // num_nodes
        env = JobEnvironment(
            "test", rank, rank % per_node, world_size, per_node, rank // per_node, num_nodes, "127.0.0.1", 1
        )
        choices.append(choose_allreduce("auto", Context(env, torch.device("cpu"), "gloo")))
    choices.append(choose_allreduce("ring", Context(env, torch.device("cpu"), "gloo")))
    return choices


def test_auto_takes_shm_on_one_node_hierarchical_across_shared_nodes_builtin_otherwise():
    results = run_on_ranks(_choices, 4, timeout=120)
    assert all(r == ["shm", "hierarchical", "builtin", "ring"] for r in results), results


def test_grad_sync_auto_is_flat_for_gradients_in_ddps_first_bucket_without_syncbatchnorm():
    exactly_1_mib = nn.Linear(256, 1024, bias=False)  # 256 * 1024 float32
    above = nn.Linear(256, 1024)
    frozen_above = nn.Linear(256, 1024)
    frozen_above.bias.requires_grad_(False)  # frozen parameters have no gradient to reduce
    assert choose_grad_sync("auto", exactly_1_mib, sync_batchnorm=False) == "flat"
    assert choose_grad_sync("auto", above, sync_batchnorm=False) == "ddp"
    assert choose_grad_sync("auto", frozen_above, sync_batchnorm=False) == "flat"
    assert choose_grad_sync("auto", exactly_1_mib, sync_batchnorm=True) == "ddp"
    assert choose_grad_sync("manual", above, sync_batchnorm=False) == "manual"


def test_grad_sync_auto_is_flat_at_any_size_with_the_shared_memory_all_reduce():
    large = nn.Linear(2048, 2048)  # 16 MiB of gradients
    assert choose_grad_sync("auto", large, sync_batchnorm=False, allreduce="shm") == "flat"
    assert choose_grad_sync("auto", large, sync_batchnorm=False, allreduce="builtin") == "ddp"
    assert choose_grad_sync("ddp", large, sync_batchnorm=False, allreduce="shm") == "ddp"
