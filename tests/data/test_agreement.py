"""Every rank's ddpkit.DataLoader must define the same global order: checked at the first iteration."""

from __future__ import annotations

import time

import torch
from torch.utils.data import TensorDataset

from ddpkit.data.agreement import WAIT_S
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


def test_loaders_that_disagree_stop_with_one_line_naming_the_setting():
    ranks = run_on_ranks(_first_batches, 2, timeout=120)
    for seen in ranks:
        assert seen["same"] == "ok" and seen["alone"] == "2"
    for name in CASES:
        if name != "same":
            # Every rank that saw the other's settings says so (both, when they arrive within WAIT_S); never none.
            messages = [seen[name] for seen in ranks if seen[name] != "ok"]
            assert messages, name
            for message in messages:
                assert message.startswith(f"ddpkit.DataLoader: the ranks disagree on {name} (rank 0: "), message
                assert "\n" not in message and any(fix in message for fix in ("; pass the same", "; give every rank"))


def _rank_zero_alone(rank: int, world_size: int) -> float:
    """An evaluation loader that only rank 0 iterates: it waits WAIT_S at most for rank 1, then goes on."""
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=2)
    began = time.monotonic()
    if rank == 0:
        assert len(list(loader)) == 2
    took = time.monotonic() - began
    # Rank 1 stays in the group until rank 0 is through: a rank that leaves at once can close its side of
    # gloo's connections while rank 0 still completes them in init_process_group ("closed by peer").
    torch.distributed.barrier()
    return took


def test_a_loader_only_rank_zero_iterates_does_not_wait_for_the_others():
    took = run_on_ranks(_rank_zero_alone, 2, timeout=120)
    assert took[0] < WAIT_S + 20, took
