"""Where training is: the counters a checkpoint stores and a resume continues from."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class TrainState:
    """Progress of a training run, in unambiguous units.

    ``completed_epochs`` counts whole epochs done; ``step_in_epoch`` counts the
    global batches done in the current (incomplete) epoch, so the next batch to
    train on is ``step_in_epoch`` of epoch ``completed_epochs``.
    """

    completed_epochs: int = 0
    """Epochs fully trained."""
    step_in_epoch: int = 0
    """Optimizer steps done in the epoch now in progress."""
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
