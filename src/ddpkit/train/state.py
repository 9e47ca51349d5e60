"""What the trainer counts besides the loader's position: steps, samples and time."""

from __future__ import annotations

from dataclasses import asdict, dataclass


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

    def state_dict(self) -> dict[str, float]:
        """The counters as a plain dict."""
        return asdict(self)

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the counters from ``state_dict()``'s output."""
        for key, value in state.items():
            setattr(self, key, type(getattr(self, key))(value))
