"""The Checkpointer: save and resume any training loop's state, exactly; a facade over the parts of
:mod:`ddpkit.checkpoint.manager` (its docstring is the manual).
"""

from __future__ import annotations

import atexit
import os
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.disk.folder_lock import FolderLock
from ddpkit.checkpoint.manager import select
from ddpkit.checkpoint.manager.advice import SaidOnce, say_if_unwritten, unskipped_batches
from ddpkit.checkpoint.manager.best import BestMetric
from ddpkit.checkpoint.manager.epochs import EpochCounter
from ddpkit.checkpoint.manager.metrics import CheckpointMetrics
from ddpkit.checkpoint.manager.preemption import Agreement, Preempted, PreemptionSignals, say_preempted, signal_name
from ddpkit.checkpoint.manager.restore import ResumePoint, choose_and_load, epoch_length, restore_checkpoint
from ddpkit.checkpoint.manager.saving import claim_folder, saving_parts
from ddpkit.checkpoint.manager.schedule import Save, SaveSchedule
from ddpkit.checkpoint.objects import collect_objects, model_devices
from ddpkit.checkpoint.options import CheckpointOptions, resume_choice, with_keywords
from ddpkit.checkpoint.ranks import default_store, on_rank_zero, rank_and_size
from ddpkit.checkpoint.remote.staging import checkpoint_root, shown_as_url, stage_checkpoint
from ddpkit.data.position import LoaderPosition, PositionedLoader
from ddpkit.distributed import control_device
from ddpkit.errors import UserError, check_positive


class Checkpointer:
    """Saves and resumes the state of a training loop; see :mod:`ddpkit.checkpoint.manager`.

    Args:
        dir: folder of the checkpoints (every node must see it), or a URL (``s3://bucket/prefix/run``: staged
            locally and uploaded in the background, :mod:`ddpkit.checkpoint.remote`).
        model: the model (DDP-wrapped or not).
        optimizer: the optimizer.
        scheduler: the LR scheduler.
        scaler: the ``torch.amp.GradScaler``.
        loader: the :class:`ddpkit.DataLoader` (its epoch and step in epoch, saved and restored), or a torch
            DataLoader (its length counts the epochs when ``epoch_end()`` does not; ``enumerate()`` skips the
            batches a resumed epoch trained already).
        extra: more objects by name: each with state_dict/load_state_dict, or a dict of plain values
            (restored in place). Saved from rank 0 and restored on every rank: the same on every rank,
            or rank 0's is the one that counts (a timer).
        per_rank: objects (or dicts) whose state differs between ranks (a prefetched batch, a per-rank
            buffer): every rank's state is saved, and each rank gets its own back.
        options: when to save, how many to keep, best checkpoint, preemption, file modes, background
            writes: a :class:`~ddpkit.checkpoint.options.CheckpointOptions` (default: its defaults).
        config: the run's configuration (JSON-like), stored with every checkpoint.
        meta: more JSON-like facts for the manifest (e.g. what export needs to rebuild the model).
        timeout: seconds a save waits for every rank to reach it (default: 300).
        environ: the process environment (restart counters, SLURM_JOB_ID); os.environ by default.
        continue_hint: how the user continues after a preemption, for its exit line (``ddpkit train`` says
            its own).
        **option_values: fields of CheckpointOptions by name, over ``options``: ``every_steps=500``,
            ``keep=3``, ``best_metric="accuracy"``, ``async_save=True``...; ``preempt_signals`` may
            also be a sequence of names (``()``: none). Each is documented, with its default, on its
            field.

    Nothing happens outside the object until :meth:`start`, which ``resume()``,
    ``step()``, ``save()``, ``epoch_end()`` and ``close()`` call on first use.

    Raises:
        ValueError: an object without state_dict/load_state_dict, a bad name or option, a ``dir`` that is a
            file, or a launcher's WORLD_SIZE above 1 without a process group (``ddpkit.init()`` comes first).
    """

    def __init__(
        self,
        dir: str | os.PathLike[str],
        *,
        model: Any = None,
        optimizer: Any = None,
        scheduler: Any = None,
        scaler: Any = None,
        loader: Any = None,
        extra: Mapping[str, Any] | None = None,
        per_rank: Mapping[str, Any] | None = None,
        options: CheckpointOptions | None = None,
        config: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
        timeout: float = 300.0,
        environ: Mapping[str, str] | None = None,
        continue_hint: str = "run the same command again to continue (resume('auto') picks it up)",
        **option_values: Any,
    ) -> None:
        self.options = with_keywords(options or CheckpointOptions(), option_values)
        """What, when and how this Checkpointer saves (see :class:`~ddpkit.checkpoint.options.CheckpointOptions`)."""
        check_positive("timeout", timeout)
        self.environ = dict(os.environ if environ is None else environ)
        self.root, self.remote = checkpoint_root(dir, self.options.cache, self.environ)
        """The checkpoints folder (for a URL, the local folder they are staged in), and the remote folder or None."""
        self._shown = shown_as_url(self.remote, self.root)  # a staged copy is named by its URL in every line
        if self.root.exists() and not self.root.is_dir():  # else found at the first save, an epoch later
            raise UserError(f"checkpoint folder {self.root} is a file; pass the path of a folder (or of a new one)")
        self.rank, self.world_size = rank_and_size(self.environ)
        self.loader: PositionedLoader | None = loader if isinstance(loader, PositionedLoader) else None
        """The ddpkit.DataLoader whose position and step boundaries the checkpoints follow (None without one)."""
        self.epochs = EpochCounter(self.loader, epoch_length(loader) if self.loader is None else None)
        """The loop's epochs (:class:`~ddpkit.checkpoint.manager.epochs.EpochCounter`)."""
        if self.epochs.steps_per_epoch is not None:
            loader = None  # a torch DataLoader holds no state: its position is counted by the steps
        self.objects = collect_objects(model, optimizer, scheduler, scaler, loader, extra or {}, per_rank or {})
        self.per_rank = sorted(per_rank or {})
        """The names of the objects saved for every rank (``per_rank=``)."""
        self.global_step = 0
        """Optimizer steps done since the start of training (counted by ``step()``)."""
        self.last_path: Path | None = None
        """The checkpoint written (or resumed from) last; for a URL, its staged copy (``remote.url_of(name)``)."""
        self.save_seconds = 0.0
        """Seconds spent saving so far (a loop that times training can leave them out)."""
        self._on_save: Callable[[Path, str], None] | None = None  # see set_on_save()
        self.continue_hint = continue_hint
        """How the user continues after a preemption, for the exit line."""
        self.schedule = SaveSchedule(self.options.every_steps, self.options.on_epoch_end, self.loader is not None)
        """When to save (:class:`~ddpkit.checkpoint.manager.schedule.SaveSchedule`)."""
        self.signals = PreemptionSignals(self.options.signal_names())
        self.agreement = Agreement(
            self.world_size, self.rank == 0, control_device(), self.options.sync_seconds, self.options.every_seconds
        )
        self.async_save = self.options.resolve_async_save(model_devices(self.objects))
        """True when saves are written in the background (the option resolved: "auto" is True for a GPU model)."""
        self._write_failed = False  # a save raised (a full disk, a rank missing)
        self.finished = False
        """True when the checkpoint resumed from was written by a run that finished (``close()`` after it)."""
        self._told = SaidOnce(self.rank)  # the once-only warnings
        self.metrics = CheckpointMetrics(BestMetric(self.options.best_metric, self.options.best_mode), self._told)
        """The metrics each checkpoint carries, and the best so far (``metrics.best``)."""
        self._saving = saving_parts(
            self.root,
            self.objects,
            self.per_rank,
            sorted(extra or {}),
            self.options,
            self.rank,
            self.world_size,
            self.async_save,
            timeout,
            self.environ.get("TORCHELASTIC_RESTART_COUNT", "0"),
            dict(config or {}),
            dict(meta or {}),
            self._saved,
            self.remote,
        )
        # Rank 0's writer (None on the other ranks), a sharded model's state, every rank's check-ins at a save:
        self.writer, self.shards, self.check_ins = self._saving.writer, self._saving.shards, self._saving.check_ins
        self._started = self._preempted = self._closed = False
        self._lock: FolderLock | None = None
        self.schedule.plan(self.global_step, self.agreement.next_step)

    def start(self) -> None:
        """Begin: install the preemption signal handlers, follow the loader's step boundaries, check the room.

        The one place where the Checkpointer acts outside itself; ``resume()``,
        ``step()``, ``save()`` and ``epoch_end()`` call it on first use (call it
        earlier to handle signals from then on). ``close()`` undoes it.
        """
        if self._started:
            return
        self._started = True
        if self.rank == 0:  # the room, and the folder's lock: a second run into it stops here
            restarted = select.restart_count(self.environ) > 0
            self._lock = claim_folder(self.root, self.objects, self.world_size, self.options, restarted, self.writer)
        self.signals.install()
        if self.loader is not None:
            # A due checkpoint is written when the loop asks for its next batch (or runs out of them):
            # the loop's body, whatever it does after step(), is then complete.
            self.loader.step_boundary.register(self._at_boundary)
            if progress := self.check_ins.follow_loop(default_store):
                atexit.register(progress.stop)
        atexit.register(say_if_unwritten, weakref.ref(self))

    # -- resuming ----------------------------------------------------------------

    def resume(self, resume: str | os.PathLike[str] | bool = "auto", first_epoch: int = 0) -> ResumePoint:
        """Restore every object from the checkpoint ``resume`` selects (a collective).

        Args:
            resume: "auto" (the newest checkpoint that verifies, else a fresh
                start), "never" (a fresh start; refused if the folder holds
                checkpoints) or the path (or URL) of one checkpoint; True means "auto"
                and False "never" (an argparse ``--resume`` flag). A restarted
                worker (elastic restart, Slurm requeue) always resumes the newest.
            first_epoch: the number of the first epoch on a fresh start (1 for
                a loop that numbers epochs from 1); a resumed run continues
                with the loader's own numbering.

        Returns:
            Where training continues. Its epoch and ``step_in_epoch`` come from the ddpkit.DataLoader's
            position, else from the ``epoch_end()`` calls, else from a torch DataLoader's length (``loader=``);
            a loop with none of them has no epochs: ``step_in_epoch`` is then the global step (the resume
            line says so).

        Raises:
            CheckpointError: the checkpoint is unusable or does not fit the
                objects given (the message names what differs and what to do).
        """
        self.start()
        self._saving.folder_checked()
        self.epochs.first_epoch = first_epoch
        self._told.scheduler_not_held(self.objects)
        path, loaded = choose_and_load(
            self.root,
            resume_choice(resume),
            select.restart_count(self.environ),
            before=self._saving.before_choosing,
            stage=lambda path: stage_checkpoint(self.remote, self.root, path),
            shown=self._shown,
            rank=self.rank,
            world_size=self.world_size,
        )
        if path is not None:
            restored = restore_checkpoint(
                path, loaded, self.objects, self.per_rank, self.shards, self.rank, self.world_size
            )
            self.global_step, self.finished, self.last_path = restored.global_step, restored.finished, path
            self.epochs.restore(restored)
            self.metrics.best.restore(restored.best)
            self.schedule.saved(self.global_step)
            self.metrics.written((restored.metrics, False))
            if self.rank == 0:
                self.epochs.log_resume(self._shown(path), restored, self.world_size)
        self.agreement.start(self.global_step)
        self.schedule.plan(self.global_step, self.agreement.next_step)
        if path is None:
            return ResumePoint(epoch=first_epoch, global_step=self.global_step)
        epoch, step = self.epochs.resumed(self.global_step)
        return ResumePoint(epoch, step, self.global_step, path, loaded["manifest"], self.finished)

    def enumerate(self, batches: Iterable[Any]) -> Iterator[tuple[int, Any]]:
        """``enumerate(batches)`` counting the batches of the epoch: after a resume, from where it continues.

        ``for i, batch in ckpt.enumerate(loader):`` gives ``i``, the batch's index in its epoch
        (``step_in_epoch``), in a resumed run as in an uninterrupted one, so that ``if i % 100 == 0`` runs
        at the same batches. The first pass after a mid-epoch resume continues the epoch: a torch DataLoader
        (or any iterable) skips the batches trained already, reading them with every generator put back
        afterwards; the ddpkit.DataLoader given as ``loader=`` skips them itself. Every later pass counts
        from 0. Use it for the training loader only (an evaluation loop's ``enumerate`` is its own).

        Args:
            batches: the loader the loop iterates.

        Returns:
            An iterator of (step_in_epoch, batch).
        """
        return self.epochs.enumerate(batches)

    # -- the per-step and per-epoch hooks ---------------------------------------------

    def step(self) -> None:
        """Count one optimizer step; save when due; on a preemption signal, save and exit (status 75).

        Call it on every rank after every optimizer step.

        Raises:
            Preempted: a preemption signal reached some rank; the checkpoint is complete.
        """
        self.global_step += 1
        if (at_resume := self.epochs.unskipped()) is not None:  # resumed mid-epoch, enumerate() unused
            self._told.say("unskipped", unskipped_batches(*at_resume))
        loader = self.loader
        # The per-step path of every loop: two compares, no position built until something may be due.
        exhausted = loader is not None and loader.step_in_epoch >= loader.steps_per_epoch
        if self.schedule.needs_step_event(self.global_step, exhausted):
            self._step_event(loader.position() if loader is not None else None)

    def _step_event(self, position: LoaderPosition | None) -> None:
        if not self._started:
            self.start()
        step, signum, time_due = self.global_step, 0, False
        if step >= self.agreement.next_step:
            signum, time_due = self.agreement.agree(step, self.signals.received)
        save = self.schedule.on_step(step, position, signum, time_due)
        self.schedule.plan(step, self.agreement.next_step)
        if save is not None:
            self._carry_out(save)

    def _at_boundary(self) -> None:
        """The loader's step-boundary hook: write what is due."""
        self.check_ins.count_loop_point()
        assert self.loader is not None, "registered with a loader only"
        if self.schedule.idle:  # the common case: nothing due, no position needed
            return
        save = self.schedule.at_boundary(self.global_step, self.loader.position())
        if save is not None:
            self._carry_out(save)

    def _carry_out(self, save: Save) -> None:
        """Write what the schedule decided (unless this step's checkpoint is written already); exit on a signal."""
        if save.reason and self.global_step != self.schedule.saved_step:
            self._save_pending_or(save.reason)
        if save.signal:
            self._exit_preempted(save.signal)

    def _save_pending_or(self, reason: str) -> None:
        """Write this step's checkpoint, with the metrics and best mark ``epoch_end()`` gave it when it waited."""
        self._write(reason, *self.metrics.take_pending(self.schedule.pending_at(self.global_step), reason))

    def epoch_end(self, metrics: Mapping[str, float] | None = None) -> Path | None:
        """Mark the end of an epoch (after its evaluation): save as due and keep the best.

        With a loader, the checkpoint of the epoch's last step is written once
        the code after its batch loop has run (when the next epoch begins, or at
        ``close()``); this gives it ``metrics`` (and makes it ``best-*`` if it
        improves ``best_metric``). A checkpoint of this step written already
        (``save()``) gets them in its manifest. Without a loader it counts the
        epoch and saves, replacing a checkpoint of this step (taken by
        ``step()``, it holds the epoch as not yet complete).

        Returns:
            The checkpoint of this point when it is written by this call, else None.
        """
        self.start()
        self.epochs.end_epoch(self.global_step)
        if self.epochs.holds_no_position():
            # A checkpoint inside an epoch before this first epoch_end() holds no data position: said once.
            self._say_no_position()
        values, improved = self.metrics.given(metrics)
        saved_here = self.schedule.saved_step == self.global_step and self.last_path is not None
        if self.loader is not None and saved_here:
            self._on_rank_zero(lambda: self._annotate({"metrics": values, "best": self.metrics.best.info()}, improved))
            self.metrics.add_to_written(values, improved)
            return None
        if self.loader is not None:
            # Written at the next boundary, once the code after this call has run too (a scheduler's step).
            if self.schedule.pending_at(self.global_step) or improved or self.options.on_epoch_end:
                reason = self.schedule.pending_reason or "epoch_end"
                self.schedule.defer(self.global_step, self.loader.position().epoch, reason)
                self.metrics.wait_for_checkpoint(values, improved)
            return None
        if self.options.on_epoch_end or improved or saved_here:
            return self._write("epoch_end", values, best=improved)
        return None

    def _annotate(self, updates: dict[str, Any], best: bool = False) -> None:
        """Rank 0: add facts (metrics, the best value, finished) to the manifest of the checkpoint written last."""
        assert self.writer is not None and self.last_path is not None, "rank 0, after a checkpoint"
        self.writer.annotate(self.last_path, updates, best)

    def _exit_preempted(self, signum: int) -> None:
        self.wait()  # the preemption's checkpoint is complete before the process says so and exits
        name, where = signal_name(signum), self._shown(str(self.last_path))  # uploaded: where the next run finds it
        if self.rank == 0:
            say_preempted(name, self.global_step, where, self.continue_hint, self.options.requeue, self.environ)
        self._preempted = True
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
        self.start()
        return self._write(reason, metrics, best)

    def _write(self, reason: str, metrics: Mapping[str, float] | None = None, best: bool = False) -> Path | None:
        start = time.perf_counter()
        if self.epochs.holds_no_position():  # a checkpoint inside an epoch: no data position
            self._say_no_position()
        self._told.scheduler_not_held(self.objects)
        steps_per_epoch = self.epochs.steps_per_epoch
        if steps_per_epoch and not self.epochs.completed_epochs and self.global_step > steps_per_epoch:
            # A torch DataLoader's first epoch has ended, and no epoch_end() came after it: no metric either.
            self.metrics.say_none_given()
        replacing = self.global_step == self.schedule.saved_step and self.last_path is not None
        values, best = self.metrics.for_write(replacing, metrics, best)  # a replacement keeps the step's metrics
        facts = self.epochs.save_facts(reason, self.global_step, values, best, self.metrics.best.info(), replacing)
        try:
            path = self._saving.save(facts, lambda: bool(self.signals.received))
        except BaseException:
            self._write_failed = True  # close() then writes nothing more: the same write would fail again
            raise
        if path is None:  # not written, and the user chose to go on (on_write_error="warn")
            return None
        self.last_path = path
        self.schedule.saved(self.global_step)
        self.metrics.written((values, best))
        self.agreement.saved()
        self.save_seconds += time.perf_counter() - start
        return path

    def set_on_save(self, callback: Callable[[Path, str], None] | None) -> None:
        """Call ``callback(path, reason)`` on rank 0 after each checkpoint is written, from now on (None: stop).

        With ``async_save`` it is called once the write is complete: at the next save, ``wait()`` or ``close()``;
        for a URL, once the checkpoint is uploaded (``path``: its staged copy).
        """
        self._on_save = callback

    def _saved(self, path: Path, reason: str) -> None:
        if self._on_save is not None:
            self._on_save(path, reason)

    def _wait_for_writes(self) -> None:
        """Rank 0: hand back finished background writes (``on_save``; a failed write's error)."""
        if self.writer is not None:
            self.writer.wait()

    def wait(self) -> Path | None:
        """Wait until the checkpoint in flight (``async_save``, or an upload) is complete (a collective).

        Returns:
            The newest checkpoint (``last_path``).

        Raises:
            CheckpointError: the background write failed (the message says why).
        """
        if self.async_save and self.shards is not None:
            self.shards.wait()  # this rank's shards; rank 0's writer then completes the folder
        if self.async_save or self.remote is not None:  # a remote folder's upload is always in the background
            self._on_rank_zero(self._wait_for_writes)
        return self.last_path

    def _on_rank_zero(self, fn: Callable[[], Any]) -> Any:
        return on_rank_zero(fn, self.rank, self.world_size)

    def _say_no_position(self) -> None:
        resume_point = self.epochs.resume_point(self.global_step)
        self._told.position_not_held(self.global_step, resume_point, self.epochs.completed_epochs)

    # -- the end ----------------------------------------------------------------------

    def close(self) -> None:
        """Write the final state, then restore the signal handlers that were there before (safe to call twice).

        Call it on every rank when training ends (a collective). The state is
        written when steps were taken since the last checkpoint: the last
        epoch's checkpoint, holding what the loop did after its batch loop, or
        a checkpoint of the last step (reason "final") in a loop without
        epochs or with steps after the last cadence; the newest checkpoint is
        marked finished (``ResumePoint.finished``), and a write in flight
        (``async_save``) is complete. While an exception unwinds, nothing new
        is written (the other ranks may be gone), but a write in flight is
        completed; after a preemption, its checkpoint is the last.
        """
        failed = sys.exc_info()[0] is not None or self._write_failed
        try:
            if not failed and not self._closed and not self._preempted and self.schedule.unsaved(self.global_step):
                self.start()  # a loop with no cadence may have written nothing yet: its steps are saved now
            if not failed and self._started and not self._closed:
                save = self.schedule.at_close(self.global_step)
                if save is not None:
                    self._carry_out(Save(save.reason))
                if not self._preempted and self.schedule.unsaved(self.global_step):
                    self._write("final")  # the steps since the last checkpoint
                # No loader tells where epochs end, and none ended with metrics: the run ends without a best.
                self.metrics.say_if_never_given(self.epochs.epochs_unknown())
                if not self._preempted and self.schedule.saved_step == self.global_step and self.last_path:
                    # The run ends here: a resume from this checkpoint has nothing left to train (ResumePoint.finished).
                    self._on_rank_zero(lambda: self._annotate({"finished": True}))
                self.wait()
        finally:
            self._closed = True
            self._saving.close(failed)
            if self._lock is not None:
                self._lock.release()
            if self.loader is not None:
                self.loader.step_boundary.unregister(self._at_boundary)
            self.signals.close()

    def unwritten(self) -> str:
        """The reason of a checkpoint due but not yet written ("" when none): ``close()`` writes it."""
        return self.schedule.pending_reason if self.schedule.pending_at(self.global_step) else ""


__all__ = ["Checkpointer", "ResumePoint"]
