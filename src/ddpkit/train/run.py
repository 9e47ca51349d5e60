"""One worker's whole training run: join the job, build the parts with the public API, train, report.

:func:`build_trainer` is the recipe a user's own script follows too
(``examples/``): ``ddpkit.init``, ``ddpkit.seed_everything``,
``ddpkit.apply_transfer`` (``init_from``, ``freeze``), ``ddpkit.prepare_model``,
``ddpkit.DataLoader``, the model that ``model=NAME`` names
(``ddpkit.get_model_spec``), an optimizer and scheduler, ``ddpkit.Checkpointer``
and its ``resume``, and ``ddpkit.export_checkpoint`` at the end. Those come
from ``ddpkit``'s public names (``ddpkit.__all__``) and the datasets from
:mod:`ddpkit.datasets`. Besides the trainer's own modules (``ddpkit.train``,
``ddpkit.train.config``), the only other imports are this plumbing of the command,
which an own loop does without (``tests/train/test_run_imports.py`` keeps
the imports to this list):

- ``ddpkit.log.get_logger``, ``ddpkit.log.setup_logging``: the command's
  ``[rank r/w]`` log lines;
- ``ddpkit.gc_pause.import_paused``: torch._dynamo imported with garbage
  collection paused, a start-up cost of the command;
- ``ddpkit.launchers.failure.record_for_launcher``: the error file that torchrun
  and ddpkit's launcher read for their one failure report (torch's
  ``@record`` does this for a script); ``ddpkit.launchers.failure.FAILURE_DIR_VARIABLE``,
  which only ddpkit's launcher sets, so that its workers (torch's elastic
  agent starts them, with torchrun's variables) name it rather than torchrun;
- ``ddpkit.errors.exit_status``: the exit status a failed rank leaves with (a full disk's, 74);
- ``ddpkit.distributed.exit_process``: a failed rank leaves at once, so that
  the launcher takes it for the root cause rather than the peers it fails;
- ``ddpkit.distributed.control_device``: where the broadcasts of the run
  folder's name and (sharded) of rank 0's generator states run (CPU for
  gloo, CUDA for nccl).
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import ddpkit
from ddpkit import (
    Checkpointer,
    Context,
    DataLoader,
    FolderInUseError,
    FolderLock,
    ModelSpec,
    ResumePoint,
    Tracker,
    UserError,
    apply_transfer,
    export_checkpoint,
    get_model_spec,
    prepare_model,
    seed_everything,
)
from ddpkit.datasets import DataOptions, load_datasets
from ddpkit.distributed import control_device, exit_process
from ddpkit.errors import exit_status
from ddpkit.gc_pause import import_paused
from ddpkit.launchers.failure import FAILURE_DIR_VARIABLE, record_for_launcher
from ddpkit.log import get_logger, setup_logging
from ddpkit.train.config import TrainConfig, with_remote_checkpoints
from ddpkit.train.loop import Trainer, build_optimizer, global_batch_size
from ddpkit.train.metrics_file import write_error
from ddpkit.train.run_folder import URL_FILE, claim_run_folder, lock_wait_seconds, plan_run_folder
from ddpkit.train.schedule import SETTINGS, apply_changed_rates, base_rates, build_scheduler
from ddpkit.train.state import TrainState
from ddpkit.train.storage_url import url_scheme
from ddpkit.train.task import resolve_task

EVAL_BATCH_PER_WORKER = 2000
"""Evaluation samples per worker and forward pass."""

EXACTNESS_KEYS = (
    "model",
    "dataset",
    "task",
    "synthetic_samples",
    "batch_size",
    "batch_scope",
    "optimizer",
    "lr",
    "momentum",
    "lr_schedule",
    "warmup_steps",
    "weight_decay",
    "scale_lr",
    "grad_accum_steps",
    "precision",
    "grad_sync",
    "allreduce",
    "sync_batchnorm",
)
"""Config keys whose change on resume is worth a warning (the run no longer continues the same computation)."""


def data_options(cfg: TrainConfig) -> DataOptions:
    """The dataset options of a training config."""
    return DataOptions(
        data_dir=cfg.data_dir,
        download=cfg.download,
        mirrors=(cfg.data_mirror,) if cfg.data_mirror else (),
        synthetic_samples=cfg.synthetic_samples,
        seed=cfg.seed,
    )


def checkpoint_root(cfg: TrainConfig) -> str | Path:
    """The run's checkpoints folder: checkpoint.dir (a URL as it is), else <output_dir>/checkpoints."""
    if url_scheme(cfg.checkpoint.dir):
        return cfg.checkpoint.dir  # a Path would make s3://b/run s3:/b/run, a local folder
    return Path(cfg.checkpoint.dir or Path(cfg.output_dir) / "checkpoints")


def _build_model(cfg: TrainConfig, ctx: Context, spec: ModelSpec) -> torch.nn.Module:
    """The model to prepare, built on every rank; with shard=true, whole on rank 0 only.

    Sharded over several ranks, the ranks other than 0 build it on the meta
    device (no memory), where it can be built there, and
    ``prepare_model(shard=True)`` hands them rank 0's weights block by block:
    only rank 0 holds the whole model in CPU memory. Building draws random
    numbers on rank 0 alone, so the others then take its generators' states:
    every later draw (dropout) is what it would have been had they built it.
    """
    if not (cfg.shard and ctx.world_size > 1):
        return _checked_model(spec.build(), cfg)
    if ctx.rank == 0:
        model = spec.build()
    else:
        try:
            with torch.device("meta"):
                model = spec.build()
        except Exception:  # a model whose construction reads its tensors' values: built as rank 0 builds it
            model = spec.build()
    box = [(torch.get_rng_state(), random.getstate(), np.random.get_state())]
    dist.broadcast_object_list(box, src=0, device=control_device())
    torch_state, python_state, numpy_state = box[0]
    torch.set_rng_state(torch_state)
    random.setstate(python_state)
    np.random.set_state(numpy_state)
    return _checked_model(model, cfg)


def _checked_model(model: Any, cfg: TrainConfig) -> torch.nn.Module:
    if not isinstance(model, torch.nn.Module):
        raise UserError(
            f"model={cfg.model} returned a {type(model).__name__}, not a torch.nn.Module; make the function "
            "return the model itself"
        )
    return model


def _on_meta(model: torch.nn.Module) -> bool:
    return any(tensor.is_meta for tensor in (*model.parameters(), *model.buffers()))


def build_trainer(cfg: TrainConfig, ctx: Context, spec: ModelSpec, train_set: Any, test_set: Any) -> Trainer:
    """Every part of a run from the public API, resumed as ``cfg.resume`` asks."""
    seed_everything(cfg.seed)
    model = _build_model(cfg, ctx, spec)
    if cfg.init_from or cfg.freeze:
        # Before preparing: the gradient sync must not expect gradients of frozen parameters. A model on the
        # meta device takes rank 0's weights when it is sharded: only rank 0 reads init_from.
        init_from = "" if ctx.rank != 0 and _on_meta(model) else cfg.init_from
        for line in apply_transfer(model, init_from, cfg.freeze).lines():
            get_logger().info(line)
    model = prepare_model(
        model, allreduce=cfg.allreduce, grad_sync=cfg.grad_sync, sync_batchnorm=cfg.sync_batchnorm, shard=cfg.shard
    )
    optimizer = build_optimizer(cfg, model.parameters(), ctx.world_size)
    batch = global_batch_size(cfg, ctx.world_size)
    loader = DataLoader(
        train_set,
        global_batch_size=batch,
        shuffle=True,
        seed=cfg.seed,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
    )
    eval_batch = EVAL_BATCH_PER_WORKER * ctx.world_size
    test_loader = DataLoader(test_set, global_batch_size=eval_batch, shuffle=False, num_workers=cfg.num_workers)
    # The schedule spans every epoch: max_steps stops training early, and a resumed run continues it exactly.
    scheduler = build_scheduler(
        cfg.lr_schedule,
        optimizer,
        cfg.epochs * loader.steps_per_epoch,
        loader.steps_per_epoch,
        cfg.warmup_steps,
        cfg.lr_step_epochs,
        cfg.lr_gamma,
    )
    scaler = torch.amp.GradScaler(ctx.device.type, enabled=cfg.precision == "fp16" and ctx.device.type == "cuda")
    task = resolve_task(cfg.task, spec.task, cfg.loss)
    trainer = Trainer(
        cfg,
        ctx,
        model,
        optimizer,
        loader,
        test_loader,
        task,
        scheduler,
        scaler,
        dataset_name=cfg.dataset,
        state=TrainState(tracker=build_tracker(cfg)),
    )
    if cfg.eval_train:
        trainer.train_loader_for_eval = DataLoader(
            train_set, global_batch_size=eval_batch, shuffle=False, num_workers=cfg.num_workers
        )
    trainer.checkpointer = _checkpointer(cfg, trainer)
    if trainer.checkpointer is not None:
        configured = base_rates(optimizer)
        try:
            start = trainer.checkpointer.resume(cfg.resume)
        except BaseException:
            # No trainer to close later: give back the signal handlers and the metrics file now.
            trainer.checkpointer.close()
            trainer.metrics.close()
            raise
        _warn_changed_settings(cfg, start)
        if start.resumed:
            _apply_changed_rates(cfg, start, optimizer, scheduler, configured)
    if trainer.state.tracker is not None:
        trainer.state.tracker.start()  # a new run is created here, not inside the timed training loop
    return trainer


def build_tracker(cfg: TrainConfig) -> Tracker | None:
    """The run's Tracker for ``cfg.logger`` (None for jsonl): in the run folder, its project named by the
    model and dataset, its run by the folder, the config as its hyperparameters."""
    if cfg.logger == "jsonl":
        return None
    folder = Path(cfg.output_dir)
    project = re.sub(r"[^A-Za-z0-9_.-]+", "-", f"{cfg.model}-{cfg.dataset}")
    return Tracker(
        cfg.logger,
        folder / "tensorboard" if cfg.logger == "tensorboard" else folder,
        project=project,
        run_name=folder.name,
        config=dataclasses.asdict(cfg),
    )


def _checkpointer(cfg: TrainConfig, trainer: Trainer) -> Checkpointer | None:
    """The run's Checkpointer, or None when checkpoints are off and nothing is to be resumed."""
    if not cfg.checkpoint.enabled and cfg.resume == "never":
        return None
    checkpointer = Checkpointer(
        checkpoint_root(cfg),
        model=trainer.model,
        optimizer=trainer.optimizer,
        scheduler=trainer.scheduler,
        scaler=trainer.scaler,
        loader=trainer.loader,
        extra={"train_state": trainer.state},
        options=cfg.checkpoint.for_run(trainer.task.quality_metric),
        config=dataclasses.asdict(cfg),
        meta={"model": {"name": cfg.model, "task": trainer.task.name}},
        timeout=cfg.timeout,
        continue_hint="continue with resume=auto",
    )
    checkpointer.set_on_save(
        lambda path, reason: trainer.metrics.write(
            "checkpoint",
            global_step=checkpointer.global_step,
            epoch=trainer.loader.epoch,
            reason=reason,
            path=str(path),
        )
    )
    return checkpointer


def _apply_changed_rates(
    cfg: TrainConfig,
    start: ResumePoint,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    configured: list[float],
) -> None:
    """The command's learning rate, momentum and weight decay, where it changed them, over the checkpoint's."""
    saved = start.manifest.get("config", {})
    settings = {key: getattr(cfg, key) for key in SETTINGS if key in saved and saved[key] != getattr(cfg, key)}
    changed = apply_changed_rates(optimizer, scheduler, configured, settings)
    if changed:
        get_logger().info(f"the resumed optimizer takes this command's settings: {', '.join(changed)}")


def _warn_changed_settings(cfg: TrainConfig, start: ResumePoint) -> None:
    saved = start.manifest.get("config", {})
    changed = [
        f"{k}: {saved[k]!r} -> {getattr(cfg, k)!r}"
        for k in EXACTNESS_KEYS
        if k in saved and saved[k] != getattr(cfg, k)
    ]
    if changed and start.resumed:
        assert start.path is not None  # a resumed start names its checkpoint
        get_logger().warning(
            f"resuming {start.path.name} with changed settings ({'; '.join(changed)}): "
            "training continues, but not as the original run would have"
        )


def run_worker(cfg: TrainConfig, export_dir: str = "") -> dict[str, Any]:
    """Train as one worker of the job this process belongs to; returns the summary.

    Works the same under ddpkit's launcher, torchrun, srun, mpirun or alone.
    With ``export_dir`` (SageMaker's model folder), rank 0 exports the final
    checkpoint there at the end (see ddpkit.checkpoint.publishing.export).
    """
    # The optimizer would import torch._dynamo on its first use, with collections walking torch meanwhile
    # (a worker forked from the worker server has it already).
    import_paused("torch._dynamo")
    ctx = ddpkit.init(cfg.backend, cfg.device, cfg.timeout, cfg.threads)
    locks: list[FolderLock] = []
    try:
        cfg = _with_run_folder(cfg, ctx)
        locks = _lock_run_folder(cfg, ctx)  # before anything is written there
        log = setup_logging(ctx.rank, ctx.world_size)
        log.info(
            f"{_launcher_name(ctx)}: world_size {ctx.world_size} on {ctx.env.num_nodes} node(s), "
            f"master {ctx.env.master_addr}:{ctx.env.master_port}, backend {ctx.backend}, device {ctx.device}"
        )
        log.info("config: " + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(cfg).items()))
        if url_scheme(cfg.checkpoint.dir):
            log.info(f"checkpoints in {cfg.checkpoint.dir}; the run's own files in the local folder {cfg.output_dir}")
            if ctx.is_main_process:  # for ddpkit checkpoints given this folder: where the checkpoints are
                _record_checkpoints_url(Path(cfg.output_dir), cfg.checkpoint.dir)
        summary = _train(cfg, ctx, export_dir)  # its trainer is gone on return, before the group is left below
        if ctx.is_main_process:
            path = Path(cfg.output_dir) / "summary.json"
            try:
                path.write_text(json.dumps(summary, indent=2) + "\n")
            except OSError as e:
                raise write_error(path, e) from None
            get_logger().info(_final_line(summary))
        return summary
    except Exception as error:
        # Under an elastic agent: record the error with the time it happened, then exit at once
        # without leaving the group, so the peers (which fail because this rank is gone) cannot
        # fail, record and exit before it and be taken for the root cause.
        if record_for_launcher(error) and ctx.world_size > 1:
            exit_process(exit_status(error, 1), leave_group=False)
        raise
    finally:
        for lock in reversed(locks):
            lock.release()
        ddpkit.shutdown()


def _train(cfg: TrainConfig, ctx: Context, export_dir: str) -> dict[str, Any]:
    """Build the run's parts, train, export; the summary.

    The trainer lives in this frame only, so it (and the DDP model's reducer) is freed when this returns,
    while the process group is still registered. Freed after ``ddpkit.shutdown()``, the reducer would
    hold the group's last reference and destroy it holding the GIL, joining gloo's threads, one of which
    may be waiting for the GIL to free the tensors of the last collective: a hang after the run ended
    (5 runs in 20 of ``ddpkit train model=cnn nproc=2 max_steps=4`` on the 2-core VM did).
    """
    spec = get_model_spec(cfg.model)
    with ddpkit.main_process_first(local=True):  # one download per node
        train_set, test_set = load_datasets(cfg.dataset, data_options(cfg))
    trainer = build_trainer(cfg, ctx, spec, train_set, test_set)
    # Every part is ready and the first step begins: the end of start-up (`ddpkit bench startup`).
    trainer.metrics.write("start", world_size=ctx.world_size)
    try:
        summary = trainer.fit()
        if export_dir:
            _export_final(trainer, ctx, export_dir)
        return summary
    finally:
        if trainer.checkpointer is not None:
            trainer.checkpointer.close()


def _launcher_name(ctx: Context) -> str:
    """Who started this worker, as the start-up line names it: ddpkit's own launcher is not torchrun."""
    if ctx.env.source == "torchrun" and FAILURE_DIR_VARIABLE in os.environ:
        return "ddpkit launcher"
    return ctx.env.source


def _record_checkpoints_url(folder: Path, url: str) -> None:
    """Write ``url`` in the run folder's :data:`~ddpkit.train.run_folder.URL_FILE`."""
    path = folder / URL_FILE
    try:
        path.write_text(url.rstrip("/") + "\n")
    except OSError as e:
        raise write_error(path, e) from None


def _lock_run_folder(cfg: TrainConfig, ctx: Context) -> list[FolderLock]:
    """Rank 0 (the process that writes) takes the lock of the run folder, and of checkpoint.dir when that lies
    elsewhere, for the run's life; every rank raises the same one-line error when another run holds one.

    (A collective when world_size > 1: rank 0's outcome is broadcast, so no rank trains on alone.)
    """
    folders = [Path(cfg.output_dir)]
    local = cfg.checkpoint.dir and not url_scheme(cfg.checkpoint.dir)  # a URL's prefix: the Checkpointer's lock
    if local and not Path(cfg.checkpoint.dir).resolve().is_relative_to(folders[0].resolve()):
        folders.append(Path(cfg.checkpoint.dir))
    locks: list[FolderLock] = []
    box = ["", ""]  # (the error's kind, its message)
    if ctx.is_main_process:
        for folder, fix in zip(folders, ("output_dir=...", "checkpoint.dir=...")):
            try:
                locks.append(FolderLock(folder, fix=fix).acquire(lock_wait_seconds(os.environ)))
            except FolderInUseError as e:
                box = ["in use", str(e)]
                break
            except OSError as e:
                box = [
                    "io",
                    f"cannot write to {folder} ({e.strerror or e}); choose a folder this user can write ({fix})",
                ]
                break
    if ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0, device=control_device())
    if box[0]:
        for lock in reversed(locks):
            lock.release()
        raise FolderInUseError(box[1]) if box[0] == "in use" else UserError(box[1])
    return locks


def _with_run_folder(cfg: TrainConfig, ctx: Context) -> TrainConfig:
    """``cfg`` with rank 0's run folder, which rank 0 chooses when no launcher of ddpkit's did.

    On one node every rank has the same ``output_dir`` (the launcher's or the command line's), or none.
    Across nodes ranks may differ (ddpkit's launchers on nodes other than node 0 plan no folder): rank 0's wins.
    """
    cfg = with_remote_checkpoints(cfg)  # a TrainConfig built in code rather than parsed from words
    if cfg.output_dir and ctx.env.is_single_node:
        return cfg
    box = [""]
    if ctx.is_main_process:
        box = [cfg.output_dir or str(claim_run_folder(plan_run_folder(cfg, os.environ)))]
    if ctx.world_size > 1:
        dist.broadcast_object_list(box, src=0, device=control_device())
    return dataclasses.replace(cfg, output_dir=box[0])


def _export_final(trainer: Trainer, ctx: Context, export_dir: str) -> None:
    """Export the trained model: a checkpoint of the final step (collective; none is written if
    the last step has one), then rank 0 writes its export into ``export_dir``."""
    if trainer.checkpointer is None:
        get_logger().warning(f"no export to {export_dir}: checkpoints are off (checkpoint.enabled=false)")
        return
    trainer.checkpointer.set_on_save(None)  # fit() closed metrics.jsonl, which on_save writes to
    final = trainer.checkpointer.save("export")
    trainer.checkpointer.wait()  # complete on disk before it is exported (checkpoint.async_save)
    if final is None:  # checkpoint.on_write_error=continue, and the write failed (its own line said so)
        get_logger().warning(f"no export to {export_dir}: the final checkpoint could not be written")
        return
    if ctx.is_main_process:
        export_checkpoint(final, export_dir, readable_by=trainer.cfg.checkpoint.readable_by)
        get_logger().info(f"exported the model of {final.name} to {export_dir}")


def _final_line(summary: dict[str, Any]) -> str:
    test = summary["test"]
    quality = f"test accuracy {100 * test['accuracy']:.2f}%" if "accuracy" in test else f"test MSE {test['mse']:.5f}"
    return (
        f"done: {summary['model']} on {summary['dataset']}, {summary['world_size']} worker(s), "
        f"{quality}, train time {summary['train_time_s']:.2f}s, {summary['samples_per_s']:,.0f} samples/s; "
        f"run folder {summary['config']['output_dir']}"
    )
