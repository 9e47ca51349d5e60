"""Where a loader stands in its epochs, and the hook it runs between batches: the loader's side of a contract.

Two parts of ddpkit meet at a training loop's step boundary: the loader,
which knows where the loop is in the data, and whoever must act where the
loop's body is complete (the Checkpointer writes its checkpoints there).
This module is that contract, declared once below both, so that neither
reads the other's attributes::

    DataLoader ── position() ───────────> LoaderPosition (a frozen value)
        │
        └── step_boundary.register(hook)   hook() each time the loop asks for its next
                                           batch, and once when the epoch's batches run out

The data layer owns both and imports nothing above it; a user of them needs
only this module (``PositionedLoader``), never the loader's internals.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

__all__ = ["LoaderPosition", "PositionedLoader", "StepBoundary"]


@dataclass(frozen=True)
class LoaderPosition:
    """A loader's position in its epochs, in the loop's own epoch numbering (``set_epoch``)."""

    epoch: int
    """The epoch being (or next to be) iterated."""
    step_in_epoch: int
    """Batches of ``epoch`` handed to the loop so far (counting those a resume skipped)."""
    steps_per_epoch: int
    """Global batches per epoch; for a stream, known once its last batch was handed out (before that,
    ``step_in_epoch + 1``)."""
    epoch_done: bool
    """True once the loop has run out of ``epoch``'s batches: the code after its batch loop may have run."""
    start_step: int = 0
    """The step the epoch's iterators start at: 0, or the step a resume restored."""
    resumed_epoch: int | None = None
    """The epoch a just-restored position continues, until the loop names its epoch (``set_epoch``)."""
    streaming: bool = False
    """True for a loader over an IterableDataset (``steps_per_epoch`` is known at the epoch's end only)."""

    @property
    def batches_exhausted(self) -> bool:
        """True when every batch of ``epoch`` has been handed out (the loop may not have run out yet)."""
        return self.step_in_epoch >= self.steps_per_epoch

    @property
    def resume_point(self) -> tuple[int, int]:
        """(epoch to train next, batches of it done): an epoch the loop ran out of is complete."""
        return (self.epoch + 1, 0) if self.epoch_done else (self.epoch, self.step_in_epoch)


class StepBoundary:
    """The hooks a loader runs at each step boundary of the loop that iterates it.

    A boundary is each time the loop asks for its next batch, and once when
    the epoch's batches run out: the points where the loop's body (whatever it
    does after its optimizer step) is complete. Hooks run in the order they
    were registered, on the loop's thread; one that raises stops the loop
    there (a preemption's exit is raised this way).
    """

    def __init__(self) -> None:
        self.hooks: list[Callable[[], None]] = []
        """The registered hooks, in order (an empty list costs the loop one truth test per batch)."""

    def register(self, hook: Callable[[], None]) -> None:
        """Run ``hook()`` at every step boundary from now on."""
        self.hooks.append(hook)

    def unregister(self, hook: Callable[[], None]) -> None:
        """Stop running ``hook`` (registered before; unregistering twice is harmless)."""
        if hook in self.hooks:
            self.hooks.remove(hook)

    def run(self) -> None:
        """Run every hook (the loader calls this)."""
        for hook in self.hooks:
            hook()


@runtime_checkable
class PositionedLoader(Protocol):
    """A loader that reports its position and runs hooks at step boundaries (``ddpkit.DataLoader`` is one)."""

    step_boundary: StepBoundary

    @property
    def step_in_epoch(self) -> int:
        """``position().step_in_epoch``, read without building the value (a training step reads it)."""
        ...

    @property
    def steps_per_epoch(self) -> int:
        """``position().steps_per_epoch``, read without building the value."""
        ...

    def position(self) -> LoaderPosition:
        """Where the loader stands now."""
        ...

    @property
    def state_dict_is_collective(self) -> bool:
        """True when ``state_dict()`` is a collective (call it on every rank)."""
        ...
