"""The hierarchical all_reduce against gloo's built-in, with ranks spread over emulated nodes."""

import pytest
import torch
import torch.distributed as dist

from ddpkit.comm.hierarchical import HierarchicalAllReduce
from ddpkit.comm.ops import ReduceOp
from tests.helpers.workers import run_on_ranks

CASES = [(op, dtype, numel) for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT)
         for dtype in (torch.float32, torch.int64) for numel in (0, 1, 1023, 70000)]


def _compare(rank, world_size, node_keys):
    hierarchical = HierarchicalAllReduce(node_keys)
    generator = torch.Generator().manual_seed(rank)
    for op, dtype, numel in CASES:
        values = torch.randint(1, 4, (numel,), generator=generator).to(dtype)
        ours, reference = values.clone(), values.clone()
        hierarchical.all_reduce(ours, op)
        dist.all_reduce(reference, op=op)
        assert torch.equal(ours, reference), (op, dtype, numel)
    average = torch.full((5,), float(rank))
    hierarchical.all_reduce(average, ReduceOp.AVG)
    assert torch.allclose(average, torch.full((5,), (world_size - 1) / 2))
    return hierarchical.num_nodes


@pytest.mark.slow
@pytest.mark.parametrize("node_keys", [(0, 0, 1, 1), (0, 1, 1), (0, 0)], ids=["2x2", "1+2", "one-node"])
def test_matches_builtin(node_keys):
    num_nodes = run_on_ranks(_compare, len(node_keys), node_keys, timeout=180)
    assert num_nodes == [len(set(node_keys))] * len(node_keys)
