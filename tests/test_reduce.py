"""ddpkit.reduce_sums on real gloo ranks: numbers and tensors of any shape, summed over the ranks."""

from __future__ import annotations

import torch

from ddpkit.reduce import reduce_sums
from tests.helpers.workers import run_on_ranks


def _sums(rank: int, world_size: int) -> dict:
    return reduce_sums(
        {
            "loss": 1.5 * (rank + 1),
            "correct": torch.tensor(rank + 2),
            "per_class": torch.arange(3, dtype=torch.float32) * (rank + 1),
            "confusion": torch.full((2, 3, 2), rank + 1, dtype=torch.int64),
            "one": torch.tensor([rank + 1.0]),
        }
    )


def test_reduce_sums_gives_floats_for_scalars_and_tensors_of_the_inputs_shape():
    total = run_on_ranks(_sums, 3, timeout=120)[0]
    assert total["loss"] == 9.0 and total["correct"] == 9.0
    assert isinstance(total["loss"], float) and isinstance(total["correct"], float)
    assert torch.equal(total["per_class"], torch.tensor([0.0, 6.0, 12.0]))
    assert torch.equal(total["confusion"], torch.full((2, 3, 2), 6, dtype=torch.int64))
    assert torch.equal(total["one"], torch.tensor([6.0]))


def test_reduce_sums_without_a_process_group_returns_the_values():
    assert reduce_sums({}) == {}
    total = reduce_sums({"count": 3, "matrix": torch.eye(2)})
    assert total["count"] == 3.0 and torch.equal(total["matrix"], torch.eye(2))
