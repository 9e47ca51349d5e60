"""How the ranks take part in a checkpoint: rank 0 acts, every rank learns the outcome.

Rank 0 chooses the checkpoint to resume and writes checkpoints; the other
ranks must learn what it chose, or that it failed, and fail the same way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ddpkit.errors import UserError

__all__ = ["default_store", "on_rank_zero", "rank_and_size"]


def rank_and_size(environ: Mapping[str, str] | None = None) -> tuple[int, int]:
    """(rank, world size) of the process group; (0, 1) without one.

    Raises:
        UserError: ``environ`` is a launcher's with WORLD_SIZE above 1, but no process group exists yet: this
            process would act as the only rank (rank 0 of 1) while the others run too.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    launched = (environ or {}).get("WORLD_SIZE", "1")
    if launched.isdigit() and int(launched) > 1:
        raise UserError(
            f"the Checkpointer was made before the process group (WORLD_SIZE={launched} but ddpkit.init() has "
            "not run): call ddpkit.init() before ddpkit.Checkpointer(...)"
        )
    return 0, 1


def default_store() -> Any:
    """The process group's store (the check-ins and the loop progress live there)."""
    return dist.distributed_c10d._get_default_store()


def on_rank_zero(fn: Callable[[], Any], rank: int, world_size: int) -> Any:
    """Run ``fn`` on rank 0 and share its result, or its UserError (a CheckpointError...), with every rank (a
    collective): every rank then fails with the same line."""
    box: list[Any] = [None, None]
    if rank == 0:
        try:
            box[0] = fn()
        except UserError as e:
            box[1] = (type(e), str(e))  # the class too: a StorageError has its own exit status
    if world_size > 1:
        dist.broadcast_object_list(box, src=0)
    if box[1]:
        raise box[1][0](box[1][1])
    return box[0]
