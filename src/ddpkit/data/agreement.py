"""Every rank's loader defines the same global order, checked once, at its first iteration.

Each rank of a map-style ``ddpkit.DataLoader`` takes its share of one global
order drawn from (seed, epoch). A script that draws its seed per process
(pytorch/examples' DCGAN: ``random.randint(1, 10000)`` when ``--manualSeed``
is absent) and passes it on would give every rank a permutation of its own:
samples repeat and others are never seen, silently. Before the first batch,
each rank publishes the settings that define the order (seed, shuffle,
dataset length, global batch size, drop_last) in the process group's store and
compares them with the other ranks'. A difference stops the rank that sees it
with one line naming the setting and the fix (refused rather than papered
over: the seed also seeds per-sample randomness and the workers, and whoever
passed different settings may hold other per-rank state that does not belong
in a data-parallel job).

Why the store and not a collective: a loader that only some ranks iterate
(an evaluation on rank 0) must not wait for the others. Each rank waits a
few seconds at most for the others' settings, then compares what is there:
the last rank to arrive always sees every other rank's, so a difference is
always found by at least one rank (every rank, when they arrive together),
and the launcher then stops the job on that rank's line.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from ddpkit.data.sampler import GlobalBatchSampler
from ddpkit.errors import UserError

_FIXES = {
    "seed": "pass the same seed on every rank (e.g. seed=0, or draw it on rank 0 and broadcast it)",
    "shuffle": "pass the same shuffle on every rank",
    "dataset length": "give every rank the same dataset (the same files, split and filter)",
    "global batch size": "pass the same batch_size (per rank) or global_batch_size on every rank",
    "drop_last": "pass the same drop_last on every rank",
}
"""Each order-defining setting and what to do when the ranks disagree on it."""

WAIT_S = 5.0
"""Seconds a rank waits for the other ranks' settings before comparing with those that are there."""

_KEY = "ddpkit/loader-order"
_checked = 0
"""Loaders this process has checked: the n-th loader checked on one rank is compared with the n-th on the others."""


def agree_on_order(sampler: GlobalBatchSampler | None, rank: int, world_size: int) -> None:
    """Check a loader's order-defining settings against the other ranks' (:func:`check_same_order`).

    Only for a map-style loader (``sampler`` is its global order) sharded over
    the world group (the one its rank and world size came from); a stream's
    shards (``sampler`` None) need no common order.
    """
    if sampler is None or world_size == 1 or not (dist.is_available() and dist.is_initialized()):
        return
    if (rank, world_size) != (dist.get_rank(), dist.get_world_size()):
        return  # rank= and world_size= given for another layout: no group to compare over
    settings = {
        "seed": sampler.seed,
        "shuffle": int(sampler.shuffle),
        "dataset length": sampler.num_samples,
        "global batch size": sampler.global_batch_size,
        "drop_last": int(sampler.drop_last),
    }
    check_same_order(settings, rank, world_size)


def check_same_order(settings: dict[str, int], rank: int, world_size: int, wait_s: float = WAIT_S) -> None:
    """Raise if another rank's ``settings`` for this loader differ from this rank's (through the default store).

    Args:
        settings: the order-defining values, keyed by the names of :data:`_FIXES`.
        rank: this loader's rank (the world group's).
        world_size: this loader's world size (the world group's).
        wait_s: how long to wait for ranks that have not reached this loader's first iteration yet.

    Raises:
        UserError: a setting differs; the message names it, two ranks' values (rank 0's where it is known)
            and the fix.
    """
    global _checked
    serial, _checked = _checked, _checked + 1
    store = dist.distributed_c10d._get_default_store()
    keys = [f"{_KEY}/{serial}/{r}" for r in range(world_size)]
    store.set(keys[rank], json.dumps(settings))
    try:
        store.wait(keys, timedelta(seconds=wait_s))
    except Exception:  # a store's timeout has no common class (DistStoreError, RuntimeError)
        pass  # a rank that has not arrived compares on its arrival, with this rank's settings there
    seen = {r: json.loads(store.get(key)) for r, key in enumerate(keys) if r == rank or store.check([key])}
    _compare(seen)


def _compare(seen: dict[int, dict[str, Any]]) -> None:
    """Raise on the first setting where a rank in ``seen`` differs from the lowest rank there."""
    first = min(seen)
    for name, value in seen[first].items():
        other = next((r for r in sorted(seen) if seen[r][name] != value), None)
        if other is not None:
            raise UserError(
                f"ddpkit.DataLoader: the ranks disagree on {name} (rank {first}: {value}, rank {other}: "
                f"{seen[other][name]}), so each rank would take its share of a different order and samples "
                f"would repeat or be skipped; {_FIXES[name]}"
            )
