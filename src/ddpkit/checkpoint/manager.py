"""The Checkpointer: save and resume any training loop's state, exactly.

It is handed explicit objects, anything with ``state_dict()`` and
``load_state_dict()``: the model (a DDP wrapper is unwrapped, so checkpoints
do not depend on the gradient sync or the world size), the optimizer, the LR
scheduler, the grad scaler, the :class:`ddpkit.DataLoader` (its position:
epoch and step in epoch) and any extras of the user's. It never reads a
trainer's attributes and never steps anything::

    ckpt = ddpkit.Checkpointer("runs/mine", model=model, optimizer=opt, scheduler=sched,
                               loader=loader, every_steps=500)
    start = ckpt.resume("auto")            # or "never", or the path of one checkpoint
    for epoch in range(start.epoch, epochs):
        loader.set_epoch(epoch)            # continues mid-epoch after a resume
        for x, y in loader:
            ...                            # forward, backward, optimizer.step(), sched.step()
            ckpt.step()                    # counts the step; saves when due; handles preemption
        ckpt.epoch_end({"accuracy": acc})  # optional: metrics for the best checkpoint
    ckpt.close()                           # the last epoch's checkpoint, with what followed its batch loop

What a checkpoint holds, besides the objects (one ``<name>.pt`` each):
``train.pt`` (global step, completed epochs), ``rng.pt`` (every rank's
Python, NumPy, torch and CUDA generator states), ``config.yaml`` (the run's
config, when given), and ``manifest.json`` (written last: checksums, step,
epoch, metrics, best, world size, versions). The on-disk format and its
crash-safety are in :mod:`ddpkit.checkpoint.format`; which checkpoint a run
resumes from is in :mod:`ddpkit.checkpoint.select`.

With ``async_save=True`` a save copies the state (to pinned CPU memory from a
GPU) and returns; rank 0 writes it in a background thread
(:mod:`ddpkit.checkpoint.async_save`). At most one save is in flight: the
next save, a preemption, ``wait()`` and ``close()`` wait for it.

The options (when, how many, best, preemption, file modes, what a failed
write does) are one dataclass, :class:`ddpkit.checkpoint.options.CheckpointOptions`,
given as ``options=`` or field by field as keyword arguments.

When: every ``every_steps`` steps, every ``every_seconds`` seconds, at the end
of every epoch (``on_epoch_end``: detected from the loader, or at
``epoch_end()``), whenever ``save()`` is called, and on a preemption signal
(:mod:`ddpkit.checkpoint.preemption`: one checkpoint, then ``Preempted``,
a SystemExit with status 75). Per step, ``step()`` costs an integer compare
until something may be due; the clock and the signals are agreed on by one
tiny all_reduce about every ``sync_seconds``.

Where, with a ddpkit.DataLoader: ``step()`` only decides; the checkpoint (and
a preemption's exit) happens when the loop next asks the loader for a batch
(``DataLoader.between_batches``), so it holds what the body did after
``step()``. The checkpoint of an epoch's last step is taken when the loop
runs out of batches and replaced by one of the next epoch's start when that
begins (or at ``close()``), once the code after the batch loop (a per-epoch
scheduler, evaluation) has run. Resumed from the first, the loop re-enters
the epoch with no batch left, and that code runs again. Without a loader,
``step()`` saves at once, epochs are counted by ``epoch_end()``, and a
checkpoint inside an epoch holds only how many of its steps were done
(``ResumePoint.step_in_epoch``, for the loop to skip): rank 0 warns once.

Saving is collective: every rank calls ``step()``/``save()`` at the same
points, rank 0 writes. A save reached by some ranks only is an error naming
the missing ranks once ``timeout`` has passed, never a hang; a save called on
some ranks while the others went on training (``if rank == 0: save()``) is
refused within about a second (:mod:`ddpkit.checkpoint.checkin`).

Exactness: with the same world size a resumed run continues bit for bit
(model, optimizer, scheduler, scaler, every RNG, the loader's position). With
another world size, training continues at the same global batch of the same
sample order (nothing skipped or repeated); per-rank RNG streams and the
all_reduce order differ, so numbers are close but not bit-identical, and a
warning says so.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import re
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from ddpkit.checkpoint import select
from ddpkit.checkpoint.async_save import BackgroundWriter, copy_state
from ddpkit.checkpoint.checkin import LoopProgress, check_in
from ddpkit.checkpoint.format import (
    MANIFEST,
    CheckpointError,
    checkpoint_name,
    library_versions,
    list_checkpoints,
    load_file,
    mark_best,
    prune,
    read_manifest,
    rewrite_manifest,
    write_checkpoint,
)
from ddpkit.checkpoint.options import READABLE_BY, CheckpointOptions, resume_choice
from ddpkit.checkpoint.preemption import (
    Agreement,
    Preempted,
    PreemptionSignals,
    exit_status,
    requeue_slurm_job,
    signal_name,
)
from ddpkit.checkpoint.rng import capture_rng_state, restore_rng_state, seed_everything
from ddpkit.checkpoint.storage import StorageError, checkpoint_bytes, explain_write_error, room_warning
from ddpkit.distributed import control_device
from ddpkit.errors import UserError, check_positive
from ddpkit.log import get_logger

TRAIN_FILE = "train.pt"
RNG_FILE = "rng.pt"
_RESERVED = {"train", "rng", "manifest", "config"}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class ResumePoint:
    """Where a run continues: returned by :meth:`Checkpointer.resume`."""

    epoch: int = 0
    """The epoch to train next, numbered as the loop numbers them (``set_epoch``): the one in progress
    after a mid-epoch checkpoint, or one whose batches are all trained (``step_in_epoch`` equal to
    the loader's ``steps_per_epoch``) so that the code after its batch loop runs again; on a fresh
    start, ``first_epoch``."""
    step_in_epoch: int = 0
    """Batches of ``epoch`` already trained: a ddpkit.DataLoader given as ``loader=`` skips them; without
    one, the loop must (``itertools.islice(loader, start.step_in_epoch, None)``), or they are trained twice."""
    global_step: int = 0
    """Optimizer steps done since the start of training."""
    path: Path | None = None
    """The checkpoint resumed from; None for a fresh start."""
    manifest: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The manifest of that checkpoint (config, metrics, world size...); {} for a fresh start."""

    @property
    def resumed(self) -> bool:
        """True when state was restored from a checkpoint."""
        return self.path is not None


class Checkpointer:
    """Saves and resumes the state of a training loop; see the module docstring.

    Args:
        dir: folder of the checkpoints (every node must see it).
        model: the model (DDP-wrapped or not).
        optimizer: the optimizer.
        scheduler: the LR scheduler.
        scaler: the ``torch.amp.GradScaler``.
        loader: the :class:`ddpkit.DataLoader` (its epoch and step in epoch).
        extra: more objects by name (each with state_dict/load_state_dict).
        options: when to save, how many to keep, best checkpoint, preemption, file modes, background
            writes: a :class:`~ddpkit.checkpoint.options.CheckpointOptions` (default: its defaults).
        config: the run's configuration (JSON-like), stored with every checkpoint.
        meta: more JSON-like facts for the manifest (e.g. what export needs to rebuild the model).
        timeout: seconds a save waits for every rank to reach it (default: 300).
        environ: the process environment (restart counters, SLURM_JOB_ID); os.environ by default.
        **option_values: fields of CheckpointOptions by name, over ``options``: ``every_steps=500``,
            ``keep=3``, ``best_metric="accuracy"``, ``async_save=True``...; ``preempt_signals`` may
            also be a sequence of names (``()``: none). Each is documented, with its default, on its
            field.

    Raises:
        ValueError: an object without state_dict/load_state_dict, a bad name or option.
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        model: nn.Module | None = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        extra: Mapping[str, Any] | None = None,
        options: CheckpointOptions | None = None,
        config: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        environ: Mapping[str, str] | None = None,
        **option_values: Any,
    ) -> None:
        self.options = _with_values(options or CheckpointOptions(), option_values)
        """What, when and how this Checkpointer saves (see :class:`~ddpkit.checkpoint.options.CheckpointOptions`)."""
        check_positive("timeout", timeout)
        self.root = Path(dir)
        self.objects = _collect_objects(model, optimizer, scheduler, scaler, loader, extra or {})
        self.loader = loader
        self.mode, self.timeout = READABLE_BY[self.options.readable_by], timeout
        self.best_value: float | None = None
        self.config = dict(config or {})
        self.meta = dict(meta or {})
        self.environ = dict(os.environ if environ is None else environ)
        self.rank, self.world_size = _rank_and_size()
        needed = checkpoint_bytes(self.root, self.objects, self.world_size) if self.rank == 0 else 0
        if self.rank == 0 and (warning := room_warning(self.root, self.options.keep, needed)):
            get_logger().warning(warning)
        self.global_step = 0
        """Optimizer steps done since the start of training (counted by ``step()``)."""
        self.completed_epochs = 0
        """Epochs done, when no loader tells (counted by ``epoch_end()``)."""
        self._epoch_start_step = 0  # without a loader: the global step of the last epoch_end()
        self._said_no_position = False
        self._said_scheduler = False
        self.last_path: Path | None = None
        """The checkpoint written (or resumed from) last."""
        self.save_seconds = 0.0
        """Seconds spent saving so far (a loop that times training can leave them out)."""
        self.on_save: Callable[[Path, str], None] | None = None
        """Called on rank 0 with (path, reason) after each checkpoint is written."""
        self.continue_hint = "run the same command again to continue (resume('auto') picks it up)"
        """How the user continues after a preemption, for the exit line (``ddpkit train`` sets its own)."""
        self._last_step = -1
        self._resume_checked = False
        self._due, self._due_signal = "", 0
        self._between_epochs: tuple[int, int] | None = None  # (global step, epoch) of a checkpoint taken there
        self._step_metrics: tuple[dict[str, float], bool] = ({}, False)  # of the newest checkpoint's step
        self.signals = PreemptionSignals(self.options.signal_names())
        self.signals.install()
        self.agreement = Agreement(
            self.world_size, self.rank == 0, control_device(), self.options.sync_seconds, self.options.every_seconds
        )
        self._next_check = 0
        self._schedule()
        self._progress: LoopProgress | None = None
        self._writer = BackgroundWriter() if self.options.async_save and self.rank == 0 else None
        self._buffers: list[Any] = []  # the copy's storages, reused by the next save once its write is done
        # With a ddpkit.DataLoader, a due checkpoint is written when the loop asks for its next batch
        # (or runs out of them): the loop's body, whatever it does after step(), is then complete.
        self._deferred = hasattr(loader, "between_batches")
        if self._deferred:
            loader.between_batches = self._between_batches
            if self.world_size > 1:
                restart = self.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
                self._progress = LoopProgress(_default_store(), f"ddpkit/progress/{restart}", self.rank)
                atexit.register(self._progress.stop)

    # -- resuming ----------------------------------------------------------------

    def resume(self, resume: str | os.PathLike[str] | bool = "auto", first_epoch: int = 0) -> ResumePoint:
        """Restore every object from the checkpoint ``resume`` selects (a collective).

        Args:
            resume: "auto" (the newest checkpoint that verifies, else a fresh
                start), "never" (a fresh start; refused if the folder holds
                checkpoints) or the path of one checkpoint; True means "auto"
                and False "never" (an argparse ``--resume`` flag). A restarted
                worker (elastic restart, Slurm requeue) always resumes the newest.
            first_epoch: the number of the first epoch on a fresh start (1 for
                a loop that numbers epochs from 1); a resumed run continues
                with the loader's own numbering.

        Returns:
            Where training continues.

        Raises:
            CheckpointError: the checkpoint is unusable or does not fit the
                objects given (the message names what differs and what to do).
        """
        self._resume_checked = True
        self._say_scheduler_not_held()
        found: dict[str, Any] = {}

        def choose() -> str:
            self._collect_writes()
            path, found["loaded"] = select.choose_checkpoint(
                self.root, resume_choice(resume), select.restart_count(self.environ)
            )
            return str(path) if path else ""

        chosen = self._on_rank_zero(choose)
        path = Path(chosen) if chosen else None
        loaded: dict[str, Any] = {}
        if path is not None:
            if found.get("loaded") is not None:
                loaded = found["loaded"]
            else:  # rank 0 verified the files moments ago; the others read them
                manifest = read_manifest(path)
                loaded = {name: load_file(path / name) for name in self._files(manifest)}
                loaded["manifest"] = manifest
            self._restore(path, loaded, first_epoch)
        self.agreement.start(self.global_step)
        self._schedule()
        if path is None:
            return ResumePoint(epoch=first_epoch, global_step=self.global_step)
        epoch, step = self._position()
        return ResumePoint(epoch, step, self.global_step, path, loaded["manifest"])

    def _files(self, manifest: dict[str, Any]) -> list[str]:
        return [name for name in manifest["files"] if name.endswith(".pt")]

    def _restore(self, path: Path, loaded: dict[str, Any], first_epoch: int) -> None:
        manifest = loaded["manifest"]
        saved = set(manifest.get("objects", []))
        given = set(self.objects)
        if saved != given:
            raise CheckpointError(_mismatch(path, saved, given))
        for name, obj in self.objects.items():
            try:
                obj.load_state_dict(loaded[f"{name}.pt"])
            except (RuntimeError, ValueError, KeyError, TypeError) as e:
                detail = "; ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())
                raise CheckpointError(
                    f"checkpoint {path}: its {name} does not fit this run's {name} ({detail}); resume with the "
                    f"settings it was written with, or start a new run in another folder"
                ) from None
        counters = loaded[TRAIN_FILE]
        self.global_step = int(counters["global_step"])
        self.completed_epochs = int(counters["completed_epochs"])
        self._epoch_start_step = int(counters.get("epoch_start_step", self.global_step))
        self._restore_rng(loaded[RNG_FILE]["ranks"])
        best = manifest.get("best", {})
        if best.get("metric") == self.options.best_metric:
            self.best_value = best.get("value")
        self._last_step, self.last_path = self.global_step, path
        self._step_metrics = (dict(manifest.get("metrics") or {}), False)
        self._between_epochs = self._taken_between_epochs()
        self._log_resume(path, len(loaded[RNG_FILE]["ranks"]), first_epoch)

    def _restore_rng(self, ranks: list[Any]) -> None:
        if self.rank < len(ranks):
            restore_rng_state(ranks[self.rank])
            return
        # A rank the checkpoint did not have: its own stream, distinct from every other rank's.
        seed_everything((self.global_step * 1_000_003 + self.rank * 7919) % 2**63)

    def _log_resume(self, path: Path, saved_world_size: int, first_epoch: int) -> None:
        if self.rank != 0:
            return
        log = get_logger()
        if saved_world_size != self.world_size:
            log.warning(
                f"checkpoint {path.name} was written by {saved_world_size} worker(s) and this run has "
                f"{self.world_size}: training continues at the same global batch of the same sample order "
                "(no sample skipped or repeated), but results are not bit-identical to an uninterrupted run "
                "(per-rank random states and the all_reduce order differ)"
            )
        epoch, step = self._position()
        complete = epoch - first_epoch  # epochs counted, whatever the loop's numbering; the next is complete + 1
        if self.loader is None and step:
            log.warning(
                f"resumed from {path} (global step {self.global_step}: {complete} epoch(s) complete and "
                f"{step} step(s) of the next), without a loader= to continue the data from there: skip "
                f"start.step_in_epoch ({step}) batches of that epoch in the loop, or its first {step} batches "
                "are trained twice; pass loader=ddpkit.DataLoader(...) for an exact resume"
            )
            return
        if self.loader is None or step == 0:
            where = f"{complete} epoch(s) complete"
        elif getattr(self.loader, "streaming", False):  # a stream's length is known at its end only
            where = f"epoch {complete + 1}, step {step}"
        elif step >= self.loader.steps_per_epoch:
            where = f"after the last batch of epoch {complete + 1}: the code after its batch loop runs again"
        else:
            where = f"epoch {complete + 1}, step {step} of {self.loader.steps_per_epoch}"
        log.info(f"resumed from {path} (global step {self.global_step}: {where})")

    def _position(self) -> tuple[int, int]:
        """(epoch to train next, batches of it done), in the loop's numbering: from the loader when there is one."""
        if self.loader is not None:
            # An epoch the loop ran out of is complete, the code after its batch loop included.
            if getattr(self.loader, "epoch_done", False):
                return self.loader.epoch + 1, 0
            return self.loader.epoch, self.loader.step_in_epoch
        return self.completed_epochs, self.global_step - self._epoch_start_step

    # -- the per-step and per-epoch hooks ---------------------------------------------

    def step(self) -> None:
        """Count one optimizer step; save when due; on a preemption signal, save and exit (status 75).

        Call it on every rank after every optimizer step.

        Raises:
            Preempted: a preemption signal reached some rank; the checkpoint is complete.
        """
        self.global_step += 1
        if self.global_step >= self._next_check or self._epoch_ended():
            self._step_event()

    def _epoch_ended(self) -> bool:
        loader = self.loader
        return loader is not None and self.options.on_epoch_end and loader.step_in_epoch >= loader.steps_per_epoch

    def _step_event(self) -> None:
        step, signum, time_due = self.global_step, 0, False
        every = self.options.every_steps
        if step >= self.agreement.next_step:
            signum, time_due = self.agreement.agree(step, self.signals.received)
        # The checkpoint is named by its most telling reason: a preemption, an epoch's end, then the cadences.
        due = {
            "preempted": bool(signum),
            "epoch_end": self._epoch_ended(),
            "every_seconds": time_due,
            "every_steps": bool(every) and step % every == 0,
        }
        reasons = [reason for reason, is_due in due.items() if is_due]
        self._schedule()
        self._due, self._due_signal = (reasons[0] if reasons else ""), signum
        if not self._deferred:
            self._write_due()

    def _between_batches(self) -> None:
        """The loader's hook: the loop asks for its next batch (or ran out); write what is due."""
        if self._progress is not None:
            self._progress.count += 1
        if self._due or self._due_signal:
            self._write_due()
        elif self._between_epochs is not None and self._epoch_code_ran():
            self._write("epoch_end")  # the next epoch begins: the code between the epochs has run

    def _epoch_code_ran(self) -> bool:
        """True when the newest checkpoint was taken between epochs and the code after that epoch's batch
        loop has run since: the loop ran out of batches, or the next epoch has begun."""
        taken, loader = self._between_epochs, self.loader
        if taken is None or taken[0] != self.global_step:
            return False
        return bool(loader.epoch_done or (loader.epoch != taken[1] and loader.step_in_epoch == 0))

    def _taken_between_epochs(self) -> tuple[int, int] | None:
        """(global step, epoch) when the loader has handed out an epoch's last batch but not yet run out.

        A checkpoint taken then makes a resumed loop re-enter that epoch with
        no batch left, so that the code after its batch loop (a per-epoch
        scheduler, evaluation) runs again. It is replaced by one of the next
        epoch's start as soon as that begins, or at ``close()``.
        """
        loader = self.loader
        if loader is None or getattr(loader, "epoch_done", True) or loader.step_in_epoch < loader.steps_per_epoch:
            return None
        return self.global_step, loader.epoch

    def _write_due(self) -> None:
        reason, signum = self._due, self._due_signal
        self._due, self._due_signal = "", 0
        if reason and not (self.global_step == self._last_step and self.last_path is not None):
            self._write(reason)
        if signum:
            self._exit_preempted(signum)

    def epoch_end(self, metrics: Mapping[str, float] | None = None) -> Path | None:
        """Mark the end of an epoch (after its evaluation): save as due and keep the best.

        With a loader, the epoch-end checkpoint was already written by the
        epoch's last ``step()``; this adds the metrics to it (and makes it
        ``best-*`` if it improves ``best_metric``). Without a loader it counts
        the epoch and saves, replacing a checkpoint of this step (taken by
        ``step()``, it holds the epoch as not yet complete).

        Returns:
            The checkpoint of this point, or None when none is due.
        """
        if self.loader is None:
            self.completed_epochs += 1
            self._epoch_start_step = self.global_step
        improved = self._improves(metrics or {})
        saved_here = self._last_step == self.global_step and self.last_path is not None
        if self.loader is not None and saved_here:
            self._on_rank_zero(lambda: self._annotate(dict(metrics or {}), improved))
            self._step_metrics = (dict(metrics or {}), improved or self._step_metrics[1])
            return self.last_path
        if self.options.on_epoch_end or improved or saved_here:
            return self._write("epoch_end", metrics, best=improved)
        return None

    def _improves(self, metrics: Mapping[str, float]) -> bool:
        metric = self.options.best_metric
        if not metric or metric not in metrics:
            return False
        value = float(metrics[metric])
        best = self.best_value
        if best is None or (value > best if self.options.best_mode == "max" else value < best):
            self.best_value = value
            return True
        return False

    def _annotate(self, metrics: dict[str, float], best: bool) -> None:
        """Rank 0: add metrics (and the best value) to the manifest of the checkpoint just written.

        With ``async_save`` this follows the write in flight in the background.
        """
        path, updates, mode = self.last_path, {"metrics": metrics, "best": self._best_info()}, self.mode
        assert path is not None

        def annotate() -> None:
            rewrite_manifest(path, updates, mode)
            if best:
                mark_best(self.root, path, mode)

        if self._writer is not None:
            self._collect_writes(wait=False)
            self._writer.submit(annotate)
        else:
            annotate()

    def _schedule(self) -> None:
        due = [self.agreement.next_step]
        every = self.options.every_steps
        if every:
            due.append((self.global_step // every + 1) * every)
        self._next_check = min(due)

    def _exit_preempted(self, signum: int) -> None:
        self.wait()  # the preemption's checkpoint is complete before the process says so and exits
        name = signal_name(signum)
        if self.rank == 0:
            log = get_logger()
            what = "interrupted (Ctrl-C)" if name == "SIGINT" else f"preempted by {name}"
            log.warning(
                f"{what} after global step {self.global_step}: checkpoint {self.last_path} is complete; "
                f"exiting with status {exit_status(name)}; {self.continue_hint}"
            )
            if self.options.requeue:
                log.warning(requeue_slurm_job(self.environ))
        self.close()
        raise Preempted(name, str(self.last_path))

    # -- saving ----------------------------------------------------------------------

    def save(
        self, reason: str = "manual", metrics: Mapping[str, float] | None = None, best: bool = False
    ) -> Path | None:
        """Write a checkpoint of the current state (a collective: every rank calls it; rank 0 writes).

        A checkpoint already written at this global step (an epoch end, a
        cadence) is replaced, so a save after the code that follows the
        batch loop (a per-epoch scheduler) holds that code's effect.

        Args:
            reason: why, kept in the manifest (every_steps, epoch_end, preempted, ...).
            metrics: metrics of this point, kept in the manifest.
            best: make it the ``best-*`` checkpoint (``epoch_end`` decides this from ``best_metric``).

        Returns:
            The checkpoint folder, complete on disk when this returns (on every rank); with
            ``async_save``, once ``wait()`` or the next save returns. None when it could not be
            written and ``on_write_error`` is "warn".

        Raises:
            CheckpointError: some rank did not reach this save within ``timeout``
                (the message names it), a rank went on past it (a save under
                ``if rank == 0``), or rank 0 could not write (StorageError: it says why).
        """
        self._due = ""
        return self._write(reason, metrics, best)

    def _write(self, reason: str, metrics: Mapping[str, float] | None = None, best: bool = False) -> Path | None:
        start = time.perf_counter()
        self._say_no_position()
        self._say_scheduler_not_held()
        if self.global_step == self._last_step and metrics is None:
            # Replacing this step's checkpoint: it keeps the metrics (and the best mark) the step was given.
            metrics, best = self._step_metrics[0], best or self._step_metrics[1]
        self._check_in()
        # An object whose state_dict() is a collective (a stream's loader gathers every rank's position)
        # is asked on every rank; rank 0 writes what it returned.
        collective = {
            name: obj.state_dict()
            for name, obj in self.objects.items()
            if getattr(obj, "state_dict_is_collective", False)
        }
        rng = capture_rng_state()
        gathered: list[Any] | None = [rng]
        if self.world_size > 1:
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(rng, gathered, dst=0)
        path: Path | None = self._on_rank_zero(
            lambda: self._write_on_rank_zero(reason, gathered, dict(metrics or {}), best, collective)
        )
        if path is None:  # not written, and the user chose to go on (on_write_error="warn")
            return None
        self.last_path, self._last_step = path, self.global_step
        self._step_metrics = (dict(metrics or {}), best)
        self._between_epochs = self._taken_between_epochs()
        self.agreement.last_save = time.monotonic()
        self.save_seconds += time.perf_counter() - start
        return path

    def _say_scheduler_not_held(self) -> None:
        """Rank 0, once: an optimizer held has an LR scheduler that is not (a resume restarts its schedule)."""
        if self._said_scheduler or self.rank != 0:
            return
        self._said_scheduler = True
        held = {id(obj.optimizer) for obj in self.objects.values() if isinstance(obj, LRScheduler)}
        for name, obj in self.objects.items():
            # An LRScheduler sets initial_lr in its optimizer's param groups: the optimizer has one.
            if isinstance(obj, Optimizer) and id(obj) not in held and any("initial_lr" in g for g in obj.param_groups):
                get_logger().warning(
                    f"{name} has an LR scheduler that this Checkpointer does not hold (its param groups carry "
                    "initial_lr): a resumed run would start the schedule again from its first step; pass it as "
                    "scheduler=... (or in extra={...})"
                )
                return

    def _say_no_position(self) -> None:
        """Rank 0, once: a checkpoint inside an epoch without a loader cannot hold where the data is."""
        if self.loader is not None or self._said_no_position or self.rank != 0:
            return
        epoch, step = self._position()
        if not step:
            return
        self._said_no_position = True
        get_logger().warning(
            f"checkpoint of global step {self.global_step} is {step} step(s) into epoch {epoch} (epochs are "
            "counted by epoch_end() calls), and this Checkpointer has no loader= to hold the position in the "
            "data: a run resumed from it starts that epoch again at its first batch, training those batches "
            "twice, unless the loop skips ResumePoint.step_in_epoch batches; pass loader=ddpkit.DataLoader(...) "
            "for an exact resume"
        )

    def _write_on_rank_zero(
        self,
        reason: str,
        rng_states: list[Any] | None,
        metrics: dict[str, float],
        best: bool,
        collective: dict[str, Any],
    ) -> Path | None:
        """Rank 0: write the checkpoint folder, mark best, prune."""
        self._collect_writes()  # at most one save in flight
        if not self._resume_checked:
            self._resume_checked = True
            select.check_resume(self.root, "never")
        epoch, step = self._position()
        objects = {
            f"{name}.pt": collective[name] if name in collective else obj.state_dict()
            for name, obj in self.objects.items()
        }
        objects[TRAIN_FILE] = {
            "global_step": self.global_step,
            "completed_epochs": self.completed_epochs,
            "epoch_start_step": self._epoch_start_step,
        }
        objects[RNG_FILE] = {"world_size": self.world_size, "ranks": rng_states}
        meta = {
            **self.meta,
            "reason": reason,
            "global_step": self.global_step,
            "completed_epochs": epoch,
            "step_in_epoch": step,
            "steps_per_epoch": getattr(self.loader, "steps_per_epoch", None),
            "world_size": self.world_size,
            "objects": sorted(self.objects),
            "metrics": metrics,
            "best": self._best_info(),
            "versions": library_versions(),
            "config": self.config,
        }
        texts = {"config.yaml": _yaml(self.config)} if self.config else {}
        # Off the training path when async: copies the loop may change at once; either way CUDA tensors
        # are on the CPU, so that both modes write the same bytes.
        background = self._writer is not None
        objects = copy_state(
            objects, copy_cpu=background, pin_memory=True, buffers=self._buffers if background else None
        )
        note = (
            f", best {self.options.best_metric} {self.best_value:.4f}" if best and self.best_value is not None else ""
        )
        if self.global_step == self._last_step and self.last_path is not None:
            # E.g. an epoch's end, again once the code after its batch loop ran: say so, or it reads as a double save.
            note += "; replaces this step's earlier checkpoint with the state as it is now"
        name = checkpoint_name(self.global_step)

        def write() -> Path | None:
            return self._write_files(name, objects, texts, meta, best, reason, f"{reason}{note}")

        if self._writer is None:
            path = write()
            self._saved(path, reason)
            return path
        self._writer.submit(write, on_done=lambda path: self._saved(path, reason))
        return self.root / name

    def _write_files(
        self,
        name: str,
        objects: dict[str, Any],
        texts: dict[str, str],
        meta: dict[str, Any],
        best: bool,
        reason: str,
        why: str,
    ) -> Path | None:
        """Rank 0 (on the writer's thread when async): the checkpoint folder, the best mark, pruning."""
        try:
            path = write_checkpoint(self.root, name, objects, texts, meta, self.mode)
        except OSError as e:
            self._write_failed(name, reason, e)  # a warning (on_write_error="warn"), or it raises
            return None
        if best:
            mark_best(self.root, path, self.mode)
        prune(self.root, self.options.keep, protect=path)
        get_logger().info(f"checkpoint {path} ({why})")
        return path

    def _saved(self, path: Path | None, reason: str) -> None:
        if self.on_save is not None and path is not None:
            self.on_save(path, reason)

    def _collect_writes(self, wait: bool = True) -> None:
        """Rank 0: hand back finished background writes (``on_save``; a failed write's error)."""
        if self._writer is not None:
            self._writer.collect(wait)

    def wait(self) -> Path | None:
        """Wait until the checkpoint in flight (``async_save``) is complete on disk (a collective).

        Returns:
            The newest checkpoint (``last_path``).

        Raises:
            CheckpointError: the background write failed (the message says why).
        """
        if self.options.async_save:
            self._on_rank_zero(self._collect_writes)
        return self.last_path

    def _write_failed(self, name: str, reason: str, error: OSError) -> None:
        """Rank 0, after a failed write (the incomplete folder is gone): warn and go on, or raise StorageError."""
        needed = checkpoint_bytes(self.root, self.objects, self.world_size)
        message = explain_write_error(self.root, name, error, needed)
        if self.options.on_write_error == "warn" and reason != "preempted":
            get_logger().warning(f"{message} (training goes on: on_write_error=warn)")
            return None
        raise StorageError(message) from None

    def _best_info(self) -> dict[str, Any]:
        return {"metric": self.options.best_metric, "mode": self.options.best_mode, "value": self.best_value}

    def _check_in(self) -> None:
        """Every rank announces this save; fail, naming the ranks, if some went on or do not arrive in time."""
        global _SAVES
        if self.world_size == 1:
            return
        _SAVES += 1
        restart = self.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        check_in(
            _default_store(),
            f"ddpkit/save/{restart}/{_SAVES}",
            self.rank,
            self.world_size,
            self.global_step,
            self.timeout,
            self._progress,
            lambda: bool(self.signals.received),
        )

    def _write_at_close(self) -> None:
        if self._due:
            self._write_due()
        elif self._epoch_code_ran():
            self._write("epoch_end")  # the last epoch's checkpoint, with the code after its batch loop done

    def _on_rank_zero(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on rank 0 and share its result, or its CheckpointError, with every rank."""
        box: list[Any] = [None, None]
        if self.rank == 0:
            try:
                box[0] = fn()
            except CheckpointError as e:
                box[1] = (type(e), str(e))  # the class too: a StorageError has its own exit status
        if self.world_size > 1:
            dist.broadcast_object_list(box, src=0)
        if box[1]:
            raise box[1][0](box[1][1])
        return box[0]

    def close(self) -> None:
        """Write what is due, then restore the signal handlers that were there before (safe to call twice).

        Call it on every rank when training ends: the checkpoint of the last
        epoch then holds what the loop did after its batch loop, and a write
        in flight (``async_save``) is complete. While an exception unwinds,
        nothing new is written (the other ranks may be gone), but a write in
        flight is completed.
        """
        try:
            if sys.exc_info()[0] is None:
                self._write_at_close()
                self.wait()
            elif self._writer is not None:
                self._writer.join()  # the checkpoint in flight completes; nothing new is written
        finally:
            self._buffers = []  # the copy's memory goes back
            if self._progress is not None:
                self._progress.stop()
            if self._deferred and self.loader.between_batches == self._between_batches:
                self.loader.between_batches = None
            self.signals.close()


_SAVES = 0
"""Saves started by this process: the ranks' check-in keys in the store (ranks count alike)."""


def _collect_objects(
    model: Any, optimizer: Any, scheduler: Any, scaler: Any, loader: Any, extra: Mapping[str, Any]
) -> dict[str, Any]:
    named = {
        "model": _unwrap(model),
        "optimizer": optimizer,
        "scheduler": scheduler,
        "scaler": scaler,
        "loader": loader,
    }
    objects = {name: obj for name, obj in named.items() if obj is not None}
    for name, obj in extra.items():
        if not _NAME.match(name) or name in _RESERVED or name in named:
            raise UserError(
                f"extra object name {name!r} is not usable; use an identifier other than "
                f"{', '.join(sorted(_RESERVED | set(named)))}"
            )
        objects[name] = obj
    for name, obj in objects.items():
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise UserError(
                f"Checkpointer: {name}={type(obj).__name__} has no state_dict()/load_state_dict(); "
                "pass objects with both (a model, optimizer, scheduler, ...) or wrap it in one that has"
            )
    return objects


def _unwrap(model: Any) -> Any:
    # Save the plain module's state_dict, without DDP's "module." or torch.compile's "_orig_mod." prefixes.
    from ddpkit.prepare import unwrap_model

    return unwrap_model(model) if isinstance(model, nn.Module) else model


def _default_store() -> Any:
    return dist.distributed_c10d._get_default_store()


def _with_values(options: CheckpointOptions, values: Mapping[str, Any]) -> CheckpointOptions:
    """``options`` with the Checkpointer's keyword arguments over it, checked (CheckpointOptions.check)."""
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


def _rank_and_size() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _mismatch(path: Path, saved: set[str], given: set[str]) -> str:
    parts = []
    if saved - given:
        parts.append(f"it holds {', '.join(sorted(saved - given))} that this run does not pass")
    if given - saved:
        parts.append(f"this run passes {', '.join(sorted(given - saved))} that it does not hold")
    return (
        f"checkpoint {path} does not match the objects given to the Checkpointer ({'; '.join(parts)}); "
        "pass the same objects it was written with, or start a new run in another folder"
    )


def _yaml(config: Mapping[str, Any]) -> str:
    import yaml

    text: str = yaml.safe_dump(dict(config), sort_keys=False)
    return text


__all__ = ["Checkpointer", "CheckpointOptions", "ResumePoint", "CheckpointError", "MANIFEST", "list_checkpoints"]
