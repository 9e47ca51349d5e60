"""The ``ddpkit`` command: train, run, bench, slurm, doctor and the checkpoint tools.

Every subcommand takes ``key=value`` words (and YAML files) for its config;
bad input ends in one line on stderr that names the problem and the fix, and
a non-zero exit status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn

from ddpkit.config import TrainConfig, parse, peek  # no torch import: `ddpkit slurm` starts fast
from ddpkit.launch.failure import USER_ERRORS, LaunchError, record_for_launcher

if TYPE_CHECKING:
    from ddpkit.launch.local import LaunchSpec

USAGE = """usage: ddpkit COMMAND [key=value ...] [config.yaml ...]

commands:
  train        train a model data-parallel (nproc=N workers here, or one worker of a torchrun/srun/mpirun job)
  run          run your own Python script as nproc=N workers here, as torchrun does (RANK, WORLD_SIZE... set)
  bench        benchmarks: bench train | bench comm | bench scaling
  slurm        write or submit an sbatch script for a training job
  doctor       print the detected environment and check the network between workers
  checkpoints  list the checkpoints of a folder, with step, epoch, metric and whether each verifies
  export       write a checkpoint's weights and model config for inference

examples:
  ddpkit train nproc=2                         # W1: MLP on Fashion-MNIST, 2 workers
  ddpkit train model=cnn epochs=1 nproc=2
  torchrun --nproc-per-node 2 -m ddpkit train
  ddpkit run nproc=2 train.py --lr 0.1         # your script, 2 workers; its arguments follow it
  ddpkit run nproc=2 max_restarts=1 -m mypackage.train
"""

EXIT_USER_ERROR = 2
EXIT_WORKER_FAILED = 1


def parse_train_config(args: Sequence[str]) -> TrainConfig:
    """TrainConfig from words, with the chosen model's recipe as defaults."""
    from ddpkit.models.registry import get_model_spec

    model = peek(args, "model") or TrainConfig.model
    return parse(TrainConfig, args, presets=dict(get_model_spec(model).recipe))


def train_command(args: Sequence[str]) -> int:
    """``ddpkit train``: run here as one worker of a launched job, or start nproc workers."""
    from ddpkit.env.detect import detect_environment
    from ddpkit.launch.local import worker_server

    nproc = peek(args, "nproc") or "1"
    if not (nproc.isdigit() and int(nproc) > 1 and detect_environment(os.environ).source == "local"):
        return _train(args)
    with worker_server():  # its imports run beside this process's own (parsing the config imports torch)
        return _train(args)


def _train(args: Sequence[str]) -> int:
    from ddpkit.env.detect import detect_environment
    from ddpkit.launch.local import LaunchSpec
    from ddpkit.train.preflight import check_before_launch
    from ddpkit.train.run import run_worker

    cfg = parse_train_config(args)
    env = detect_environment(os.environ)
    if env.source != "local":
        run_worker(cfg)  # started by torchrun, srun or mpirun: this process is one worker
        return 0
    check_before_launch(cfg, cfg.nproc)
    if cfg.nproc == 1 and not cfg.max_restarts:
        run_worker(cfg)  # a preemption ends it with SystemExit(EXIT_PREEMPTED)
        return 0
    signals = cfg.checkpoint.signal_names() if cfg.checkpoint.enabled else ()
    spec = LaunchSpec(cfg.nproc, cfg.master_port, cfg.max_restarts, forward_signals=signals)
    resume = "run the same command with resume=auto to continue"
    return _launch(spec, run_worker, cfg, preempted=f"the workers wrote a checkpoint and stopped; {resume}",
                   stopped=f"the workers wrote a checkpoint on their way out; {resume}")


def run_command(args: Sequence[str]) -> int:
    """``ddpkit run``: a Python script (or -m module) as nproc workers here, each as ``python SCRIPT ARGS``."""
    if list(args[:1]) in (["-h"], ["--help"]):
        from ddpkit.launch.script import USAGE

        print(USAGE)
        return 0
    from ddpkit.launch.local import LaunchSpec
    from ddpkit.launch.script import describe, parse_run_command, run_script
    from ddpkit.checkpoint.preemption import EXIT_PREEMPTED

    config, target = parse_run_command(args)
    print(describe(config, target), file=sys.stderr)
    # Always through the launcher, even for nproc=1 without restarts (where
    # `ddpkit train` runs in-process): a script expects what torchrun gives
    # it, a process of its own with RANK, WORLD_SIZE, MASTER_ADDR... set, and
    # may call sys.exit, os._exit or signal.signal as it likes. The spawn costs
    # about a second; behaviour does not change with nproc.
    spec = LaunchSpec(config.nproc, config.master_port, config.max_restarts)
    preempted = f"a worker exited with status {EXIT_PREEMPTED} (preempted); run the same command to continue"
    return _launch(spec, run_script, target, preempted=preempted)


def _launch(spec: LaunchSpec, fn: Callable[..., object], *args: object, preempted: str, stopped: str = "") -> int:
    """Run ``fn(*args)`` in ``spec.nproc`` local workers; the exit status of the command.

    A worker's exit status EXIT_PREEMPTED (said with ``preempted``), or one of
    ``spec.forward_signals`` received by the launcher (said with ``stopped``),
    is a preemption: EXIT_PREEMPTED. Another signal gives 128 + its number.

    Raises:
        LaunchError: a worker failed (after the allowed restarts); main() reports it.
    """
    import signal

    from torch.distributed.elastic.multiprocessing.api import SignalException

    from ddpkit.launch.local import launch_local
    from ddpkit.checkpoint.preemption import EXIT_PREEMPTED

    try:
        launch_local(spec, fn, *args)
    except LaunchError as e:
        if e.failure.exitcode == EXIT_PREEMPTED:
            print(f"ddpkit: preempted: {preempted}", file=sys.stderr)
            return EXIT_PREEMPTED
        if spec.max_restarts:
            print(f"error: the job failed after {spec.max_restarts} restart(s) (max_restarts={spec.max_restarts})",
                  file=sys.stderr)
        raise
    except SignalException as e:  # the launcher itself got the signal and passed it on to the workers
        name = signal.Signals(e.sigval).name
        if name in spec.forward_signals:
            print(f"ddpkit: stopped by {name}: {stopped}", file=sys.stderr)
            return EXIT_PREEMPTED
        print(f"error: stopped by {name}", file=sys.stderr)
        return 128 + int(e.sigval)
    return 0


def _subcommands() -> dict[str, Callable[[Sequence[str]], int]]:
    commands: dict[str, Callable[[Sequence[str]], int]] = {"train": train_command, "run": run_command}
    try:
        from ddpkit.bench.cli import bench_command

        commands["bench"] = bench_command
    except ImportError:
        pass
    try:
        from ddpkit.launch.slurm_cli import main as slurm_main

        commands["slurm"] = slurm_main
    except ImportError:
        pass
    from ddpkit.doctor import main as doctor_main

    commands["doctor"] = doctor_main
    from ddpkit.checkpoint.cli import checkpoints_command, export_command

    commands["export"] = export_command
    commands["checkpoints"] = checkpoints_command
    return commands


def run() -> NoReturn:
    """The ``ddpkit`` console script and ``python -m ddpkit``: :func:`main`, then the process's exit."""
    _current_folder_importable()
    code = main()
    distributed = sys.modules.get("ddpkit.distributed")
    if distributed is None:  # never joined a job (`ddpkit slurm`, `--help`): no torch to import now
        sys.exit(code)
    distributed.exit_process(code)


def _current_folder_importable() -> None:
    # `python -m ddpkit` puts the current folder first on sys.path, the console
    # script its bin folder instead: without this, model=mymodels:build found
    # beside the user works with one and not the other. Done here, for the
    # process, not in main() (which tests call in-process). Spawned workers
    # receive the launcher's sys.path (multiprocessing's preparation data).
    cwd = os.getcwd()
    if not sys.flags.safe_path and cwd not in sys.path:  # python -P / PYTHONSAFEPATH: the user asked for none
        sys.path.insert(0, cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script and ``python -m ddpkit``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = _subcommands()
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0
    name, rest = argv[0], argv[1:]
    if name not in commands:
        print(f"error: unknown command {name!r}; choose one of: {', '.join(commands)}", file=sys.stderr)
        return EXIT_USER_ERROR
    try:
        return commands[name](rest)
    except LaunchError as e:
        print(e.failure.report(), file=sys.stderr)
        return EXIT_WORKER_FAILED
    except USER_ERRORS as e:
        record_for_launcher(e)  # under torchrun, its failure summary then names the error
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
