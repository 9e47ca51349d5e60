"""Typed configuration: dataclass schemas overridden by YAML files and key=value words.

One mechanism everywhere (OmegaConf structured configs): a schema dataclass
gives every field a type, a default and a docstring; YAML files and
``key=value`` words from the command line are merged on top, in the order
given, and validated against the schema. Dotted keys reach nested groups
(``checkpoint.every_steps=100``).

A ``key=value`` word's value is read by the option's type, not as YAML
(``--help`` says it: :data:`ddpkit.command_help.VALUE_RULE`): text options take the value exactly as written
(``output_dir=out #1`` is the folder "out #1", ``time=2:00:00`` stays text),
whole numbers, numbers and true/false are converted, a list option takes
comma-separated values. ``${...}`` is never filled in, on the command line or
in a YAML file: a value is what the user wrote, so no environment variable
(a secret) reaches an option or an error line unasked.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import typing
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException, ValidationError

from ddpkit import errors
from ddpkit.checkpoint import CheckpointOptions, resume_choice
from ddpkit.errors import UserError
from ddpkit.names import GRAD_SYNC_MODES, PREEMPTION_SIGNALS, TASKS
from ddpkit.tracking.backends import BACKENDS

T = TypeVar("T")
_INTEGER = re.compile(r"[-+]?\d+")
_INTERPOLATION = re.compile(r"(\\*)\$\{")
_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


class ConfigError(UserError):
    """A configuration word or file is invalid; the message names it and the fix."""


def parse(
    schema: type[T],
    args: Sequence[str],
    presets: Mapping[str, Any] | None = None,
) -> T:
    """Build a ``schema`` instance from YAML files and ``key=value`` words.

    Args:
        schema: a dataclass type whose fields all have defaults.
        args: words from the command line: ``key=value`` overrides, or paths of
            YAML files (ending in .yaml or .yml), merged in the order given.
        presets: values merged between the schema defaults and ``args``.

    Returns:
        The validated configuration as a ``schema`` instance.

    Raises:
        ConfigError: unknown key, bad value or unreadable file.
    """
    merged = OmegaConf.structured(schema)
    layers = [("presets", dict(presets or {}))] + [(word, _read_layer(word, schema)) for word in args]
    for word, layer in layers:
        _check_groups(word, layer, schema)
        try:
            merged = OmegaConf.merge(merged, layer)
        except OmegaConfBaseException as e:
            raise ConfigError(_explain(e, schema, word)) from None
    _check_finite(merged, schema)  # before the dataclasses' own checks, which compare (NaN passes any bound)
    try:
        return OmegaConf.to_object(merged)  # validates (every ${ was escaped: nothing is filled in)
    except OmegaConfBaseException as e:
        raise ConfigError(_explain(e, schema, "")) from None
    except UserError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(str(e)) from None  # the check of a group the core declares (CheckpointOptions)


def _check_finite(merged: DictConfig, schema: type, prefix: str = "") -> None:
    """Raise ConfigError at the first number option of every command that is NaN or infinite.

    YAML reads ``nan``, ``inf`` and ``.inf`` as floats, and every comparison with NaN is false, so
    a NaN would pass each option's own bound (``lr > 0``) and reach torch.
    """
    for field in dataclasses.fields(schema):
        if field.name not in merged:
            continue
        kind = _field_type(schema, field.name)
        if dataclasses.is_dataclass(kind):
            _check_finite(merged[field.name], kind, f"{prefix}{field.name}.")
        elif kind is float:
            try:
                value = merged[field.name]
            except OmegaConfBaseException:
                continue  # an interpolation that does not resolve: to_object names it
            if isinstance(value, float):
                errors.check_finite(prefix + field.name, value, ConfigError)


def peek(args: Sequence[str], key: str, schema: type | None = None) -> str | None:
    """The last value given for ``key`` by ``args`` (words or YAML files), if any, as text.

    Args:
        schema: the command's options, which its messages name (a word that is not key=value).
    """
    value = None
    for word in args:
        layer = OmegaConf.create(_read_layer(word, schema))
        found = OmegaConf.select(layer, key, default=None, throw_on_resolution_failure=False)
        if found is not None:
            value = str(found)
    return value


def to_dict(config: Any) -> dict[str, Any]:
    """A plain, JSON-serialisable dict of a config dataclass."""
    return dataclasses.asdict(config)


def to_yaml(config: Any) -> str:
    """The config as YAML text, as printed at start and stored with checkpoints."""
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def _read_layer(word: str, schema: type | None) -> dict[str, Any]:
    """The options one word gives: a YAML file's, or a ``key=value`` word's (read by ``schema``'s types; text
    where ``schema`` is None), with every ``${`` escaped so that OmegaConf fills nothing in."""
    if word.endswith((".yaml", ".yml")) and "=" not in word:
        if not os.path.isfile(word):
            raise ConfigError(f"config file {word!r} does not exist; pass an existing YAML file or key=value words")
        try:
            loaded = OmegaConf.load(word)
        except Exception as e:  # YAML syntax errors come in several types
            raise ConfigError(f"config file {word!r} is not valid YAML: {e}".splitlines()[0]) from None
        if not isinstance(loaded, DictConfig):
            raise ConfigError(
                f"config file {word!r} holds a list, not options; write one option per line as "
                "key: value, e.g. epochs: 5"
            )
        return _escaped(OmegaConf.to_container(loaded, resolve=False))
    if "=" not in word:
        raise ConfigError(
            f"{word!r} is neither key=value nor a .yaml file; write it as key=value, e.g. {_first_key(schema)}"
        )
    key, raw = word.split("=", 1)
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"{word!r} has an empty key; write it as key=value, e.g. {_first_key(schema)}")
    value = _escaped(_typed_value(word, raw, _field_type(schema, key) if schema is not None else str, schema))
    layer: dict[str, Any] = {}
    *groups, name = key.split(".")
    leaf = layer
    for group in groups:
        leaf = leaf.setdefault(group, {})
    leaf[name] = value
    return layer


def _first_key(schema: type | None) -> str:
    """``key=DEFAULT`` of the schema's first option, for the messages that show how a word is written."""
    if schema is None or not dataclasses.is_dataclass(schema):
        return "key=value"
    return _example(schema, _field_names(schema)[0])


def _typed_value(word: str, raw: str, kind: Any, schema: type | None) -> Any:
    """``raw`` converted to the option's type ``kind`` (see the module docstring); text for a group or an unknown key, whose
    merge names the problem."""
    if typing.get_origin(kind) is list:
        (item,) = typing.get_args(kind) or (str,)
        text = raw.strip()
        if text.startswith("[") and text.endswith("]"):
            text = text[1:-1]  # workers=[0,1], as YAML writes a list
        return [_typed_value(word, part.strip(), item, schema) for part in text.split(",")] if text.strip() else []
    if kind is not bool and bool in typing.get_args(kind):  # a Literal's word or a bool: checkpoint.async_save=auto
        words = [word for arg in typing.get_args(kind) for word in typing.get_args(arg)]
        if raw.strip() in words:
            return raw.strip()
        if raw.strip().lower() not in _TRUE + _FALSE:
            choices = ", ".join([*words, "true", "false"])
            raise ConfigError(f"{word.split('=', 1)[0]}={raw!r} is not valid; choose one of: {choices}")
        kind = bool
    if kind is bool:
        if raw.strip().lower() in _TRUE + _FALSE:
            return raw.strip().lower() in _TRUE
    elif kind is int:
        if _INTEGER.fullmatch(raw.strip()):
            return int(raw.strip())
    elif kind is float:
        try:
            # YAML's .inf and .nan too, so that the finite check names them (lr=.nan)
            return float(raw.strip().lower().replace(".inf", "inf").replace(".nan", "nan"))
        except ValueError:
            pass
    else:
        return raw
    key = word.split("=", 1)[0]
    example = _example(schema, key) if schema is not None else f"{key}=..."
    raise ConfigError(f"bad value for {key!r}: {key} must be {_TYPE_WORDS[kind]}, e.g. {example} (given {word!r})")


def _escaped(value: Any) -> Any:
    """``value`` with every ``${`` of its text (in lists and mappings too) escaped for OmegaConf: kept as written."""
    if isinstance(value, str):
        return _INTERPOLATION.sub(lambda m: m.group(1) * 2 + "\\${", value)
    if isinstance(value, list):
        return [_escaped(item) for item in value]
    if isinstance(value, dict):
        return {key: _escaped(item) for key, item in value.items()}
    return value


def _explain(error: OmegaConfBaseException, schema: type, word: str) -> str:
    key = getattr(error, "full_key", None) or ""
    message = str(error).splitlines()[0]
    if "not in struct" in message or "Key '" in message and "not in" in message:
        valid = _field_names(schema)
        close = difflib.get_close_matches(key.split(".")[-1], [v.split(".")[-1] for v in valid], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        return f"unknown config key {key!r}{hint}; valid keys: {', '.join(valid)}"
    expected = _field_type(schema, key)
    if isinstance(error, ValidationError) and expected in _TYPE_WORDS:
        given = f" (given {word!r})" if "=" in word else f" (given in {word})" if word else f" ({message})"
        return f"bad value for {key!r}: {key} must be {_TYPE_WORDS[expected]}, e.g. {_example(schema, key)}{given}"
    return f"bad value for {key!r}: {message}"


_TYPE_WORDS = {int: "a whole number", float: "a number", bool: "true or false", str: "a text value"}
"""How a type error names the type a key takes."""


def _field_type(schema: type, key: str) -> Any:
    """The type of the dotted ``key`` in ``schema`` (a dataclass type for a group), or None if it has none."""
    for part in key.split("."):
        hints = typing.get_type_hints(schema) if dataclasses.is_dataclass(schema) else {}
        if part not in hints:
            return None
        schema = hints[part]
    return schema


def _example(schema: type, key: str) -> str:
    """``key=DEFAULT``, the default written as a word (bools as true/false)."""
    value: Any = schema()
    for part in key.split("."):
        value = getattr(value, part)
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"{key}={text}" if text else f"{key}=NAME"


def _check_groups(word: str, layer: Mapping[str, Any], schema: type, prefix: str = "") -> None:
    """Raise ConfigError where ``layer`` gives a group of options (``checkpoint``) a single value."""
    for name, value in layer.items():
        expected = _field_type(schema, prefix + str(name))
        if dataclasses.is_dataclass(expected) and not isinstance(value, Mapping):
            group = prefix + str(name)
            example = _example(schema, f"{group}.{dataclasses.fields(expected)[0].name}")
            raise ConfigError(
                f"{group} is a group of options, not a value ({word!r}); set one of its keys as "
                f"{group}.KEY=VALUE, e.g. {example}"
            )
        if dataclasses.is_dataclass(expected):
            _check_groups(word, value, schema, f"{prefix}{name}.")


def _field_names(schema: type, prefix: str = "") -> list[str]:
    names = []
    for field in dataclasses.fields(schema):
        if dataclasses.is_dataclass(field.type) or (
            isinstance(field.default_factory, type) and dataclasses.is_dataclass(field.default_factory)
        ):
            nested = field.default_factory if field.default_factory is not dataclasses.MISSING else field.type
            names += _field_names(nested, f"{prefix}{field.name}.")
        else:
            names.append(prefix + field.name)
    return names


LR_SCHEDULES = ("constant", "step", "cosine", "onecycle")
"""Values of TrainConfig.lr_schedule."""
LOGGERS = ("jsonl", *sorted(set(BACKENDS) - {"jsonl"}))
"""Values of TrainConfig.logger: metrics.jsonl alone, or also one of ddpkit.tracking's backends."""


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise ConfigError unless ``value`` is one of ``choices``."""
    errors.check_choice(name, value, choices, ConfigError)


def check_positive(name: str, value: float, allow_zero: bool = False) -> None:
    """Raise ConfigError unless ``value`` > 0 (or >= 0 with ``allow_zero``)."""
    errors.check_positive(name, value, allow_zero, ConfigError)


COUNT_LIMIT = 1_000_000_000
"""The most an option that counts work (epochs, steps, samples, workers) may ask: a billion epochs or steps
never end, and numbers beyond it (a 23-digit epochs=) only make the run's sums spin before it starts."""

COUNTS = (
    "epochs",
    "max_steps",
    "warmup_steps",
    "lr_step_epochs",
    "log_every",
    "synthetic_samples",
    "batch_size",
    "grad_accum_steps",
    "nproc",
    "nnodes",
    "num_workers",
    "threads",
    "max_restarts",
)
"""The TrainConfig options held to COUNT_LIMIT."""


def check_count(name: str, value: int) -> None:
    """Raise ConfigError when ``value`` exceeds COUNT_LIMIT."""
    if value > COUNT_LIMIT:
        raise ConfigError(
            f"{name}={value} is more than any run can do; use at most {COUNT_LIMIT} (max_steps=N stops a long run)"
        )


def shown_ranks(show_ranks: str) -> frozenset[int] | None:
    """The ranks ``show_ranks`` names: None for ``all``, else the comma-separated ranks (``0``, ``0,2``).

    Raises:
        ConfigError: anything else.
    """
    text = show_ranks.strip().lower()
    if text == "all":
        return None
    words = [word.strip() for word in text.split(",")]
    if not all(word.isdigit() for word in words):
        raise ConfigError(
            f"show_ranks={show_ranks!r} is not valid; use show_ranks=all, one rank (show_ranks=0) "
            "or a list (show_ranks=0,1)"
        )
    return frozenset(int(word) for word in words)


def describe_ranks(ranks: frozenset[int] | None) -> str:
    """'rank 0', 'ranks 0, 2' or 'every rank': what the console shows, for the lines that say so."""
    if ranks is None:
        return "every rank"
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, sorted(ranks)))


def check_port(master_port: int) -> None:
    """Raise ConfigError unless ``master_port`` is a TCP port or 0 (a free one)."""
    if not 0 <= master_port <= 65535:
        raise ConfigError(f"master_port={master_port} is not a TCP port; use 1-65535, or 0 for a free one")


def check_nodes(nnodes: int, node_rank: int, master_addr: str, master_port: int) -> None:
    """Raise ConfigError unless the options of a launch on ``nnodes`` machines fit together."""
    check_positive("nnodes", nnodes)
    check_port(master_port)
    if not 0 <= node_rank < nnodes:
        raise ConfigError(
            f"node_rank={node_rank} is not valid for nnodes={nnodes}; use 0 to {nnodes - 1}, 0 on the master"
        )
    if nnodes > 1 and not master_addr:
        raise ConfigError(
            f"nnodes={nnodes} needs master_addr=HOST, the host name or address of node 0 (its "
            "container name in a container network), the same on every node"
        )
    if nnodes > 1 and not master_port:
        raise ConfigError(
            f"nnodes={nnodes} needs master_port=PORT, a free TCP port on node 0, the same on every "
            "node (e.g. master_port=29500)"
        )


BEST_METRICS = ("", "auto", "accuracy", "loss", "mse")
"""Values of checkpoint.best_metric: the test metrics ``ddpkit train`` reports (auto: by task; empty: off)."""


@dataclasses.dataclass
class CheckpointConfig(CheckpointOptions):
    """When and where checkpoints are written; set as checkpoint.KEY=VALUE.

    The Checkpointer's own options (:class:`ddpkit.checkpoint.CheckpointOptions`: their types,
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
    """Folder of the checkpoints; empty means <output_dir>/checkpoints. Every node must see it."""

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


SHOW_RANKS_DEFAULT = "0"
"""The workers whose output ``ddpkit train`` and ``ddpkit run`` show: rank 0 (README, "Your own script")."""

TRAIN_OPTION_GROUPS = (
    (
        "model and data",
        (
            "model",
            "dataset",
            "task",
            "loss",
            "data_dir",
            "download",
            "data_mirror",
            "synthetic_samples",
            "num_workers",
            "init_from",
            "freeze",
        ),
    ),
    (
        "optimization",
        (
            "epochs",
            "max_steps",
            "batch_size",
            "batch_scope",
            "optimizer",
            "lr",
            "momentum",
            "lr_schedule",
            "warmup_steps",
            "lr_step_epochs",
            "lr_gamma",
            "weight_decay",
            "scale_lr",
            "grad_accum_steps",
            "precision",
            "seed",
        ),
    ),
    (
        "distributed",
        (
            "nproc",
            "nnodes",
            "node_rank",
            "master_addr",
            "master_port",
            "backend",
            "device",
            "allreduce",
            "grad_sync",
            "sync_batchnorm",
            "shard",
            "timeout",
            "threads",
            "max_restarts",
        ),
    ),
    ("checkpoints", ("checkpoint", "resume")),
    ("output", ("output_dir", "show_ranks", "log_every", "logger", "progress", "eval_every_epoch", "eval_train")),
)
"""The groups of ``ddpkit train --help`` (a field in none is listed under "other options")."""


@dataclasses.dataclass
class TrainConfig:
    """Everything ``ddpkit train`` needs; every field can be set as key=value."""

    model: str = "mlp"
    """Model: mlp, cnn, cnn_bn (cnn with BatchNorm), autoencoder, a registered name, or module:function returning an nn.Module."""
    dataset: str = "fashion-mnist"
    """Dataset: fashion-mnist, mnist, synthetic, a registered name, or module:function returning (train, test)."""
    task: str = "auto"
    """classification (cross-entropy, accuracy), regression (MSE to the target), reconstruction (MSE to the input);
    auto: the model's registered task, else classification."""
    loss: str = ""
    """module:function(output, batch) returning the per-sample losses, instead of the task's loss."""
    num_workers: int = 0
    """DataLoader worker processes per training worker (0: load in the training process)."""
    data_dir: str = ""
    """Folder holding the dataset's IDX files; empty searches the usual places (see README)."""
    download: bool = True
    """Download the dataset from its official mirrors when it is found nowhere."""
    data_mirror: str = ""
    """A base URL tried before the official mirrors (e.g. a local copy of them)."""
    synthetic_samples: int = 60000
    """Number of training samples of the synthetic dataset (test set: one sixth)."""
    epochs: int = 5
    """Number of passes over the training set."""
    batch_size: int = 64
    """Batch size: global (split across workers) or per worker, see batch_scope."""
    batch_scope: str = "global"
    """global: batch_size is the global batch; per_worker: each worker takes batch_size."""
    optimizer: str = "adam"
    """adam or sgd (with momentum)."""
    lr: float = 1e-3
    """Learning rate (before scale_lr)."""
    momentum: float = 0.0
    """SGD momentum."""
    lr_schedule: str = "constant"
    """constant, step (times lr_gamma every lr_step_epochs), cosine (to 0 at the end) or onecycle."""
    warmup_steps: int = 0
    """Optimizer steps of linear warm-up from lr/100 to lr before the schedule."""
    lr_step_epochs: int = 1
    """Epochs between two decays of lr_schedule=step."""
    lr_gamma: float = 0.1
    """Factor of each decay of lr_schedule=step."""
    weight_decay: float = 0.0
    """L2 weight decay."""
    scale_lr: bool = False
    """Multiply lr by the number of workers (linear scaling rule)."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (gradients synchronised once, via no_sync)."""
    precision: str = "fp32"
    """fp32, or bf16 / fp16 mixed precision (autocast; fp16 uses a gradient scaler on CUDA)."""
    sync_batchnorm: bool = False
    """Convert BatchNorm layers to SyncBatchNorm."""
    seed: int = 0
    """Seed of the model initialisation and of the global sample order."""
    nproc: int = 1
    """Workers to start on this machine; ignored when started by torchrun, srun or mpirun."""
    nnodes: int = 1
    """Machines (or containers) of the job, each running this command with its node_rank; ignored under
    torchrun, srun or mpirun."""
    node_rank: int = 0
    """This machine's index among the nnodes, 0 on the master."""
    master_addr: str = ""
    """With nnodes > 1: host name or address of node 0 (e.g. its container name), the same on every node."""
    backend: str = "auto"
    """Process-group backend: auto (gloo on CPU, nccl on CUDA), gloo, nccl, or cpu:gloo,cuda:nccl."""
    device: str = "auto"
    """auto (CUDA when available, bound to the local rank), cpu or cuda."""
    allreduce: str = "auto"
    """Gradient all_reduce: auto (CPU: shm on one node, hierarchical across nodes with several workers per node;
    else builtin), builtin, shm, hierarchical, ring, ..."""
    grad_sync: str = "auto"
    """auto (flat with allreduce shm, and for gradients <= 1 MiB; else ddp), ddp (DistributedDataParallel with the
    all_reduce as its hook), flat (one all_reduce of all gradients after backward) or manual (per-parameter
    all_reduce)."""
    shard: bool = False
    """Shard parameters, gradients and optimizer state over the workers (torch's FSDP2 on the model's repeated
    blocks): for models larger than one device; checkpoints are written by every worker, export gives full weights."""
    timeout: float = 300.0
    """Seconds a collective or the rendezvous may wait for a peer before failing."""
    threads: int = 0
    """Torch threads per worker; 0 shares this machine's cores among the local workers."""
    master_port: int = 0
    """Rendezvous port on node 0; 0 asks the OS for a free one (one node only: nnodes > 1 needs a port)."""
    output_dir: str = ""
    """Folder of this run (metrics.jsonl, summary.json, checkpoints/); empty: a new folder
    runs/<model>-<dataset>/<date-time> (runs/<model>-<dataset>/slurm-<job id> in a Slurm job), which
    runs/latest points to; with resume=auto, the newest run of this model and dataset."""
    show_ranks: str = SHOW_RANKS_DEFAULT
    """Workers whose output this console shows, each line prefixed [rank r/w]: 0 (rank 0, which speaks for the
    run), a list (0,1) or all; every rank's whole stdout and stderr are in <output_dir>/logs/<date-time>/
    rank-N.stdout.log and rank-N.stderr.log either way, a folder per launch (nproc workers here only)."""
    log_every: int = 50
    """Optimizer steps between metric lines (metrics.jsonl) and progress-bar updates."""
    logger: str = "jsonl"
    """jsonl (metrics.jsonl only), or also an experiment tracker, continued on resume: csv (<output_dir>/metrics.csv),
    tensorboard (event files in <output_dir>/tensorboard), mlflow (a run in $MLFLOW_TRACKING_URI, else
    sqlite:///<output_dir>/mlflow.db) or wandb (offline unless $WANDB_MODE says otherwise; <output_dir>/wandb);
    pip install ddpkit[tensorboard|mlflow|wandb]."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    eval_every_epoch: bool = True
    """Evaluate on the test set after every epoch (always after the last)."""
    eval_train: bool = False
    """Also evaluate on the whole training set at the end (as long as an epoch of forward passes)."""
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    """Checkpoint cadence, folder, retention, best checkpoint and preemption (checkpoint.KEY=VALUE)."""
    resume: str = "never"
    """never (start fresh), auto (the newest complete, verified checkpoint) or the path of one checkpoint;
    true means auto, false never."""
    max_steps: int = 0
    """Stop after this many optimizer steps in total, with a checkpoint (0: train all epochs)."""
    max_restarts: int = 0
    """Times the workers are restarted (from the latest checkpoint) after one fails; nproc workers here only."""
    init_from: str = ""
    """Start from the weights of this checkpoint or export (matching names and shapes; the rest is reported)."""
    freeze: str = ""
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
        for name in ("epochs", "batch_size", "grad_accum_steps", "nproc", "log_every", "synthetic_samples"):
            check_positive(name, getattr(self, name))
        for name in ("lr", "timeout"):
            check_positive(name, getattr(self, name))
        check_positive("momentum", self.momentum, allow_zero=True)
        check_positive("weight_decay", self.weight_decay, allow_zero=True)
        check_positive("threads", self.threads, allow_zero=True)
        check_positive("max_steps", self.max_steps, allow_zero=True)
        check_positive("max_restarts", self.max_restarts, allow_zero=True)
        for name in COUNTS:
            check_count(name, getattr(self, name))
        self.resume = resume_choice(self.resume)
        if not self.resume:
            raise ConfigError("resume='' is not valid; use resume=never, resume=auto or resume=PATH of a checkpoint")
        check_nodes(self.nnodes, self.node_rank, self.master_addr, self.master_port)
        shown_ranks(self.show_ranks)


def parse_train_config(args: Sequence[str]) -> TrainConfig:
    """TrainConfig from words, with the chosen model's recipe as defaults."""
    from ddpkit.models.registry import get_model_spec  # deferred: the registry imports torch

    model = peek(args, "model", TrainConfig) or TrainConfig.model
    return parse(TrainConfig, args, presets=dict(get_model_spec(model).recipe))
