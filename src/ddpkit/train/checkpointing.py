"""Checkpointing a training run: what a checkpoint holds, when it is written, how a run resumes.

:func:`attach_checkpointing` connects a :class:`~ddpkit.train.loop.Trainer`
to its checkpoints folder (``checkpoint.dir``, by default
``<output_dir>/checkpoints``; every node must see it): it resumes as asked,
then writes checkpoints during training.

What a checkpoint holds: the model, the optimizer, the LR scheduler (None:
ddpkit has none), the grad scaler, the train state (completed epochs, step in
epoch, global step, samples seen, train time), the sampler's parameters (its
order is a pure function of seed, epoch and step), every rank's RNG states,
the resolved config, the world size, the library versions, the latest test
metrics and the best value so far. The on-disk format and its crash-safety
are in :mod:`ddpkit.train.checkpoint`.

When: at every epoch end (``checkpoint.on_epoch_end``), every N steps
(``checkpoint.every_steps``), every T seconds (``checkpoint.every_seconds``),
at ``max_steps``, and on a preemption signal (:mod:`ddpkit.train.preemption`).
The per-step cost is one integer compare: the hook is a no-op until the next
step at which something may be due. A step cadence needs no agreement between
ranks (they all count the same steps); the clock and the signals are agreed on
by one small all_reduce about every ``checkpoint.sync_seconds``. A save asked
for at an epoch's last step is made by the epoch-end hook that follows at once.

Resume (``resume=``):

- ``never``: start fresh. A checkpoints folder that already holds complete
  checkpoints is refused (two runs' checkpoints would mix): continue it with
  ``resume=auto`` or choose another folder.
- ``auto``: the newest complete checkpoint that verifies (sizes, SHA-256,
  safe load). A newer one that is corrupt is named in a warning and set
  aside (``step-....corrupt``) and the previous good one is used; leftovers of
  interrupted writes are removed. With no checkpoint at all the run starts
  fresh and says so; when checkpoints exist but none verifies, it stops with
  an error rather than starting silently from scratch.
- a path: that checkpoint, strictly (any problem is an error).

A restarted worker (``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT``
above 0) resumes as with ``auto`` whatever ``resume`` says, falling back to
``resume``'s choice when the folder holds nothing yet.

Exactness: with the same world size the resumed run continues bit for bit
(model, optimizer, every RNG). With another world size, training continues at
the same global batch of the same global sample order (no sample skipped or
repeated: see :mod:`ddpkit.data.sampler`); RNG streams and the all_reduce
summation order differ, so the numbers are close but not bit-identical, and a
warning says so.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.config import TrainConfig, to_dict, to_yaml
from ddpkit.log import get_logger
from ddpkit.train.checkpoint import (
    READABLE_BY,
    CheckpointError,
    checkpoint_name,
    library_versions,
    list_checkpoints,
    load_file,
    mark_best,
    prune,
    read_manifest,
    set_aside,
    verify_checkpoint,
    write_checkpoint,
)
from ddpkit.train.loop import Trainer, seed_everything
from ddpkit.train.preemption import Agreement, Preempted, PreemptionSignals, requeue_slurm_job, signal_name
from ddpkit.train.rng import capture_rng_state, restore_rng_state

EXACTNESS_KEYS = (
    "model", "dataset", "synthetic_samples", "batch_size", "batch_scope", "optimizer", "lr", "momentum",
    "weight_decay", "scale_lr", "grad_accum_steps", "precision", "grad_sync", "allreduce", "sync_batchnorm",
)
"""Config keys whose change on resume is worth a warning (the run no longer continues the same computation)."""

PT_FILES = ("model.pt", "optimizer.pt", "train.pt", "rng.pt")


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this job was restarted (torch elastic) or requeued (Slurm)."""
    counts = [environ.get("TORCHELASTIC_RESTART_COUNT", ""), environ.get("SLURM_RESTART_COUNT", "")]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


def best_metric(cfg_metric: str, cfg_mode: str, task: str) -> tuple[str, str]:
    """The (metric, mode) that picks the best checkpoint; ("", "") when off."""
    metric = cfg_metric
    if metric == "auto":
        metric = "accuracy" if task == "classification" else "mse"
    if not metric:
        return "", ""
    mode = cfg_mode if cfg_mode != "auto" else ("max" if metric == "accuracy" else "min")
    return metric, mode


class Checkpointing:
    """Resumes a Trainer and writes its checkpoints; see the module docstring.

    Args:
        trainer: the trainer (model, optimizer and state already built).
        environ: the process environment (restart counters, SLURM_JOB_ID).
    """

    def __init__(self, trainer: Trainer, environ: Mapping[str, str] | None = None):
        cfg = trainer.cfg
        self.trainer = trainer
        self.config = cfg.checkpoint
        self.root = Path(self.config.dir or Path(cfg.output_dir) / "checkpoints")
        self.mode = READABLE_BY[self.config.readable_by]
        self.environ = dict(os.environ if environ is None else environ)
        self.restarts = restart_count(self.environ)
        ctx = trainer.ctx
        self.rank, self.world_size, self.is_main = ctx.rank, ctx.world_size, ctx.is_main_process
        self.signals = PreemptionSignals(self.config.signal_names() if self.config.enabled else ())
        self.agreement = Agreement(ctx.world_size, ctx.is_main_process, ctx.device,
                                   self.config.sync_seconds, self.config.every_seconds)
        self.best_metric, self.best_mode = best_metric(self.config.best_metric, self.config.best_mode, trainer.spec.task)
        self.best_value: float | None = None
        self.resumed_from: Path | None = None
        """The checkpoint this run resumed from, if any."""
        self.last_path: Path | None = None
        """The checkpoint written last."""
        self._last_step = -1
        self._next_check = 0

    # -- wiring -----------------------------------------------------------------

    def attach(self) -> Checkpointing:
        """Resume as configured, then hook into the trainer's step and epoch callbacks."""
        self.signals.install()
        self.resume()
        if self.config.enabled:
            # First: a save due at max_steps happens before the loop's own max_steps stop.
            self.trainer.step_callbacks.insert(0, self.on_step)
            self.trainer.epoch_callbacks.append(self.on_epoch_end)
        self.agreement.start(self.trainer.state.global_step)
        self._schedule()
        return self

    def close(self) -> None:
        """Restore the signal handlers that were there before."""
        self.signals.close()

    # -- hooks ------------------------------------------------------------------

    def on_step(self, trainer: Trainer) -> None:
        """After every optimizer step: one integer compare, unless something may be due."""
        if trainer.state.global_step >= self._next_check:
            self._step_event()

    def _step_event(self) -> None:
        trainer, state = self.trainer, self.trainer.state
        if state.step_in_epoch >= trainer.sampler.steps_per_epoch:
            return  # the epoch-end hook follows at once and takes any decision due now
        step = state.global_step
        reasons, signum = [], 0
        if step >= self.agreement.next_step:
            signum, time_due = self.agreement.agree(step, self.signals.received)
            reasons += ["preempted"] * bool(signum) + ["every_seconds"] * time_due
        if self.config.every_steps and step % self.config.every_steps == 0:
            reasons.append("every_steps")
        if trainer.cfg.max_steps and step >= trainer.cfg.max_steps:
            reasons.append("max_steps")
        if reasons:
            self.save(reasons[0], in_epoch=True)
        if signum:
            self._exit_preempted(signum)
        self._schedule()

    def on_epoch_end(self, trainer: Trainer, metrics: dict[str, float]) -> None:
        """After every epoch and its evaluation: agree, save as due, keep the best, stop if preempted."""
        state = trainer.state
        signum, time_due = self.agreement.agree(state.global_step, self.signals.received)
        improved = self._improves(metrics)
        at_max = bool(trainer.cfg.max_steps) and state.global_step >= trainer.cfg.max_steps
        if self.config.on_epoch_end or signum or time_due or improved or at_max:
            reason = "preempted" if signum else "epoch_end"
            self.save(reason, metrics=metrics, best=improved)
        if signum and state.completed_epochs < trainer.cfg.epochs:
            self._exit_preempted(signum)  # (after the last epoch the run just finishes)
        self._schedule()

    def _schedule(self) -> None:
        step = self.trainer.state.global_step
        due = [self.agreement.next_step]
        if self.config.every_steps:
            due.append((step // self.config.every_steps + 1) * self.config.every_steps)
        if self.trainer.cfg.max_steps > step:
            due.append(self.trainer.cfg.max_steps)
        self._next_check = min(due)

    def _improves(self, metrics: dict[str, float]) -> bool:
        if not self.best_metric or self.best_metric not in metrics:
            return False
        value = metrics[self.best_metric]
        if self.best_value is None or (value > self.best_value if self.best_mode == "max" else value < self.best_value):
            self.best_value = value
            return True
        return False

    def _exit_preempted(self, signum: int) -> None:
        name = signal_name(signum)
        if self.is_main:
            log = get_logger()
            log.warning(f"preempted by {name} after global step {self.trainer.state.global_step}: checkpoint "
                        f"{self.last_path} is complete; exiting with status 75 (restart, or run again with resume=auto)")
            if self.config.requeue:
                log.warning(requeue_slurm_job(self.environ))
        self.close()
        raise Preempted(name, str(self.last_path))

    # -- saving -----------------------------------------------------------------

    def save(self, reason: str, metrics: dict[str, float] | None = None, best: bool = False,
             in_epoch: bool = False) -> Path:
        """Write a checkpoint of the current state (a collective: every rank calls it; rank 0 writes).

        Args:
            reason: why (epoch_end, every_steps, every_seconds, max_steps, preempted), kept in the manifest.
            metrics: test metrics of this point, if just evaluated.
            best: also make it the best checkpoint.
            in_epoch: called from inside the epoch loop (its time is then not counted as training).

        Returns:
            The checkpoint folder, once complete on disk (on every rank).

        Raises:
            CheckpointError: rank 0 could not write it (the message says why).
        """
        start = time.perf_counter()
        state = self.trainer.state
        if state.global_step == self._last_step and self.last_path is not None:
            # This very state is on disk already (e.g. the checkpoint just resumed from): never rewrite it.
            if best and self.is_main:
                mark_best(self.root, self.last_path, self.mode)
            return self.last_path
        rng = capture_rng_state()
        if self.world_size > 1:
            gathered: list[Any] | None = [None] * self.world_size if self.is_main else None
            dist.gather_object(rng, gathered, dst=0)
        else:
            gathered = [rng]
        result = ["", ""]
        if self.is_main:
            try:
                result[0] = str(self._write(reason, gathered, metrics or {}, best, in_epoch))
            except OSError as e:
                result[1] = (f"cannot write a checkpoint to {self.root}: {e}; "
                             "free some space or set checkpoint.dir to a writable folder")
        if self.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        if result[1]:
            raise CheckpointError(result[1])
        self.last_path, self._last_step = Path(result[0]), state.global_step
        self.agreement.last_save = time.monotonic()
        if in_epoch:
            state.train_time -= time.perf_counter() - start  # saving is not training
        return self.last_path

    def _write(self, reason: str, rng_states: list[Any], metrics: dict[str, float], best: bool, in_epoch: bool) -> Path:
        trainer, cfg, state = self.trainer, self.trainer.cfg, self.trainer.state
        train_state = state.state_dict()
        if in_epoch:
            train_state["train_time"] = state.train_time + (time.perf_counter() - trainer.epoch_start_time)
        sampler = trainer.sampler
        best_info = {"metric": self.best_metric, "mode": self.best_mode, "value": self.best_value}
        objects = {
            "model.pt": trainer.module.state_dict(),
            "optimizer.pt": trainer.optimizer.state_dict(),
            "train.pt": {
                "train_state": train_state,
                "sampler": {"num_samples": sampler.num_samples, "global_batch_size": sampler.global_batch_size,
                            "seed": sampler.seed},
                "grad_scaler": trainer.scaler.state_dict(),
                "lr_scheduler": None,
                "best": best_info,
                "metrics": metrics,
            },
            "rng.pt": {"world_size": self.world_size, "ranks": rng_states},
        }
        spec = trainer.spec
        meta = {
            "reason": reason,
            "global_step": state.global_step,
            "completed_epochs": state.completed_epochs,
            "step_in_epoch": state.step_in_epoch,
            "steps_per_epoch": sampler.steps_per_epoch,
            "samples_seen": state.samples_seen,
            "world_size": self.world_size,
            "metrics": metrics,
            "best": best_info,
            "model": {"name": cfg.model, "task": spec.task,
                      "normalize": list(spec.normalize) if spec.normalize else None},
            "versions": library_versions(),
            "config": to_dict(cfg),
        }
        path = write_checkpoint(self.root, checkpoint_name(state.global_step), objects,
                                {"config.yaml": to_yaml(cfg)}, meta, self.mode)
        if best:
            mark_best(self.root, path, self.mode)
        prune(self.root, self.config.keep, protect=path)
        trainer.metrics.write("checkpoint", global_step=state.global_step, epoch=state.completed_epochs,
                              reason=reason, path=str(path), best=best)
        get_logger().info(f"checkpoint {path} ({reason}" + (f", best {self.best_metric} {self.best_value:.4f}" if best else "") + ")")
        return path

    # -- resuming ---------------------------------------------------------------

    def resume(self) -> Path | None:
        """Restore the trainer from the checkpoint ``resume`` selects (a collective); return it, or None."""
        result = ["", ""]
        loaded: dict[str, Any] | None = None
        if self.is_main:
            try:
                path, loaded = self._choose()
                result[0] = str(path) if path else ""
            except CheckpointError as e:
                result[1] = str(e)
        if self.world_size > 1:
            dist.broadcast_object_list(result, src=0)
        if result[1]:
            raise CheckpointError(result[1])
        if not result[0]:
            return None
        path = Path(result[0])
        if loaded is None:  # rank 0 verified the files moments ago; the others read them
            # On the CPU: RNG states must be CPU tensors; load_state_dict moves the rest to its parameters' device.
            loaded = {name: load_file(path / name) for name in PT_FILES}
            loaded["manifest"] = read_manifest(path)
        self._restore(path, loaded)
        self.resumed_from = path
        return path

    def _choose(self) -> tuple[Path | None, dict[str, Any] | None]:
        """Rank 0: the checkpoint to resume from and its verified, loaded files (see the module docstring)."""
        log = get_logger()
        requested = self.trainer.cfg.resume
        infos = list_checkpoints(self.root)
        complete = [info for info in infos if info.complete]
        if self.restarts and requested != "auto" and complete:
            log.info(f"restart {self.restarts}: resuming from the newest checkpoint in {self.root}")
            requested = "auto"
        if requested == "never":
            if complete:
                raise _holds_checkpoints(self.root, complete)
            self._remove_incomplete(infos)
            return None, None
        if requested == "auto":
            return self._newest_good(infos)
        path = Path(requested)
        loaded = verify_checkpoint(path)
        step = loaded["manifest"]["global_step"]
        newer = [i for i in complete if i.global_step > step and i.path.resolve() != path.resolve()]
        if newer:
            raise CheckpointError(
                f"{self.root} holds checkpoints newer than resume={path} ({newer[-1].path.name}); resuming "
                "from the older one there would mix two runs: move the newer ones away, "
                "or set checkpoint.dir to another folder"
            )
        self._remove_incomplete([i for i in infos if i.global_step > step])
        return path, loaded

    def _newest_good(self, infos: list[Any]) -> tuple[Path | None, dict[str, Any] | None]:
        log = get_logger()
        complete = [info for info in infos if info.complete]
        bad = []
        for info in reversed(complete):
            try:
                loaded = verify_checkpoint(info.path)
            except CheckpointError as e:
                log.warning(f"resume=auto: skipping checkpoint {info.path.name}: {e}")
                bad.append(info)
                continue
            if bad:
                log.warning(f"resume=auto: newest checkpoint {bad[0].path} is corrupt; using the previous good one, "
                            f"{info.path}")
                for info_bad in bad:
                    log.warning(f"set aside as {set_aside(info_bad.path)}")
            self._remove_incomplete([i for i in infos if i.global_step > info.global_step])
            return info.path, loaded
        if bad:
            raise CheckpointError(
                f"no checkpoint in {self.root} verifies ({', '.join(i.path.name for i in bad)} are corrupt); "
                "restore them from a backup, or start over with resume=never and another checkpoint.dir"
            )
        log.info(f"resume=auto: no checkpoint in {self.root} yet; starting from the beginning")
        self._remove_incomplete(infos)
        return None, None

    def _remove_incomplete(self, infos: list[Any]) -> None:
        for info in infos:
            if not info.complete:
                get_logger().warning(f"removing {info.path}: an interrupted checkpoint write (it has no manifest)")
                shutil.rmtree(info.path, ignore_errors=True)

    def _restore(self, path: Path, loaded: dict[str, Any]) -> None:
        trainer, cfg, log = self.trainer, self.trainer.cfg, get_logger()
        manifest, train = loaded["manifest"], loaded["train.pt"]
        saved_cfg = manifest.get("config", {})
        try:
            trainer.module.load_state_dict(loaded["model.pt"])
            trainer.optimizer.load_state_dict(loaded["optimizer.pt"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {path} does not fit this run's model or optimizer ({str(e).strip().splitlines()[0]}); "
                f"resume with the settings it was written with (model={saved_cfg.get('model')}, "
                f"optimizer={saved_cfg.get('optimizer')}, freeze={saved_cfg.get('freeze', '')!r})"
            ) from None
        if train.get("grad_scaler"):
            trainer.scaler.load_state_dict(train["grad_scaler"])
        self._check_sampler(path, train["sampler"])
        trainer.state.load_state_dict(train["train_state"])
        state = trainer.state
        ranks = loaded["rng.pt"]["ranks"]
        if self.rank < len(ranks):
            restore_rng_state(ranks[self.rank])
        else:  # a new rank: its own stream, distinct from every other rank's
            seed_everything(cfg.seed * 1_000_003 + self.rank * 7919 + state.global_step)
        best = train.get("best", {})
        if best.get("metric") == self.best_metric:
            self.best_value = best.get("value")
        self._last_step, self.last_path = state.global_step, path
        if not self.is_main:
            return
        changed = [f"{k}: {saved_cfg[k]!r} -> {getattr(cfg, k)!r}" for k in EXACTNESS_KEYS
                   if k in saved_cfg and saved_cfg[k] != getattr(cfg, k)]
        if changed:
            log.warning(f"resuming {path.name} with changed settings ({'; '.join(changed)}): "
                        "training continues, but not as the original run would have")
        if len(ranks) != self.world_size:
            log.warning(
                f"checkpoint {path.name} was written by {len(ranks)} worker(s) and this run has {self.world_size}: "
                "training continues at the same global batch of the same sample order (no sample skipped or "
                "repeated), but results are not bit-identical to an uninterrupted run (per-rank random states "
                "and the all_reduce order differ)"
            )
        log.info(f"resumed from {path} (global step {state.global_step}: epoch {state.completed_epochs + 1}, "
                 f"step {state.step_in_epoch} of {trainer.sampler.steps_per_epoch})")

    def _check_sampler(self, path: Path, saved: dict[str, int]) -> None:
        sampler = self.trainer.sampler
        if saved["num_samples"] != sampler.num_samples:
            raise CheckpointError(
                f"checkpoint {path} was trained on {saved['num_samples']} samples, this dataset has "
                f"{sampler.num_samples}; resume with the same dataset (dataset=, synthetic_samples=)"
            )
        if saved["global_batch_size"] != sampler.global_batch_size:
            raise CheckpointError(
                f"checkpoint {path} used a global batch of {saved['global_batch_size']} samples, this run "
                f"{sampler.global_batch_size}; resume with the same global batch (batch_size=, batch_scope=global "
                "keeps it fixed whatever the number of workers)"
            )
        if saved["seed"] != sampler.seed:
            raise CheckpointError(
                f"checkpoint {path} was trained with seed={saved['seed']} (which fixes the sample order); "
                f"resume with seed={saved['seed']}"
            )


def _holds_checkpoints(root: Path, complete: list[Any]) -> CheckpointError:
    return CheckpointError(
        f"{root} already holds checkpoints (newest: {complete[-1].path.name}); continue that run with "
        "resume=auto, or start a new one in another output_dir=... (or checkpoint.dir=...)"
    )


def check_checkpoints_before_launch(cfg: TrainConfig) -> None:
    """Fail before any worker starts when ``resume`` cannot work (the workers check again, fully).

    Raises:
        CheckpointError: a fresh start into a folder holding checkpoints, or
            ``resume=PATH`` that is not a complete checkpoint.
    """
    if cfg.resume == "never" and cfg.checkpoint.enabled:
        root = Path(cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoints")
        complete = [info for info in list_checkpoints(root) if info.complete]
        if complete:
            raise _holds_checkpoints(root, complete)
    elif cfg.resume not in ("never", "auto"):
        read_manifest(cfg.resume)


def attach_checkpointing(trainer: Trainer, environ: Mapping[str, str] | None = None) -> Checkpointing | None:
    """Resume ``trainer`` as ``cfg.resume`` asks and write checkpoints as ``cfg.checkpoint`` asks.

    Returns:
        The attached Checkpointing (call ``close()`` when training is over), or
        None when checkpoints are off and nothing is to be resumed.

    Raises:
        CheckpointError: the checkpoint to resume from is unusable, or the
            folder already holds another run's checkpoints (the message says what to do).
    """
    cfg = trainer.cfg
    if not cfg.checkpoint.enabled and cfg.resume == "never":
        return None
    return Checkpointing(trainer, environ).attach()
