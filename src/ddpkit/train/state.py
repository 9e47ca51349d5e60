"""What the trainer counts besides the loader's position: steps, samples and time (and its tracker's run)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Progress counters of a training run, saved with every checkpoint.

    The epoch and the step in it are the DataLoader's (its state is saved too).
    """

    global_step: int = 0
    """Optimizer steps done since the start of training."""
    samples_seen: int = 0
    """Training samples consumed since the start, over all workers."""
    train_time: float = 0.0
    """Seconds spent in training steps (evaluation and saving excluded)."""
    tracker: Any = field(default=None, repr=False, compare=False)
    """The run's ddpkit.Tracker (``logger=``), or None. Its state travels inside this one's, so that a
    checkpoint written with any logger (or before trackers existed) resumes with any other: a run whose
    checkpoint holds no tracked run of the same kind starts a new one."""

    def state_dict(self) -> dict[str, Any]:
        """The counters as a plain dict (and the tracker's state under ``tracker``)."""
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "samples_seen": self.samples_seen,
            "train_time": self.train_time,
        }
        if self.tracker is not None:
            state["tracker"] = self.tracker.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the counters (and the tracker's run) from ``state_dict()``'s output."""
        for key, value in state.items():
            if key != "tracker":
                setattr(self, key, type(getattr(self, key))(value))
        if self.tracker is not None and "tracker" in state:
            self.tracker.load_state_dict(state["tracker"])
