"""Every rank's ddpkit.DataLoader must define the same global order: checked at the first iteration."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from ddpkit.data.loader import DataLoader
from ddpkit.errors import UserError
from tests.helpers.workers import run_on_ranks

CASES = {
    "same": {},
    "seed": {"seed": 1},
    "shuffle": {"shuffle": False},
    "dataset length": {"length": 15},
    "global batch size": {"batch_size": 4},
    "drop_last": {"drop_last": True},
}
"""What rank 1 passes differently from rank 0, keyed by the setting the error must name."""


def _first_batches(rank: int, world_size: int) -> dict[str, str]:
    seen = {}
    for name, change in CASES.items():
        options = {"seed": 0, "shuffle": True, "length": 16, "batch_size": 2, "drop_last": False}
        if rank == 1:
            options.update(change)
        dataset = TensorDataset(torch.arange(options.pop("length")))
        try:
            next(iter(DataLoader(dataset, **options)))
            seen[name] = "ok"
        except UserError as e:
            seen[name] = str(e)
    # rank= and world_size= of another layout (this rank alone): no comparison, so no collective to wait on.
    alone = DataLoader(TensorDataset(torch.arange(4)), batch_size=2, seed=rank, rank=0, world_size=1)
    seen["alone"] = str(len(list(alone)))
    return seen


def test_loaders_that_disagree_stop_every_rank_with_one_line_naming_the_setting():
    ranks = run_on_ranks(_first_batches, 2, timeout=120)
    assert ranks[0] == ranks[1]
    assert ranks[0]["same"] == "ok" and ranks[0]["alone"] == "2"
    for name in CASES:
        if name != "same":
            message = ranks[0][name]
            assert message.startswith(f"ddpkit.DataLoader: the ranks disagree on {name} (rank 0: "), message
            assert "\n" not in message and any(fix in message for fix in ("; pass the same", "; give every rank"))
