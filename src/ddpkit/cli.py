"""The ``ddpkit`` command: train, bench, slurm, doctor and the checkpoint tools.

Every subcommand takes ``key=value`` words (and YAML files) for its config;
bad input ends in one line on stderr that names the problem and the fix, and
a non-zero exit status.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence

from ddpkit.config import TrainConfig, parse, peek  # no torch import: `ddpkit slurm` starts fast
from ddpkit.launch.failure import USER_ERRORS, LaunchError, record_for_launcher

USAGE = """usage: ddpkit COMMAND [key=value ...] [config.yaml ...]

commands:
  train        train a model data-parallel (nproc=N workers here, or one worker of a torchrun/srun/mpirun job)
  bench        benchmarks: bench train | bench comm | bench scaling
  slurm        write or submit an sbatch script for a training job
  doctor       print the detected environment and check the network between workers

examples:
  ddpkit train nproc=2                         # W1: MLP on Fashion-MNIST, 2 workers
  ddpkit train model=cnn epochs=1 nproc=2
  torchrun --nproc-per-node 2 -m ddpkit train
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
    from ddpkit.launch.local import LaunchSpec, launch_local
    from ddpkit.train.preflight import check_before_launch
    from ddpkit.train.run import run_worker

    cfg = parse_train_config(args)
    env = detect_environment(os.environ)
    if env.source != "local":
        run_worker(cfg)  # started by torchrun, srun or mpirun: this process is one worker
        return 0
    check_before_launch(cfg, cfg.nproc)
    if cfg.nproc == 1:
        run_worker(cfg)
    else:
        launch_local(LaunchSpec(cfg.nproc, cfg.master_port), run_worker, cfg)
    return 0


def _subcommands() -> dict[str, Callable[[Sequence[str]], int]]:
    commands: dict[str, Callable[[Sequence[str]], int]] = {"train": train_command}
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
    return commands


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
