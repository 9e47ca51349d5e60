"""When the Checkpointer saves: a pure function of what it is told.

The schedule is told the global step, the loader's position
(:class:`~ddpkit.data.position.LoaderPosition`, or None without a loader),
the preemption signal and the clock the ranks agreed on, and the options
(``every_steps``, ``on_epoch_end``); it answers whether to save, why, and
whether to exit after it. It does no I/O and calls no collective, so every
rule below is tested without a process (tests/checkpoint/test_schedule.py).

Where a checkpoint is taken, with a loader (``at_boundaries``): ``step()``
only decides; the checkpoint is written at the loop's next step boundary
(when it asks the loader for its next batch, or runs out of them), so it
holds whatever the loop's body did after ``step()``::

    for x, y in loader:          <- boundary: a checkpoint due at the last step is written here
        ...; ckpt.step()         <- decides
    scheduler.step(); evaluate() <- the code after the batch loop
    ckpt.epoch_end(metrics)      <- metrics and the best mark for the epoch's checkpoint
                                 <- next epoch's first boundary (or close()): the epoch's checkpoint,
                                    written once, with that code's effects

The checkpoint of an epoch's last step waits for the code after the batch
loop (a per-epoch scheduler, evaluation, ``epoch_end``) and is written once,
at the next epoch's first boundary or at ``close()``. A preemption agreed at
that step cannot wait: it is written when the batches run out, and a run
resumed from it re-enters the epoch with no batch left, so that the code
after the batch loop runs again.

Without a loader, a save due at ``step()`` is written at once and epochs are
counted by ``epoch_end()``.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.data.position import LoaderPosition

__all__ = ["Save", "SaveSchedule"]


@dataclass(frozen=True)
class Save:
    """A checkpoint to write now (``reason``; "" when this step's is already written) and a signal to exit on."""

    reason: str
    """Why: preempted, epoch_end, every_seconds, every_steps; "" to write nothing (only exit)."""
    signal: int = 0
    """The preemption signal the ranks agreed on (exit once the checkpoint is complete); 0 if none."""


@dataclass
class _Pending:
    """A checkpoint of an epoch's last step, waiting for the code after that epoch's batch loop."""

    global_step: int
    epoch: int
    reason: str


class SaveSchedule:
    """Decides when to save; see the module docstring.

    Args:
        every_steps: save every this many steps (0: off).
        on_epoch_end: save at the end of every epoch.
        at_boundaries: a loader runs the Checkpointer at its step boundaries (save there, not at ``step()``).
    """

    def __init__(self, every_steps: int, on_epoch_end: bool, at_boundaries: bool):
        self.every_steps, self.on_epoch_end, self.at_boundaries = every_steps, on_epoch_end, at_boundaries
        self.saved_step = -1
        """The global step of the newest checkpoint written (or resumed from); -1 before any."""
        self.next_check = 1
        """The first global step at which ``step()`` must consult the schedule again."""
        self._due = Save("")  # due at the next boundary
        self._pending: _Pending | None = None

    def plan(self, global_step: int, agreement_step: int) -> None:
        """Set ``next_check``: the next agreement on signals and clock, or the next ``every_steps`` multiple."""
        due = [agreement_step]
        if self.every_steps:
            due.append((global_step // self.every_steps + 1) * self.every_steps)
        self.next_check = min(due)

    def needs_step_event(self, global_step: int, batches_exhausted: bool) -> bool:
        """True when ``step()`` must decide at this step: an agreement or cadence is due, or an epoch's batches ran
        out (``batches_exhausted``: the loader's, False without one). Otherwise a step costs two compares."""
        return global_step >= self.next_check or (self.on_epoch_end and batches_exhausted)

    @property
    def idle(self) -> bool:
        """True when nothing waits for a boundary (a boundary then needs no position)."""
        return not self._due.reason and self._pending is None

    def _epoch_ended(self, position: LoaderPosition | None) -> bool:
        return self.on_epoch_end and position is not None and position.batches_exhausted

    def on_step(self, global_step: int, position: LoaderPosition | None, signal: int, time_due: bool) -> Save | None:
        """What a step decides: a Save to write now (without a loader), else None (a boundary writes it).

        Args:
            global_step: the step just counted.
            position: the loader's position, or None without one.
            signal: the preemption signal the ranks agreed on at this step (0: none, or no agreement here).
            time_due: the ranks agreed that ``every_seconds`` has passed.
        """
        # Named by its most telling reason: a preemption, an epoch's end, then the cadences.
        due = {
            "preempted": bool(signal),
            "epoch_end": self._epoch_ended(position),
            "every_seconds": time_due,
            "every_steps": bool(self.every_steps) and global_step % self.every_steps == 0,
        }
        reason = next((name for name, is_due in due.items() if is_due), "")
        if not reason:
            return None
        if not self.at_boundaries:
            return Save(reason, signal)
        assert position is not None, "a schedule at boundaries has a loader"
        if position.batches_exhausted and not signal:
            self._pending = _Pending(global_step, position.epoch, reason)
        else:
            self._due = Save(reason, signal)
        return None

    def at_boundary(self, global_step: int, position: LoaderPosition) -> Save | None:
        """What to write at a step boundary of the loop: a due checkpoint, or the epoch's once its code ran."""
        if self._due.reason:
            due, self._due = self._due, Save("")
            return due if global_step != self.saved_step else Save("", due.signal)
        if self._pending is not None and self._epoch_code_ran(global_step, position):
            return Save(self._pending.reason)
        return None

    def _epoch_code_ran(self, global_step: int, position: LoaderPosition) -> bool:
        """True when the pending checkpoint's epoch is over: the loop ran out of it, or the next one began."""
        pending = self._pending
        assert pending is not None, "asked about a pending checkpoint"
        if pending.global_step != global_step:
            return False
        return position.epoch_done or (position.epoch != pending.epoch and position.step_in_epoch == 0)

    def at_close(self, global_step: int) -> Save | None:
        """What the end of training writes: what is due, or the last epoch's checkpoint (its code has run)."""
        if self._due.reason:
            due, self._due = self._due, Save("")
            return due if global_step != self.saved_step else None
        if self._pending is not None and self._pending.global_step == global_step:
            return Save(self._pending.reason)
        return None

    def unsaved(self, global_step: int) -> bool:
        """Steps were taken since the last checkpoint (or since the start, when none was written)."""
        return global_step > max(self.saved_step, 0)

    def pending_at(self, global_step: int) -> bool:
        """True when this step's checkpoint waits for the code after its epoch's batch loop."""
        return self._pending is not None and self._pending.global_step == global_step

    def defer(self, global_step: int, epoch: int, reason: str) -> None:
        """Write a checkpoint of this step at the next boundary where its epoch's code has run (a new best)."""
        self._pending = _Pending(global_step, epoch, reason)

    def saved(self, global_step: int) -> None:
        """A checkpoint of ``global_step`` was written (or resumed from): nothing of that step is due any more."""
        self.saved_step = global_step
        if self._pending is not None and self._pending.global_step <= global_step:
            self._pending = None
        if self._due.reason and not self._due.signal:
            self._due = Save("")

    @property
    def pending_reason(self) -> str:
        """The reason of the checkpoint waiting for its epoch's code ("" when none waits)."""
        return self._pending.reason if self._pending is not None else ""
