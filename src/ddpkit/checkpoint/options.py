"""The Checkpointer's options, declared once: a dataclass with a docstring per field and one check.

Three readers take them from these lines and nowhere else:

- :class:`ddpkit.Checkpointer`: ``Checkpointer(dir, model=..., every_steps=500, keep=3)`` builds a
  ``CheckpointOptions`` from its keyword arguments, ``Checkpointer(dir, ...,
  options=CheckpointOptions(every_steps=500))`` takes one ready-made;
- ``ddpkit train``: its ``checkpoint.KEY=VALUE`` options are this class extended with the
  trainer's own fields (``ddpkit.train.config.CheckpointConfig``: ``enabled``, ``dir``, ``auto`` for
  the best checkpoint), so the same values are checked by the same code;
- ``ddpkit train --help``: generated from the field docstrings below (``ddpkit.commands.help``).

A bad value is one line naming the option as its user wrote it (``keep=0`` for the
Checkpointer's keyword, ``checkpoint.keep=0`` on the command line: ``key_prefix``) and the fix.
"""

from __future__ import annotations

import dataclasses
import signal
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ddpkit.errors import UserError, check_choice, check_positive
from ddpkit.names import DEFAULT_PREEMPT_SIGNALS

if TYPE_CHECKING:  # no torch at run time: ddpkit train --help reads this module
    from torch import device as torch_device

# The values of two options live here, beside them; the modules that act on them import them from here.
# No torch: ``ddpkit.train.config`` (and so ``ddpkit train --help``) imports this module.
READABLE_BY = {"user": 0o600, "group": 0o640, "all": 0o644}
"""File modes of checkpoint files for each ``readable_by`` value."""
ON_WRITE_ERROR = ("stop", "warn")
"""What a failed checkpoint write does: stop training (exit status 74), or warn and go on."""
CATCHABLE_SIGNALS = tuple(sorted(s.name for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)))
"""Signals a process can handle: what a Checkpointer's ``preempt_signals`` may name (a scheduler may send e.g. SIGXCPU)."""
RESUME_MODES = ("never", "auto")
"""The named resume choices; anything else is the path of one checkpoint."""
_RESUME_WORDS = {"true": "auto", "false": "never"}


def resume_choice(resume: object) -> str:
    """``resume`` as never, auto or a path: True (or "true") means auto, False (or "false") never.

    Scripts pass an argparse ``--resume`` flag (a bool) and config files write
    ``resume: false``; read as a path, either would be "no checkpoint named False".
    """
    text = str(resume)
    return _RESUME_WORDS.get(text.lower(), text)


@dataclasses.dataclass
class CheckpointOptions:
    """When checkpoints are written, how many are kept, who may read them, and what a preemption does."""

    key_prefix: ClassVar[str] = ""
    """How error messages name an option: "" for the Checkpointer's keywords (``keep=0``)."""
    best_modes: ClassVar[tuple[str, ...]] = ("max", "min")
    """Values ``best_mode`` accepts."""
    signal_choices: ClassVar[tuple[str, ...]] = CATCHABLE_SIGNALS
    """Signals ``preempt_signals`` may name."""

    every_steps: int = 0
    """Also write one every this many optimizer steps (0: off)."""
    every_seconds: float = 0.0
    """Also write one when this many seconds have passed since the last (0: off)."""
    on_epoch_end: bool = True
    """Write one at the end of every epoch."""
    keep: int = 2
    """Complete checkpoints kept (the newest ones); older ones are deleted once a newer one is complete."""
    readable_by: str = "user"
    """Who may read checkpoint files: user (mode 0600), group (0640) or all (0644)."""
    best_metric: str = ""
    """Metric (a key of the metrics given to ``epoch_end``) that picks the ``best-*`` checkpoint; empty: none."""
    best_mode: str = "max"
    """max or min of best_metric."""
    preempt_signals: str = ",".join(DEFAULT_PREEMPT_SIGNALS)
    """Comma-separated signals (e.g. SIGTERM,SIGUSR1; USR1 means SIGUSR1) that make every
    worker write a checkpoint at the next step the ranks agree on (within one step, or sync_seconds for faster
    steps) and exit with status 75 (130 for SIGINT: Ctrl-C keeps the work; a second Ctrl-C stops at once);
    empty: none."""
    requeue: bool = False
    """After a preemption checkpoint under Slurm, requeue the job (scontrol requeue $SLURM_JOB_ID)."""
    sync_seconds: float = 0.25
    """Target seconds between the ranks' agreements on preemption and on every_seconds (one tiny all_reduce each):
    a signal is acted on within one step, or this long when steps are shorter."""
    on_write_error: str = "stop"
    """A checkpoint that cannot be written (disk full, quota, read-only or vanished folder): stop (one line,
    exit status 74) or warn (training goes on without it; a preemption checkpoint always stops)."""
    async_save: Literal["auto"] | bool = "auto"
    """Write checkpoints in the background: a save copies the state (into pinned CPU memory, kept for the next
    save) and training goes on while rank 0 writes. auto: when the model is on a GPU (a save then costs the GPU
    only its copy); on the CPU, where writing competes with training for the cores, synchronous; true, false."""

    cache: str = ""
    """For checkpoints in object storage (a dir of s3://...): the local folder they are written into before
    their upload; empty: one per URL under $DDPKIT_CACHE/checkpoints (else ~/.cache/ddpkit/checkpoints)."""

    def __post_init__(self) -> None:
        self.check()

    def resolve_async_save(self, devices: Iterable[torch_device]) -> bool:
        """``async_save`` for a model on ``devices``: "auto" is True when one of them is a GPU."""
        if self.async_save == "auto":
            return any(device.type == "cuda" for device in devices)
        return self.async_save

    def check(self) -> None:
        """Raise UserError, naming the option and the fix in one line, at the first bad value."""
        key = self.key_prefix
        check_positive(f"{key}every_steps", self.every_steps, allow_zero=True)
        check_positive(f"{key}every_seconds", self.every_seconds, allow_zero=True)
        check_positive(f"{key}keep", self.keep)
        check_positive(f"{key}sync_seconds", self.sync_seconds)
        check_choice(f"{key}readable_by", self.readable_by, tuple(READABLE_BY))
        check_choice(f"{key}best_mode", self.best_mode, self.best_modes)
        check_choice(f"{key}on_write_error", self.on_write_error, ON_WRITE_ERROR)
        if not isinstance(self.async_save, bool) and self.async_save != "auto":
            choices = "auto, true, false" if key else "'auto', True, False"  # as the command line or Python writes them
            raise UserError(f"{key}async_save={self.async_save!r} is not valid; choose one of: {choices}")
        for name in self.signal_names():
            check_choice(f"{key}preempt_signals", name, self.signal_choices)

    def signal_names(self) -> tuple[str, ...]:
        """The preemption signals as names, e.g. ("SIGTERM", "SIGUSR1"); USR1 is accepted for SIGUSR1."""
        names = [word.strip().upper() for word in self.preempt_signals.split(",") if word.strip()]
        return tuple(name if name.startswith("SIG") else "SIG" + name for name in names)


def with_keywords(options: CheckpointOptions, values: Mapping[str, Any]) -> CheckpointOptions:
    """``options`` with a Checkpointer's keyword arguments over it, checked (CheckpointOptions.check).

    Raises:
        TypeError: a keyword that is not an option.
        UserError: a bad value, or ddpkit train's word "auto" for the best metric or mode.
    """
    known = [field.name for field in dataclasses.fields(options)]
    for name in values:
        if name not in known:
            raise TypeError(
                f"Checkpointer() got an unexpected keyword argument {name!r}; its options are: {', '.join(known)}"
            )
    signals = values.get("preempt_signals")
    if signals is not None and not isinstance(signals, str):  # ("SIGTERM", "SIGUSR1"), as the keyword was typed
        values = {**values, "preempt_signals": ",".join(signals)}
    options = dataclasses.replace(options, **values) if values else options
    if options.best_metric == "auto" or options.best_mode not in CheckpointOptions.best_modes:
        # ddpkit train's CheckpointConfig, passed as it is: "auto" would be read as a metric's name, or as "min".
        raise UserError(
            f"best_metric={options.best_metric!r}, best_mode={options.best_mode!r}: 'auto' is ddpkit train's "
            "word, resolved for its task by for_run(); pass options=config.checkpoint.for_run('accuracy'), or "
            "name them: best_metric='accuracy', best_mode='max'"
        )
    return options


__all__ = ["CATCHABLE_SIGNALS", "CheckpointOptions", "ON_WRITE_ERROR", "READABLE_BY", "with_keywords"]
