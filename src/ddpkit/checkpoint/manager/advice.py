"""What a loop is told once, on rank 0, when its checkpoints would not resume it exactly.

Each function returns the line to log, or "" when there is nothing to say;
the Checkpointer decides when to ask, and :class:`SaidOnce` says each at most once.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any, Protocol

from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ddpkit.log import get_logger

__all__ = [
    "SaidOnce",
    "differing_extras",
    "no_best_metric",
    "no_position",
    "unheld_scheduler",
    "unskipped_batches",
    "unwritten_at_exit",
]


class SaidOnce:
    """The once-only warnings of one Checkpointer: rank 0 says each at most once; every rank records it."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.said: set[str] = set()
        """The keys of the warnings already given (or found to have nothing to say)."""
        self._unsaid_position: tuple[int, int, int] | None = None  # a checkpoint inside an epoch, not yet told

    def say(self, key: str, message: str) -> None:
        """Log ``message`` on rank 0 unless ``key`` was said; an empty message says nothing (and settles it)."""
        if message and self.rank == 0 and key not in self.said:
            get_logger().warning(message)
        self.said.add(key)

    def scheduler_not_held(self, objects: Mapping[str, Any]) -> None:
        """:func:`unheld_scheduler`, once."""
        if "scheduler" not in self.said:
            self.say("scheduler", unheld_scheduler(objects))

    def position_not_held(self, global_step: int, resume_point: tuple[int, int], completed_epochs: int) -> None:
        """Without a loader, a checkpoint inside an epoch holds no data position: :func:`no_position`, once.

        Only a loop with epochs is told: one that calls ``epoch_end()`` (``completed_epochs`` above 0). A
        checkpoint taken before the first ``epoch_end()`` is told of then; a loop that never calls it
        (iterations over batches it samples itself, from the generators the checkpoint restores) has
        nothing to skip.
        """
        if "no_position" in self.said:
            return
        epoch, step = resume_point
        if step and self._unsaid_position is None:
            self._unsaid_position = (global_step, epoch, step)
        if completed_epochs > 0 and self._unsaid_position is not None:
            self.say("no_position", no_position(*self._unsaid_position))


def unheld_scheduler(objects: Mapping[str, Any]) -> str:
    """An optimizer held has an LR scheduler that is not: a resume would restart its schedule."""
    held = {id(obj.optimizer) for obj in objects.values() if isinstance(obj, LRScheduler)}
    for name, obj in objects.items():
        # An LRScheduler sets initial_lr in its optimizer's param groups: the optimizer has one.
        if isinstance(obj, Optimizer) and id(obj) not in held and any("initial_lr" in g for g in obj.param_groups):
            return (
                f"{name} has an LR scheduler that this Checkpointer does not hold (its param groups carry "
                "initial_lr): a resumed run would start the schedule again from its first step; pass it as "
                "scheduler=... (or in extra={...})"
            )
    return ""


def no_position(global_step: int, epoch: int, step_in_epoch: int) -> str:
    """A checkpoint inside an epoch without a loader cannot hold where the data is."""
    if not step_in_epoch:
        return ""
    return (
        f"checkpoint of global step {global_step} is {step_in_epoch} step(s) into epoch {epoch} (epochs are "
        "counted by epoch_end() calls), and this Checkpointer has no loader= to hold the position in the "
        "data: a run resumed from it starts that epoch again at its first batch, training those batches "
        "twice, unless the loop skips ResumePoint.step_in_epoch batches; pass loader=ddpkit.DataLoader(...) "
        "for an exact resume"
    )


def unskipped_batches(epoch: int, step_in_epoch: int) -> str:
    """A run resumed inside an epoch of a torch DataLoader (``loader=``) trained a step without ``enumerate()``."""
    return (
        f"resumed {step_in_epoch} batch(es) into epoch {epoch} of a torch DataLoader, and the loop took a step "
        "without iterating ckpt.enumerate(loader), which skips the batches trained already: unless the loop "
        "skips ResumePoint.step_in_epoch batches itself (itertools.islice), it trains them twice; iterate "
        "`for i, batch in ckpt.enumerate(loader):`"
    )


def differing_extras(names: list[str], digests_by_rank: list[Mapping[str, str]]) -> str:
    """Extras whose tensors differ between ranks: saved from rank 0, every rank would resume with rank 0's."""
    differing = [name for name in names if len({digests[name] for digests in digests_by_rank}) > 1]
    if not differing:
        return ""
    listed = ", ".join(differing)
    return (
        f"extra object(s) {listed} hold tensors that differ between the ranks, and extra= is saved from rank 0: "
        f"a resumed run would give every rank rank 0's; pass them as per_rank={{...}} to save each rank's own"
    )


class _Unwritten(Protocol):
    rank: int
    global_step: int

    def unwritten(self) -> str: ...


def say_if_unwritten(ref: weakref.ReferenceType[_Unwritten]) -> None:
    """At exit, rank 0: a checkpoint waited for ``close()``, which the script never called (``ref``: the
    Checkpointer, weakly held, so that the registration at exit keeps no Checkpointer alive)."""
    ckpt = ref()
    if ckpt is not None and ckpt.rank == 0 and ckpt.unwritten():
        get_logger().warning(unwritten_at_exit(ckpt.global_step, ckpt.unwritten()))


def unwritten_at_exit(global_step: int, reason: str) -> str:
    """The process exits with a checkpoint that waited for ``close()``, which the script never called."""
    return (
        f"the checkpoint of global step {global_step} ({reason}) was not written: the script ended without "
        "Checkpointer.close(), which writes the last epoch's checkpoint; call ckpt.close() on every rank after "
        "training"
    )


def no_best_metric(metric: str, given: Mapping[str, float] | None) -> str:
    """``best_metric`` is set but never reaches the Checkpointer: no ``best-*`` checkpoint would be written.

    ``given``: the metrics an ``epoch_end()`` call gave (None: an epoch ended, or training did, without one).
    """
    if not metric or (given is not None and metric in given):
        return ""
    fix = f"call ckpt.epoch_end({{{metric!r}: value}}) after each epoch's evaluation"
    if given is None:
        return f"best_metric={metric!r} but no epoch_end() call gave it: no best-* checkpoint is written; {fix}"
    return (
        f"best_metric={metric!r} is not among the metrics epoch_end() was given "
        f"({', '.join(sorted(given)) or 'none'}): no best-* checkpoint is written; {fix}"
    )
