"""``ddpkit train``: the built-in trainer, as nproc workers here or as one worker of a torchrun, srun or mpirun job.

The trainer itself is :mod:`ddpkit.train`; this module reads the words, plans the run folder, launches the
workers and says how the run ended (and how to continue it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from ddpkit.commands.help import CommandHelp
from ddpkit.commands.launching import (
    environ_set,
    exit_statuses,
    failed_status,
    launch,
    launch_spec,
    quiet_cpp_logs,
    warn_if_oversubscribed,
)
from ddpkit.keyvalue import peek
from ddpkit.launchers.failure import LaunchError
from ddpkit.names import EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PREEMPTED, EXIT_USER_ERROR
from ddpkit.train.config import TRAIN_OPTION_GROUPS, TrainConfig, parse_train_config
from ddpkit.train.storage_url import url_scheme

TRAIN_EXIT_STATUSES = exit_statuses(
    "the last line prints the command that continues: the same words with output_dir=<the run's folder> resume=auto "
    "(without output_dir, the same command starts a new run; resume=auto alone continues the newest run of this "
    "model and data)"
)


TRAIN_HELP = CommandHelp(
    usage="ddpkit train [key=value ...] [config.yaml ...]",
    summary="Train a model data-parallel: nproc=N workers on this machine, or one worker of a torchrun, "
    "srun or mpirun job (detected; there the launcher's own options replace nproc, nnodes, node_rank, master_addr, "
    "master_port and max_restarts). YAML files and key=value words are merged in the order given; "
    "the model's recipe sets the defaults of some options (lr, epochs...). The run writes "
    "metrics.jsonl, summary.json and checkpoints into its own folder runs/<model>-<dataset>/<time> "
    "(runs/latest points to it).",
    schema="ddpkit.train.config:TrainConfig",
    groups=TRAIN_OPTION_GROUPS,
    examples=(
        "ddpkit train nproc=2                          # the MLP on Fashion-MNIST, 2 workers",
        "ddpkit train model=cnn epochs=1 nproc=2 checkpoint.every_steps=200",
        "ddpkit train nproc=2 resume=auto             # continue the latest run of this model and data",
        "torchrun --nproc-per-node 2 -m ddpkit train",
    ),
    exit_statuses=TRAIN_EXIT_STATUSES,
)


def _say_restarts_are_the_launchers(max_restarts: int) -> None:
    """One line (rank 0): ``max_restarts`` is ddpkit's launcher's; this worker's launcher restarts by its own option.

    Otherwise a job script passing ``max_restarts=1`` to the workers of torchrun, srun or mpirun would run
    without the restarts it asked for, and say nothing.
    """
    from ddpkit.env.detect import detect_environment

    env = detect_environment(os.environ)
    if env.rank == 0:
        print(
            f"ddpkit: warning: max_restarts={max_restarts} is for ddpkit's own launcher and does nothing in a worker "
            f"that {env.source} started; restarts are the launcher's (torchrun --max-restarts {max_restarts}; srun "
            "and mpirun restart none: ddpkit slurm launch=torchrun max_restarts=N writes the torchrun line)",
            file=sys.stderr,
            flush=True,
        )


def train_command(args: Sequence[str]) -> int:
    """``ddpkit train``: run here as one worker of a launched job, or start nproc workers."""
    from ddpkit.env.detect import detect_environment
    from ddpkit.env.sagemaker import key_value_words, train_words
    from ddpkit.launchers.server import worker_server

    # Inside SageMaker: its folders and hyperparameters first, then the arguments, --key value accepted.
    words = train_words(os.environ) + key_value_words(os.environ, args)
    source = detect_environment(os.environ).source
    elastic = ":" in (peek(words, "nnodes") or "")
    # Else one worker of torchrun, srun or mpirun. An elastic job's srun task (ddpkit slurm's script) is a node's
    # launcher, not a worker: its ranks come from the rendezvous, not from the task's SLURM_PROCID.
    here = source == "local" or (elastic and source == "slurm")
    workers = [(peek(words, key) or "1").split(":")[-1] for key in ("nproc", "nnodes")]  # nnodes=MIN:MAX: MAX
    elastic = here and elastic
    if not (here and all(n.isdigit() for n in workers) and max(map(int, workers)) > 1):
        _import_torch(elastic)
        return _train(words, args, here)
    with worker_server():  # its imports run beside this process's own (parsing the config imports torch)
        _import_torch(elastic)
        return _train(words, args, here)


def _import_torch(elastic: bool) -> None:
    """Import torch in this process, its C++ warnings quieted for the launcher of an elastic job (c10 reads its log
    level once, at the import: :func:`~ddpkit.commands.launching.quiet_cpp_logs`)."""
    with environ_set(quiet_cpp_logs(elastic)):
        import torch  # noqa: F401


def _train(words: Sequence[str], args: Sequence[str], here: bool) -> int:
    """``ddpkit train`` with its config ``words``: nproc workers here (``here``), else this process as one worker.

    ``args`` are the words as the user gave them, for the line that says how to continue.
    """
    from ddpkit.checkpoint import Preempted
    from ddpkit.env.sagemaker import model_dir
    from ddpkit.train.preflight import check_before_launch
    from ddpkit.train.run import run_worker
    from ddpkit.train.run_folder import claim_run_folder, plan_run_folder

    cfg = parse_train_config(words)
    export_dir = model_dir(os.environ)  # inside SageMaker: the model is exported there at the end
    if not here:
        if cfg.max_restarts:
            _say_restarts_are_the_launchers(cfg.max_restarts)
        run_worker(cfg, export_dir)  # started by torchrun, srun or mpirun: this process is one worker
        return 0
    if cfg.nodes.elastic and not cfg.output_dir:
        cfg = dataclasses.replace(cfg, output_dir=str(_elastic_run_folder(cfg)))
    if cfg.node_rank == 0:  # the other nodes' workers take node 0's run folder (ddpkit.train.run)
        cfg = dataclasses.replace(cfg, output_dir=str(plan_run_folder(cfg, os.environ)))
    check_before_launch(cfg, cfg.nproc * cfg.nodes.max_nodes)
    warn_if_oversubscribed(cfg.nproc, cfg.device)
    if cfg.output_dir:
        claim_run_folder(Path(cfg.output_dir))
    try:
        if cfg.nproc == 1 and cfg.nnodes == "1" and not cfg.max_restarts:
            run_worker(cfg, export_dir)  # in this process
            return 0
        from ddpkit.launchers.output import default_log_dir

        signals = cfg.checkpoint.signal_names() if cfg.checkpoint.enabled else ()
        # One folder per launch: a resumed run (resume=auto, a requeued job) keeps the earlier launches' output.
        log_dir = (
            Path(cfg.output_dir) / "logs" / time.strftime("%Y%m%d-%H%M%S")
            if cfg.output_dir
            else default_log_dir("train")
        )
        spec = launch_spec(
            cfg,
            forward_signals=signals,
            rendezvous_timeout=cfg.timeout,
            log_dir=str(log_dir),
            title=shlex.join(["ddpkit", "train", *args]),
        )
        with _stack_files_in(Path(cfg.output_dir) / "stacks" if cfg.output_dir else None):
            code, signal_name = launch(spec, run_worker, cfg, export_dir)
    except Preempted as stop:  # the one worker, in this process
        code, signal_name = int(str(stop.code)), ""
    except LaunchError as e:
        print(e.failure.report(), file=sys.stderr)
        # Not for a run refused its folder (the checkpoints there are another run's) or one that diverged
        # (its own line names the last good checkpoint; continuing as it was would diverge again).
        newest = _newest_checkpoint(cfg) if e.failure.exitcode not in (EXIT_USER_ERROR, EXIT_DIVERGED) else None
        if newest is not None:  # the work so far is not lost: say how to go on from it
            print(f"ddpkit: {_how_to_continue(cfg, args, newest)}", file=sys.stderr)
        return failed_status(e)
    if code in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
        what = "interrupted" if code == EXIT_INTERRUPTED else "preempted"
        by = f" by {signal_name}: the workers checkpointed and exited {code};" if signal_name else ":"
        print(f"ddpkit: {what}{by} {_how_to_continue(cfg, args, _newest_checkpoint(cfg))}", file=sys.stderr)
    return code


@contextlib.contextmanager
def _stack_files_in(folder: Path | None) -> Iterator[None]:
    """Let the workers started in the block dump their stacks into ``folder`` when a wait times out.

    None (a node other than node 0, which has no run folder): the default, a folder under the temp dir.
    """
    from ddpkit.stacks import STACK_DIR_VARIABLE

    if folder is None:
        yield
        return
    os.environ[STACK_DIR_VARIABLE] = str(folder)
    try:
        yield
    finally:
        del os.environ[STACK_DIR_VARIABLE]


def _how_to_continue(cfg: TrainConfig, args: Sequence[str], newest: tuple[str, int] | None) -> str:
    """One line: ``newest``, the run's newest complete checkpoint (path, global step), and the command that
    continues from it."""
    if not cfg.output_dir:  # a node other than node 0, which holds the run folder
        return "node 0 names the newest checkpoint; to continue, run the same commands with resume=auto on every node"
    if newest is None:
        return f"no checkpoint was written; run {shlex.join(['ddpkit', 'train', *args])} to start again"
    given = peek(args, "output_dir") or ""
    # An output_dir URL stays as given: it names the checkpoints' place and, from it, the same local folder.
    words = [w for w in args if not w.startswith(("resume=", "output_dir="))]
    words += [f"output_dir={given if url_scheme(given) else cfg.output_dir}", "resume=auto"]
    command = "ddpkit train " + " ".join(shlex.quote(word) for word in words)
    return f"checkpoint {newest[0]} (global step {newest[1]}) is complete; continue with: {command}"


def _newest_checkpoint(cfg: TrainConfig) -> tuple[str, int] | None:
    """The run's newest complete checkpoint (its path, or URL, and its global step), if any."""
    from ddpkit.checkpoint import is_remote, list_checkpoints, remote_checkpoints
    from ddpkit.train.run import checkpoint_root

    if not cfg.output_dir:  # another node's launcher: the run folder is node 0's
        return None
    root = checkpoint_root(cfg)
    if is_remote(root):
        stored = [(c.url, c.global_step) for c in remote_checkpoints(root) if c.complete]
        return stored[-1] if stored else None
    complete = [(str(info.path), info.global_step) for info in list_checkpoints(root) if info.complete]
    return complete[-1] if complete else None


def _elastic_run_folder(cfg: TrainConfig) -> Path:
    """``runs/<model>-<dataset>/elastic-<run id>`` (``slurm-<job id>`` in a Slurm job): the run folder of an elastic
    job, which every node names alike without talking (node 0, which names it in a static job, is whichever node
    the rendezvous makes it, and may change at each round), and a node that joins later, or the job run again,
    continues."""
    from ddpkit.launchers.elastic import run_id
    from ddpkit.train.run_folder import plan_run_folder

    planned = plan_run_folder(cfg, os.environ)
    if os.environ.get("SLURM_JOB_ID") and not cfg.rdzv_id:  # slurm-<job id>, as a static job's: a requeue continues
        return planned
    series = planned.parent  # runs/<model>-<dataset>
    name = run_id(cfg.rdzv_id, cfg.master_addr, cfg.master_port, os.environ)
    return series / f"elastic-{name.replace('/', '-').replace(':', '-')}"
