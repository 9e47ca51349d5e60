"""The loop's epochs as a Checkpointer counts them, and where a resumed loop continues.

Three sources tell where the loop's epochs end, the first present counting: a ddpkit.DataLoader's position
(its epoch and step in epoch), the ``epoch_end()`` calls, a torch DataLoader's length (``loader=``). A loop
with none of them has no epochs: its resume point's step in epoch is then the global step.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.manager.restore import Restored, continue_batches, log_resume, resume_point_by_length
from ddpkit.checkpoint.manager.saving import SaveFacts
from ddpkit.data.position import LoaderPosition, PositionedLoader

__all__ = ["EpochCounter"]


class EpochCounter:
    """Counts the loop's epochs from its loader or its ``epoch_end()`` calls; see the module docstring.

    Args:
        loader: the ddpkit.DataLoader whose position the checkpoints follow (None without one).
        steps_per_epoch: batches per epoch of a torch DataLoader given as ``loader=`` (None otherwise).
    """

    def __init__(self, loader: PositionedLoader | None, steps_per_epoch: int | None) -> None:
        self.loader = loader
        self.steps_per_epoch = steps_per_epoch
        self.completed_epochs = 0
        """Epochs done, when no loader tells (counted by ``epoch_end()``)."""
        self.epoch_start_step = 0  # without a loader: the global step of the last epoch_end()
        self.first_epoch = 0  # the number of the loop's first epoch (resume's first_epoch)
        self.last_reason = ""  # why the newest checkpoint was written (its epoch position depends on it)
        self.continue_at = 0  # the batches the next pass of enumerate() continues after (a resume's)
        self.at_resume = (0, 0)  # (epoch, step_in_epoch) the last resume returned

    def loader_position(self) -> LoaderPosition | None:
        """The ddpkit.DataLoader's position; None without one."""
        return self.loader.position() if self.loader is not None else None

    def holds_no_position(self) -> bool:
        """True without a loader of either kind: a checkpoint inside an epoch holds no data position."""
        return self.loader is None and self.steps_per_epoch is None

    def epochs_unknown(self) -> bool:
        """True when nothing tells where the loop's epochs end (no loader, no ``epoch_end()`` yet)."""
        return self.holds_no_position() and not self.completed_epochs

    def resume_point(self, global_step: int) -> tuple[int, int]:
        """(epoch to train next, batches of it done), in the loop's numbering: from the loader when there is one."""
        position = self.loader_position()
        if position is not None:
            return position.resume_point  # an epoch the loop ran out of is complete, its code included
        if self.steps_per_epoch is not None and not self.completed_epochs:  # a torch DataLoader, no epoch_end()
            return resume_point_by_length(global_step, self.steps_per_epoch, self.first_epoch, self.last_reason)
        return self.first_epoch + self.completed_epochs, global_step - self.epoch_start_step

    def end_epoch(self, global_step: int) -> None:
        """``epoch_end()`` at ``global_step``: without a loader, one more epoch is done."""
        if self.loader is None:
            self.completed_epochs += 1
            self.epoch_start_step = global_step

    def restore(self, restored: Restored) -> None:
        """Take the epoch counters of the checkpoint restored."""
        self.completed_epochs, self.epoch_start_step = restored.completed_epochs, restored.epoch_start_step
        self.last_reason = restored.reason

    def log_resume(self, path: str | Path, restored: Restored, world_size: int) -> None:
        """Rank 0, once ``restored`` is taken: say where training continues (:func:`~.restore.log_resume`)."""
        log_resume(
            path,
            global_step=restored.global_step,
            resume_point=self.resume_point(restored.global_step),
            first_epoch=self.first_epoch,
            position=self.loader_position(),
            epochs_counted=self.completed_epochs > 0,
            finished=restored.finished,
            saved_world_size=restored.saved_world_size,
            world_size=world_size,
            steps_per_epoch=self.steps_per_epoch,
        )

    def resumed(self, global_step: int) -> tuple[int, int]:
        """After a resume: the resume point, where the first pass of ``enumerate()`` continues."""
        self.at_resume = self.resume_point(global_step)
        self.continue_at = self.at_resume[1]
        return self.at_resume

    def enumerate(self, batches: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """``Checkpointer.enumerate``: (step in epoch, batch); the first pass after a resume continues the epoch.

        The loader held (``loader=``, restored) hands out the epoch's remaining batches itself; any other
        iterable skips those trained already (:func:`~ddpkit.checkpoint.manager.restore.continue_batches`).
        """
        skip, self.continue_at = self.continue_at, 0
        held: object = self.loader
        if batches is held or not skip:
            return builtins.enumerate(batches, skip)
        return builtins.enumerate(continue_batches(batches, skip), skip)

    def unskipped(self) -> tuple[int, int] | None:
        """Once, at the first step after a mid-epoch resume of a torch DataLoader that ``enumerate()`` did not
        skip: the resume point (its batches were trained twice); None otherwise."""
        if self.continue_at and self.steps_per_epoch is not None:
            self.continue_at = 0
            return self.at_resume
        return None

    def save_facts(
        self,
        reason: str,
        global_step: int,
        metrics: dict[str, float],
        best: bool,
        best_info: Mapping[str, Any],
        replacing: bool,
    ) -> SaveFacts:
        """The facts of a checkpoint written now for ``reason`` (its epoch position depends on the reason)."""
        self.last_reason = reason
        position = self.loader_position()
        return SaveFacts(
            reason,
            global_step,
            self.completed_epochs,
            self.epoch_start_step,
            self.resume_point(global_step),
            position.steps_per_epoch if position is not None else self.steps_per_epoch,
            metrics,
            best,
            dict(best_info),
            replacing,
        )
