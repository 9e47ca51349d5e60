"""Every rank's loader defines the same global order, checked once, at its first iteration.

Each rank of a map-style ``ddpkit.DataLoader`` takes its share of one global
order drawn from (seed, epoch). A script that draws its seed per process
(pytorch/examples' DCGAN: ``random.randint(1, 10000)`` when ``--manualSeed``
is absent) and passes it on would give every rank a permutation of its own:
samples repeat and others are never seen, silently. Before the first batch,
the ranks exchange the settings that define the order (seed, shuffle,
dataset length, global batch size, drop_last): one all_gather of a few
integers per rank, once per loader. A difference stops every rank with one
line naming the setting and the fix (refused rather than papered over: the
seed also seeds per-sample randomness and the workers, and whoever passed
different settings may hold other per-rank state that does not belong in a
data-parallel job).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ddpkit.distributed import control_device
from ddpkit.errors import UserError

_FIXES = {
    "seed": "pass the same seed on every rank (e.g. seed=0, or draw it on rank 0 and broadcast it)",
    "shuffle": "pass the same shuffle on every rank",
    "dataset length": "give every rank the same dataset (the same files, split and filter)",
    "global batch size": "pass the same batch_size (per rank) or global_batch_size on every rank",
    "drop_last": "pass the same drop_last on every rank",
}
"""Each order-defining setting and what to do when the ranks disagree on it."""


def check_same_order(settings: dict[str, int], rank: int, world_size: int) -> None:
    """Raise, on every rank, if any rank's ``settings`` differ from rank 0's (a collective over the world group).

    Args:
        settings: the order-defining values, keyed by the names of :data:`_FIXES`.
        rank: this loader's rank (the world group's).
        world_size: this loader's world size (the world group's).

    Raises:
        UserError: a setting differs; the message names it, rank 0's value and another rank's, and the fix.
    """
    mine = torch.tensor([_as_int64(v) for v in settings.values()], dtype=torch.int64, device=control_device())
    gathered = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(gathered, mine)
    values = torch.stack(gathered).cpu()
    for column, name in enumerate(settings):
        differing = (values[:, column] != values[0, column]).nonzero().flatten().tolist()
        if differing:
            other = differing[0]
            raise UserError(
                f"ddpkit.DataLoader: the ranks disagree on {name} (rank 0: {int(values[0, column])}, rank {other}: "
                f"{int(values[other, column])}), so each rank would take its share of a different order and "
                f"samples would repeat or be skipped; {_FIXES[name]}"
            )


def _as_int64(value: int) -> int:
    """``value`` as a signed 64-bit integer (a generator's seed may be any unsigned 64-bit one)."""
    value &= (1 << 64) - 1
    return value - (1 << 64) if value >= 1 << 63 else value
