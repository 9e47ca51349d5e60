"""The ``ddpkit`` command: train, run, bench, slurm, doctor and the checkpoint tools.

Every subcommand takes ``key=value`` words (and YAML files) for its config;
bad input ends in one line on stderr that names the problem and the fix, and
a non-zero exit status. Each command is a module of :mod:`ddpkit.commands`, imported only when it runs
(``ddpkit slurm`` and ``--help`` start without torch).
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

from ddpkit.commands.bench import BENCH_HELP
from ddpkit.commands.checkpoints import CHECKPOINTS_HELP
from ddpkit.commands.doctor import DOCTOR_HELP
from ddpkit.commands.export import EXPORT_HELP
from ddpkit.commands.help import HELP_WORDS, CommandHelp, render_help, wants_help
from ddpkit.commands.launching import failed_status
from ddpkit.commands.plot import PLOT_HELP
from ddpkit.commands.run import RUN_HELP
from ddpkit.commands.slurm import SLURM_HELP
from ddpkit.commands.store import STORE_HELP
from ddpkit.commands.train import TRAIN_HELP
from ddpkit.errors import UserError, exit_status
from ddpkit.launchers.failure import LaunchError, record_for_launcher
from ddpkit.names import EXIT_INTERRUPTED, EXIT_USER_ERROR
from ddpkit.version import __version__


@dataclass(frozen=True)
class Command:
    """A ``ddpkit`` command: the function that runs it and its help."""

    run: str
    """``module:function`` taking the words after the command name, returning the exit status."""
    help: CommandHelp
    """What ``ddpkit COMMAND --help`` shows."""
    brief: str
    """What the command does, in one line of the top-level usage."""


COMMANDS: dict[str, Command] = {
    "train": Command(
        "ddpkit.commands.train:train_command",
        TRAIN_HELP,
        "train a model data-parallel (nproc=N workers here, or one worker of a torchrun/srun/mpirun job)",
    ),
    "run": Command(
        "ddpkit.commands.run:run_command",
        RUN_HELP,
        "run your own Python script as nproc=N workers here, as torchrun does (RANK, WORLD_SIZE... set)",
    ),
    "bench": Command(
        "ddpkit.commands.bench:bench_command", BENCH_HELP, "benchmarks: bench train | bench comm | bench scaling"
    ),
    "slurm": Command("ddpkit.commands.slurm:main", SLURM_HELP, "write or submit an sbatch script for a training job"),
    "store": Command(
        "ddpkit.commands.store:store_command",
        STORE_HELP,
        "serve the rendezvous store of elastic jobs (nnodes=MIN:MAX) on a machine that stays up",
    ),
    "doctor": Command(
        "ddpkit.commands.doctor:doctor_command",
        DOCTOR_HELP,
        "print the detected environment and check the network between workers",
    ),
    "checkpoints": Command(
        "ddpkit.commands.checkpoints:checkpoints_command",
        CHECKPOINTS_HELP,
        "list the checkpoints of a folder, with step, epoch, metric and whether each verifies",
    ),
    "export": Command(
        "ddpkit.commands.export:export_command",
        EXPORT_HELP,
        "write a checkpoint's weights and model config for inference",
    ),
    "plot": Command(
        "ddpkit.commands.plot:plot_command",
        PLOT_HELP,
        "draw runs' loss, test metric and throughput from their metrics.jsonl into a PNG",
    ),
}
"""Every command, in the order the usage lists them."""


def usage() -> str:
    """The top-level usage: every command in one line."""
    lines = [
        "usage: ddpkit COMMAND [key=value ...] [config.yaml ...]",
        "       ddpkit COMMAND --help      every option of COMMAND, with its type, default and meaning",
        "       ddpkit --version",
        "",
        "commands:",
    ]
    lines += [f"  {name:<12} {command.brief}" for name, command in COMMANDS.items()]
    lines += [
        "",
        "examples:",
        *(f"  {line}" for line in COMMANDS["train"].help.examples[:2]),
        "  ddpkit run nproc=2 train.py --lr 0.1        # your script, 2 workers; its arguments follow it",
    ]
    return "\n".join(lines)


def run() -> NoReturn:
    """The ``ddpkit`` console script and ``python -m ddpkit``: :func:`main`, then the process's exit."""
    _current_folder_importable()
    try:
        code = main()
    except BrokenPipeError:  # `ddpkit train --help | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        code = 0
    if "torch" not in sys.modules:  # `ddpkit slurm`, `--help`: a light process, no teardown to skip
        sys.exit(code)
    from ddpkit.distributed import exit_process

    exit_process(code)


def _current_folder_importable() -> None:
    # `python -m ddpkit` puts the current folder first on sys.path, the console
    # script its bin folder instead: without this, model=mymodels:build found
    # beside the user works with one and not the other. Done here, for the
    # process, not in main() (which tests call in-process). Spawned workers
    # receive the launcher's sys.path (multiprocessing's preparation data).
    cwd = os.getcwd()
    if (
        not getattr(sys.flags, "safe_path", False) and cwd not in sys.path
    ):  # python -P / PYTHONSAFEPATH: the user asked for none
        sys.path.insert(0, cwd)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``ddpkit`` console script and ``python -m ddpkit``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in (*HELP_WORDS, "help"):
        print(usage())
        return 0
    if argv[0] == "--version":
        print(f"ddpkit {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        print(
            f"error: unknown command {name!r}{hint}; choose one of: {', '.join(COMMANDS)} (ddpkit --help)",
            file=sys.stderr,
        )
        return EXIT_USER_ERROR
    command = COMMANDS[name]
    if name not in ("run", "bench") and wants_help(rest):  # run and bench read their own words (a script's, a kind)
        print(render_help(command.help))
        return 0
    try:
        return load_function(command.run)(rest)
    except LaunchError as e:
        print(e.failure.report(), file=sys.stderr)
        return failed_status(e)
    except UserError as e:
        record_for_launcher(e)  # under torchrun, its failure summary then names the error
        print(f"error: {e}", file=sys.stderr)
        return exit_status(e, EXIT_USER_ERROR)  # a StorageError has its own
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def load_function(path: str) -> Callable[[Sequence[str]], int]:
    """The function named by ``module:function``."""
    module, _, function = path.partition(":")
    found: Callable[[Sequence[str]], int] = getattr(importlib.import_module(module), function)
    return found
