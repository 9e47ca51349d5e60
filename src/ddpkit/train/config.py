"""``ddpkit train``'s options: :class:`TrainConfig` and its checkpoint group, set as key=value words.

No torch: ``ddpkit train --help`` and ``ddpkit slurm`` read this module.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path
from typing import ClassVar

from ddpkit.checkpoint import CheckpointOptions, resume_choice
from ddpkit.keyvalue import (
    GROUP,
    ConfigError,
    check_choice,
    check_count,
    check_positive,
    option,
    option_names,
    parse,
    peek,
)
from ddpkit.launchers.options import LaunchOptions
from ddpkit.names import GRAD_SYNC_MODES, PREEMPTION_SIGNALS, TASKS
from ddpkit.tracking.backends import BACKENDS
from ddpkit.train.storage_url import check_url_options, remote_run_name, url_scheme

RUNS_DIR = Path("runs")
"""Where the run folders go, relative to the current folder (``ddpkit.train.run_folder``)."""
LR_SCHEDULES = ("constant", "step", "cosine", "onecycle")
"""Values of TrainConfig.lr_schedule."""
LOGGERS = ("jsonl", *sorted(set(BACKENDS) - {"jsonl"}))
"""Values of TrainConfig.logger: metrics.jsonl alone, or also one of ddpkit.tracking's backends."""


BEST_METRICS = ("", "auto", "accuracy", "loss", "mse")
"""Values of checkpoint.best_metric: the test metrics ``ddpkit train`` reports (auto: by task; empty: off)."""


@dataclasses.dataclass
class CheckpointConfig(CheckpointOptions):
    """When and where checkpoints are written; set as checkpoint.KEY=VALUE.

    The Checkpointer's own options (:class:`ddpkit.checkpoint.options.CheckpointOptions`: their types,
    defaults, docstrings and checks) plus what only the trainer decides: whether to checkpoint at all,
    the folder's default, and ``auto`` for the best checkpoint. :meth:`for_run` turns it into the
    options the run's Checkpointer is built with.
    """

    key_prefix: ClassVar[str] = "checkpoint."
    best_modes: ClassVar[tuple[str, ...]] = ("auto", "max", "min")
    signal_choices: ClassVar[tuple[str, ...]] = PREEMPTION_SIGNALS  # the ones the command line documents

    best_metric: str = "auto"
    """Test metric that picks the best checkpoint (accuracy, loss, mse; auto: accuracy or mse by task; empty: off)."""
    best_mode: str = "auto"
    """max or min of best_metric (auto: max for accuracy, min otherwise)."""
    enabled: bool = True
    """Write checkpoints (and handle preemption signals); false turns both off."""
    dir: str = ""
    """Folder of the checkpoints; empty means <output_dir>/checkpoints. Every node must see it. A URL
    (s3://BUCKET/PREFIX, or another fsspec store whose library is installed) keeps them in object storage."""

    def check(self) -> None:
        """The Checkpointer's checks, and best_metric among the metrics the trainer reports."""
        super().check()
        check_choice("checkpoint.best_metric", self.best_metric, BEST_METRICS)
        for name in ("every_steps", "keep"):
            check_count(f"checkpoint.{name}", getattr(self, name))

    def for_run(self, quality_metric: str) -> CheckpointOptions:
        """The options of the run's Checkpointer: ``auto`` resolved for a task whose quality metric is
        ``quality_metric``; with ``enabled=false`` nothing is written unless asked (a resume, an export)."""
        metric = self.best_metric if self.best_metric != "auto" else quality_metric
        mode = self.best_mode if self.best_mode != "auto" else ("max" if metric == "accuracy" else "min")
        values = {field.name: getattr(self, field.name) for field in dataclasses.fields(CheckpointOptions)}
        values.update(best_metric=metric, best_mode=mode)
        if not self.enabled:
            values.update(every_steps=0, every_seconds=0.0, on_epoch_end=False, best_metric="", preempt_signals="")
        return CheckpointOptions(**values)


TRAIN_GROUP_TITLES = ("model and data", "optimization", "distributed", "checkpoints", "output")
"""The groups of ``ddpkit train --help``, in their order; each option names its group in its metadata."""


@dataclasses.dataclass
class TrainConfig(LaunchOptions):
    """Everything ``ddpkit train`` needs; every field can be set as key=value (the launch options first)."""

    model: str = option("mlp", group="model and data")
    """Model: mlp, cnn, cnn_bn (cnn with BatchNorm), autoencoder, a registered name, or module:function returning an nn.Module."""
    dataset: str = option("fashion-mnist", group="model and data")
    """Dataset: fashion-mnist, mnist, synthetic, a registered name, or module:function returning (train, test)."""
    task: str = option("auto", group="model and data")
    """classification (cross-entropy, accuracy), regression (MSE to the target), reconstruction (MSE to the input);
    auto: the model's registered task, else classification."""
    loss: str = option("", group="model and data")
    """module:function(output, batch) returning the per-sample losses, instead of the task's loss."""
    num_workers: int = option(0, group="model and data", counted=True)
    """DataLoader worker processes per training worker (0: load in the training process)."""
    data_dir: str = option("", group="model and data")
    """Folder holding the dataset's IDX files; empty searches $DDPKIT_DATA_DIR, ~/.cache/ddpkit/<dataset> and /usr/share/datasets/<dataset>, then downloads."""
    download: bool = option(True, group="model and data")
    """Download the dataset from its official mirrors when it is found nowhere."""
    data_mirror: str = option("", group="model and data")
    """A base URL tried before the official mirrors (e.g. a local copy of them)."""
    synthetic_samples: int = option(60000, group="model and data", counted=True)
    """Number of training samples of the synthetic dataset (test set: one sixth)."""
    epochs: int = option(5, group="optimization", counted=True)
    """Number of passes over the training set."""
    batch_size: int = option(64, group="optimization", counted=True)
    """Batch size: global (split across workers) or per worker, see batch_scope."""
    batch_scope: str = option("global", group="optimization")
    """global: batch_size is the global batch; per_worker: each worker takes batch_size."""
    optimizer: str = option("adam", group="optimization")
    """adam or sgd (with momentum)."""
    lr: float = option(1e-3, group="optimization")
    """Learning rate (before scale_lr)."""
    momentum: float = option(0.0, group="optimization")
    """SGD momentum."""
    lr_schedule: str = option("constant", group="optimization")
    """constant, step (times lr_gamma every lr_step_epochs), cosine (to 0 at the end) or onecycle."""
    warmup_steps: int = option(0, group="optimization", counted=True)
    """Optimizer steps of linear warm-up from lr/100 to lr before the schedule."""
    lr_step_epochs: int = option(1, group="optimization", counted=True)
    """Epochs between two decays of lr_schedule=step."""
    lr_gamma: float = option(0.1, group="optimization")
    """Factor of each decay of lr_schedule=step."""
    weight_decay: float = option(0.0, group="optimization")
    """L2 weight decay."""
    scale_lr: bool = option(False, group="optimization")
    """Multiply lr by the number of workers (linear scaling rule)."""
    grad_accum_steps: int = option(1, group="optimization", counted=True)
    """Micro-batches accumulated per optimizer step (gradients synchronised once, via no_sync)."""
    precision: str = option("fp32", group="optimization")
    """fp32, or bf16 / fp16 mixed precision (autocast; fp16 uses a gradient scaler on CUDA)."""
    sync_batchnorm: bool = option(False, group="distributed")
    """Convert BatchNorm layers to SyncBatchNorm."""
    seed: int = option(0, group="optimization")
    """Seed of the model initialisation and of the global sample order."""
    backend: str = option("auto", group="distributed")
    """Process-group backend: auto (gloo on CPU, nccl on CUDA), gloo, nccl, or cpu:gloo,cuda:nccl."""
    device: str = option("auto", group="distributed")
    """auto (CUDA when available, bound to the local rank), cpu or cuda."""
    allreduce: str = option("auto", group="distributed")
    """Gradient all_reduce: auto (CPU: shm on one node, hierarchical across nodes with several workers per node;
    else builtin), builtin, shm, hierarchical, ring, ..."""
    grad_sync: str = option("auto", group="distributed")
    """auto (flat with allreduce shm, and for gradients <= 1 MiB; else ddp), ddp (DistributedDataParallel with the
    all_reduce as its hook), flat (one all_reduce of all gradients after backward) or manual (per-parameter
    all_reduce)."""
    shard: bool = option(False, group="distributed")
    """Shard parameters, gradients and optimizer state over the workers (torch's FSDP2 on the model's repeated
    blocks): for models larger than one device; checkpoints are written by every worker, export gives full weights."""
    timeout: float = option(300.0, group="distributed")
    """Seconds a collective or the rendezvous may wait for a peer before failing."""
    threads: int = option(0, group="distributed", counted=True)
    """Torch threads per worker; 0 shares this machine's cores among the local workers."""
    output_dir: str = option("", group="output")
    """Folder of this run (metrics.jsonl, summary.json, checkpoints/); empty: a new folder
    runs/<model>-<dataset>/<date-time> (runs/<model>-<dataset>/slurm-<job id> in a Slurm job), which
    runs/latest points to; with resume=auto, the newest run of this model and dataset. A URL (s3://BUCKET/PREFIX):
    the checkpoints go to <URL>/checkpoints and the run's other files to the local folder runs/<BUCKET>/<PREFIX>."""
    log_every: int = option(50, group="output", counted=True)
    """Optimizer steps between metric lines (metrics.jsonl) and progress-bar updates."""
    logger: str = option("jsonl", group="output")
    """jsonl (metrics.jsonl only), or also an experiment tracker, continued on resume: csv (<output_dir>/metrics.csv),
    tensorboard (event files in <output_dir>/tensorboard), mlflow (a run in $MLFLOW_TRACKING_URI, else
    sqlite:///<output_dir>/mlflow.db) or wandb (offline unless $WANDB_MODE says otherwise; <output_dir>/wandb);
    pip install ddpkit[tensorboard|mlflow|wandb]."""
    progress: bool = option(True, group="output")
    """Show a progress bar on rank 0."""
    eval_every_epoch: bool = option(True, group="output")
    """Evaluate on the test set after every epoch (always after the last)."""
    eval_train: bool = option(False, group="output")
    """Also evaluate on the whole training set at the end (as long as an epoch of forward passes)."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig, metadata={GROUP: "checkpoints"})
    """Checkpoint cadence, folder, retention, best checkpoint and preemption (checkpoint.KEY=VALUE)."""
    resume: str = option("never", group="checkpoints")
    """never (start fresh), auto (the newest complete, verified checkpoint) or the path of one checkpoint;
    true means auto, false never."""
    max_steps: int = option(0, group="optimization", counted=True)
    """Stop after this many optimizer steps in total, with a checkpoint (0: train all epochs)."""
    init_from: str = option("", group="model and data")
    """Start from the weights of this checkpoint or export (matching names and shapes; the rest is reported)."""
    freeze: str = option("", group="model and data")
    """Comma-separated parameter name prefixes not to train, e.g. freeze=0,2 or freeze=encoder."""

    def __post_init__(self) -> None:
        check_choice("batch_scope", self.batch_scope, ("global", "per_worker"))
        check_choice("optimizer", self.optimizer, ("adam", "sgd"))
        check_choice("precision", self.precision, ("fp32", "bf16", "fp16"))
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("grad_sync", self.grad_sync, GRAD_SYNC_MODES)
        check_choice("task", self.task, ("auto", *TASKS))
        check_choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        check_choice("logger", self.logger, LOGGERS)
        check_positive("num_workers", self.num_workers, allow_zero=True)
        check_positive("warmup_steps", self.warmup_steps, allow_zero=True)
        check_positive("lr_step_epochs", self.lr_step_epochs)
        check_positive("lr_gamma", self.lr_gamma)
        for name in ("epochs", "batch_size", "grad_accum_steps", "log_every", "synthetic_samples"):
            check_positive(name, getattr(self, name))
        for name in ("lr", "timeout"):
            check_positive(name, getattr(self, name))
        check_positive("momentum", self.momentum, allow_zero=True)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("threads", self.threads, allow_zero=True)
        check_positive("max_steps", self.max_steps, allow_zero=True)
        super().__post_init__()  # the launch options' checks, and every counted option's limit
        self.resume = resume_choice(self.resume)
        if not self.resume:
            raise ConfigError("resume='' is not valid; use resume=never, resume=auto or resume=PATH of a checkpoint")
        places = ("output_dir", "data_dir", "init_from", "resume")
        check_url_options(
            {
                **{name: getattr(self, name) for name in places},
                "checkpoint.dir": self.checkpoint.dir,
                "checkpoint.cache": self.checkpoint.cache,
            }
        )


def local_run_folder(url: str) -> Path:
    """The local folder of the run files of a run whose ``output_dir`` is ``url``: runs/<bucket>/<prefix>."""
    return RUNS_DIR / remote_run_name(url)


def with_remote_checkpoints(cfg: TrainConfig) -> TrainConfig:
    """``cfg`` with an ``output_dir`` URL split: the checkpoints at ``<URL>/checkpoints`` (unless ``checkpoint.dir``
    names a place), the run's own files (logs, metrics.jsonl, summary.json, trackers) in ``runs/<bucket>/<prefix>``.

    Those files are appended to line by line and read by local tools (``ddpkit plot``, TensorBoard): they stay
    on this machine, and only the checkpoints, which a restart on another machine needs, go to the store.
    The same URL always gives the same local folder, so the same command run again continues the run.
    """
    if not url_scheme(cfg.output_dir):
        return cfg
    checkpoints = cfg.checkpoint.dir or cfg.output_dir.rstrip("/") + "/checkpoints"
    return dataclasses.replace(
        cfg,
        output_dir=str(local_run_folder(cfg.output_dir)),
        checkpoint=dataclasses.replace(cfg.checkpoint, dir=checkpoints),
    )


def parse_train_config(args: Sequence[str]) -> TrainConfig:
    """TrainConfig from words, with the chosen model's recipe as defaults; an ``output_dir`` URL split into
    ``checkpoint.dir`` there and a local run folder (:func:`with_remote_checkpoints`)."""
    from ddpkit import get_model_spec  # deferred: the registry imports torch

    model = peek(args, "model", TrainConfig) or TrainConfig.model
    return with_remote_checkpoints(parse(TrainConfig, args, presets=dict(get_model_spec(model).recipe)))


TRAIN_OPTION_GROUPS = tuple((title, option_names(TrainConfig, group=title)) for title in TRAIN_GROUP_TITLES)
"""The groups of ``ddpkit train --help``: (title, the options that name it), read from the fields' metadata."""
