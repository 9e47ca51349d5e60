"""The hierarchical all_reduce against gloo's built-in, with ranks spread over emulated nodes.

Each layout is one job of its own (the hierarchical all_reduce works on the
world group only); the layouts run side by side in one fixture.
"""

import pytest
import torch
import torch.distributed as dist

from ddpkit.comm.hierarchical import HierarchicalAllReduce
from ddpkit.comm.ops import ReduceOp
from tests.helpers.module_runs import run_side_by_side, selected_params

CASES = [
    (op, dtype, numel)
    for op in (ReduceOp.SUM, ReduceOp.MAX, ReduceOp.MIN, ReduceOp.PRODUCT)
    for dtype in (torch.float32, torch.int64)
    for numel in (0, 1, 1023, 70000)
]


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


@pytest.fixture(scope="module")
def layouts(request) -> dict:
    """Each selected layout's result by rank (the number of nodes it saw)."""
    return run_side_by_side(
        {keys: (_compare, len(keys), (keys,), {}) for keys in selected_params(request, "node_keys")}, timeout=180
    )


@pytest.mark.slow
@pytest.mark.parametrize("node_keys", [(0, 0, 1, 1), (0, 1, 1), (0, 0)], ids=["2x2", "1+2", "one-node"])
def test_matches_builtin(layouts, node_keys):
    num_nodes = layouts[node_keys].get()
    assert num_nodes == [len(set(node_keys))] * len(node_keys)
