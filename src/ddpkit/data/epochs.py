"""Where a ddpkit.DataLoader is in its epochs, and the rules that move it.

The loader is at (``epoch``, ``step_in_epoch``). ``set_epoch(n)`` chooses the
epoch, in any numbering; a loop that never calls it gets a new epoch (a new
order) at each complete pass, counted from 0. Every iterator made during an
epoch starts at the epoch's start, or at the restored step after a resume,
as torch's loader starts each iterator at the epoch's start: a look at
``next(iter(loader))`` before the batch loop takes nothing from the loop. The
step counts the batches handed to the loop by the newest iterator. A loop
that never calls ``set_epoch`` and leaves a pass early (a ``break`` after two
batches or more) gets the next epoch at its next pass, as torch's loader
reshuffles.

:class:`EpochCursor` holds these rules and nothing else: no data, no
workers, no logging; the loader asks it where to start each pass and tells
it each batch handed out.
"""

from __future__ import annotations

from ddpkit.data.position import LoaderPosition

__all__ = ["EpochCursor"]


class EpochCursor:
    """A loader's position in its epochs; see the module docstring."""

    def __init__(self) -> None:
        self.epoch = 0
        """The epoch being (or next to be) iterated."""
        self.start_step = 0
        """The step each iterator of this epoch starts at: 0, or a restored step."""
        self.step_in_epoch = 0
        """Batches of ``epoch`` handed out by the newest iterator (counting those a resume skipped)."""
        self.epoch_done = False
        """True once the loop ran out of ``epoch``'s batches."""
        self.epochs_set = False
        """True once the loop has called ``set_epoch`` (it numbers the epochs itself)."""
        self.resumed_epoch: int | None = None
        """The epoch a just-restored position continues, until the loop names its epoch."""
        self.pass_batches = 0
        """Batches handed out by the newest iterator (a loop's break leaves it short of the epoch)."""

    def left_early(self) -> bool:
        """True when the newest pass handed out two batches or more and the loop left it before its end.

        One batch is a look at ``next(iter(loader))``, which takes nothing from the loop.
        """
        return self.pass_batches >= 2 and not self.epoch_done

    def begin_pass(self) -> tuple[int, int]:
        """A new iterator: (epoch, start step) it hands out from.

        A pass left early ends its epoch in a loop that never calls set_epoch
        (torch's loader would shuffle anew); an epoch run out of is followed by
        the next one in such a loop, and by itself again in one that calls
        set_epoch (the loop names the next).
        """
        if self.left_early() and not self.epochs_set:
            self.epoch_done, self.resumed_epoch = True, None
        if self.epoch_done:
            self.epoch += 0 if self.epochs_set else 1
            self.start_step, self.epoch_done = 0, False
        self.pass_batches = 0
        self.step_in_epoch = self.start_step
        return self.epoch, self.start_step

    def handed_out(self) -> None:
        """One more batch reached the loop."""
        self.step_in_epoch += 1
        self.pass_batches += 1

    def ran_out(self) -> None:
        """The loop ran out of the epoch's batches."""
        self.epoch_done, self.start_step, self.resumed_epoch = True, 0, None

    def set_epoch(self, epoch: int) -> bool:
        """The loop names its next epoch; True when that moves the cursor to another epoch (at its step 0).

        The caller checks a just-restored position first (:meth:`mismatch`).
        """
        self.resumed_epoch = None
        self.epochs_set = True
        if epoch == self.epoch:
            return False
        self.epoch, self.start_step, self.step_in_epoch, self.epoch_done = epoch, 0, 0, False
        self.pass_batches = 0
        return True

    def mismatch(self, epoch: int) -> bool:
        """True when ``epoch`` is not the one a just-restored position continues."""
        return self.resumed_epoch is not None and epoch != self.resumed_epoch

    def mismatch_message(self, epoch: int, steps_per_epoch: int) -> str:
        """The one line for a loop whose ``set_epoch(epoch)`` is not the epoch a resume continues."""
        resumed, start = self.resumed_epoch, self.start_step
        assert resumed is not None, "asked about a resumed loader only"
        where = (
            f"in epoch {resumed} at step {start} of {steps_per_epoch}" if start else f"at the start of epoch {resumed}"
        )
        effect = (
            f"epoch {epoch} would be trained again"
            if epoch < resumed
            else f"the rest of epoch {resumed} would be skipped"
        )
        return (
            f"the loader resumed {where} (epochs numbered as the loop passed them to set_epoch), but the "
            f"loop now calls set_epoch({epoch}): {effect}; start the loop at the epoch resume() returns: "
            f"for epoch in range(start.epoch, epochs) (epochs numbered from 1: resume(..., first_epoch=1) "
            f"and range(start.epoch, epochs + 1))"
        )

    def left_early_message(self, steps_per_epoch: int | None) -> str:
        """The warning for a loop that left an epoch early (``steps_per_epoch`` None: a stream's, not known yet)."""
        total = f" of {steps_per_epoch}" if steps_per_epoch is not None else ""
        return (
            f"the loop left epoch {self.epoch} after {self.step_in_epoch}{total} batches (a break in its "
            "batch loop): a run resumed from a checkpoint inside such an epoch is handed the epoch's remaining "
            "batches, while the loop's own count (enumerate) starts at 0 again, so it would train other batches "
            "than an uninterrupted run; to train part of each epoch, give the loader only that part, e.g. "
            "sampler=RandomSampler(dataset, num_samples=N), and let its epochs run out"
        )

    def restore(self, epoch: int, step: int) -> None:
        """Continue at ``step`` of ``epoch`` (a resume): the next iterator starts there."""
        self.epoch, self.start_step, self.step_in_epoch, self.epoch_done = epoch, step, step, False
        self.resumed_epoch = epoch
        self.pass_batches = 0

    def position(self, steps_per_epoch: int, streaming: bool) -> LoaderPosition:
        """The position as a value (``steps_per_epoch``: the loader's, known at a stream's end only)."""
        return LoaderPosition(
            epoch=self.epoch,
            step_in_epoch=self.step_in_epoch,
            steps_per_epoch=steps_per_epoch,
            epoch_done=self.epoch_done,
            start_step=self.start_step,
            resumed_epoch=self.resumed_epoch,
            streaming=streaming,
        )
