"""The ``ddpkit`` command: train, run, bench, slurm, doctor and the checkpoint tools.

Every subcommand takes ``key=value`` words (and YAML files) for its config;
bad input ends in one line on stderr that names the problem and the fix, and
a non-zero exit status.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import os
import re
import shlex
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ddpkit.bench.cli import BENCH_HELP
from ddpkit.checkpoint_cli import CHECKPOINTS_HELP, EXPORT_HELP
from ddpkit.command_help import HELP_WORDS, CommandHelp, render_help, wants_help
from ddpkit.config import (  # no torch import: `ddpkit slurm` starts fast
    TRAIN_OPTION_GROUPS,
    TrainConfig,
    parse_train_config,
    peek,
)
from ddpkit.errors import UserError
from ddpkit.launchers.failure import LaunchError, record_for_launcher
from ddpkit.launchers.script import RunConfig, ScriptTarget, parse_run_command, wants_run_help
from ddpkit.launchers.slurm_cli import SLURM_HELP
from ddpkit.names import (
    DEFAULT_PREEMPT_SIGNALS,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USER_ERROR,
    EXIT_WORKER_FAILED,
)
from ddpkit.version import __version__

if TYPE_CHECKING:
    from ddpkit.checkpoint.format import CheckpointInfo
    from ddpkit.launchers.local import LaunchSpec
    from ddpkit.launchers.script import RunConfig


@dataclass(frozen=True)
class Command:
    """A ``ddpkit`` command: the function that runs it and its help."""

    run: str
    """``module:function`` taking the words after the command name, returning the exit status."""
    help: CommandHelp
    """What ``ddpkit COMMAND --help`` shows."""
    brief: str
    """What the command does, in one line of the top-level usage."""


def _exit_statuses(again: str) -> tuple[tuple[str, str], ...]:
    """What the exit status of ``ddpkit train`` or ``ddpkit run`` means (their --help lists it); ``again``: what
    continues a run that stopped with a checkpoint."""
    return (
        ("0", "every worker finished"),
        (str(EXIT_WORKER_FAILED), "a worker failed; one report names its rank, exit code and traceback"),
        (str(EXIT_USER_ERROR), "bad input: one line names the fix, before any worker starts"),
        (
            str(EXIT_STORAGE),
            "a checkpoint or metrics.jsonl could not be written (no space, read-only folder): fix it, then run again",
        ),
        (
            str(EXIT_PREEMPTED),
            "preempted: a signal (SIGTERM, SIGUSR1, SIGUSR2) reached the launcher or a worker, and the workers "
            f"wrote a checkpoint and exited 75; {again} (a requeued Slurm job does so by itself)",
        ),
        (str(EXIT_INTERRUPTED), f"Ctrl-C: the workers wrote a checkpoint and stopped; {again}"),
        ("128+N", "the launcher received signal N and the workers did not checkpoint (143: SIGTERM); one line says so"),
    )


TRAIN_EXIT_STATUSES = _exit_statuses(
    "the last line prints the command that continues: the same words with output_dir=<the run's folder> resume=auto "
    "(without output_dir, the same command starts a new run; resume=auto alone continues the newest run of this "
    "model and data)"
)
RUN_EXIT_STATUSES = _exit_statuses("run the same command again to continue (a script with a ddpkit.Checkpointer)")

TRAIN_HELP = CommandHelp(
    usage="ddpkit train [key=value ...] [config.yaml ...]",
    summary="Train a model data-parallel: nproc=N workers on this machine, or one worker of a torchrun, "
    "srun or mpirun job (detected). YAML files and key=value words are merged in the order given; "
    "the model's recipe sets the defaults of some options (lr, epochs...). The run writes "
    "metrics.jsonl, summary.json and checkpoints into its own folder runs/<model>-<dataset>/<time> "
    "(runs/latest points to it).",
    schema="ddpkit.config:TrainConfig",
    groups=TRAIN_OPTION_GROUPS,
    examples=(
        "ddpkit train nproc=2                          # the MLP on Fashion-MNIST, 2 workers",
        "ddpkit train model=cnn epochs=1 nproc=2 checkpoint.every_steps=200",
        "ddpkit train nproc=2 resume=auto             # continue the latest run of this model and data",
        "torchrun --nproc-per-node 2 -m ddpkit train",
    ),
    exit_statuses=TRAIN_EXIT_STATUSES,
)

RUN_HELP = CommandHelp(
    usage="ddpkit run [key=value ...] SCRIPT.py [ARGS ...] | -m MODULE [ARGS ...]",
    summary="Run your own Python program as nproc workers on this machine, as torchrun does: each worker "
    "gets RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT... and runs the program as "
    "__main__. The key=value words before the program are ddpkit's; the program's own arguments "
    "follow it and are not read by ddpkit.",
    schema="ddpkit.launchers.script:RunConfig",
    positional=(
        ("SCRIPT.py [ARGS ...]", "the script each worker runs, with its arguments"),
        ("-m MODULE [ARGS ...]", "or a module, as python -m runs it"),
    ),
    examples=("ddpkit run nproc=2 train.py --lr 0.1", "ddpkit run nproc=2 max_restarts=1 -m mypackage.train"),
    exit_statuses=RUN_EXIT_STATUSES,
)

DOCTOR_HELP = CommandHelp(
    usage="ddpkit doctor [key=value ...]",
    summary="Print what each worker sees (launcher, ranks, network interface, devices, backend) and check "
    "that the workers reach each other: rendezvous, roll call, process group, all_reduce, then "
    "latency and bandwidth between rank 0 and every peer. Run it as the training runs "
    "(nproc=N here, or under torchrun, srun or mpirun).",
    schema="ddpkit.doctor.config:DoctorConfig",
    examples=("ddpkit doctor nproc=2", "srun --nodes 2 --ntasks-per-node 4 python -m ddpkit doctor"),
)

PLOT_HELP = CommandHelp(
    usage="ddpkit plot RUN_DIR [RUN_DIR ...] [key=value ...]",
    summary="Draw runs' training loss, test metric and throughput against the step (or epoch) from their "
    "metrics.jsonl into one PNG, several runs overlaid and named by the settings in which they differ.",
    schema="ddpkit.train.plot:PlotConfig",
    positional=(("RUN_DIR", "a run's folder (e.g. runs/latest) or its metrics.jsonl; several are overlaid"),),
    examples=(
        "ddpkit plot runs/latest",
        "ddpkit plot runs/w1 runs/w2 output=workers.png",
        "ddpkit plot runs/lr-a runs/lr-b x=epoch panels=loss,test",
    ),
)

COMMANDS: dict[str, Command] = {
    "train": Command(
        "ddpkit.cli:train_command",
        TRAIN_HELP,
        "train a model data-parallel (nproc=N workers here, or one worker of a torchrun/srun/mpirun job)",
    ),
    "run": Command(
        "ddpkit.cli:run_command",
        RUN_HELP,
        "run your own Python script as nproc=N workers here, as torchrun does (RANK, WORLD_SIZE... set)",
    ),
    "bench": Command(
        "ddpkit.bench.cli:bench_command", BENCH_HELP, "benchmarks: bench train | bench comm | bench scaling"
    ),
    "slurm": Command(
        "ddpkit.launchers.slurm_cli:main", SLURM_HELP, "write or submit an sbatch script for a training job"
    ),
    "doctor": Command(
        "ddpkit.doctor:main", DOCTOR_HELP, "print the detected environment and check the network between workers"
    ),
    "checkpoints": Command(
        "ddpkit.checkpoint_cli:checkpoints_command",
        CHECKPOINTS_HELP,
        "list the checkpoints of a folder, with step, epoch, metric and whether each verifies",
    ),
    "export": Command(
        "ddpkit.checkpoint_cli:export_command",
        EXPORT_HELP,
        "write a checkpoint's weights and model config for inference",
    ),
    "plot": Command(
        "ddpkit.train.plot:plot_command",
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
    here = detect_environment(os.environ).source == "local"  # else one worker of torchrun, srun or mpirun
    workers = [peek(words, key) or "1" for key in ("nproc", "nnodes")]
    if not (here and all(n.isdigit() for n in workers) and max(map(int, workers)) > 1):
        return _train(words, args, here)
    with worker_server():  # its imports run beside this process's own (parsing the config imports torch)
        return _train(words, args, here)


def _train(words: Sequence[str], args: Sequence[str], here: bool) -> int:
    """``ddpkit train`` with its config ``words``: nproc workers here (``here``), else this process as one worker.

    ``args`` are the words as the user gave them, for the line that says how to continue.
    """
    from ddpkit.checkpoint.preemption import Preempted
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
    if cfg.node_rank == 0:  # the other nodes' workers take node 0's run folder (ddpkit.train.run)
        cfg = dataclasses.replace(cfg, output_dir=str(plan_run_folder(cfg, os.environ)))
    check_before_launch(cfg, cfg.nproc * cfg.nnodes)
    _warn_if_oversubscribed(cfg.nproc, cfg.device)
    if cfg.output_dir:
        claim_run_folder(Path(cfg.output_dir))
    try:
        if cfg.nproc == 1 and cfg.nnodes == 1 and not cfg.max_restarts:
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
        spec = _launch_spec(
            cfg,
            forward_signals=signals,
            rendezvous_timeout=cfg.timeout,
            log_dir=str(log_dir),
            title=shlex.join(["ddpkit", "train", *args]),
        )
        with _stack_files_in(Path(cfg.output_dir) / "stacks" if cfg.output_dir else None):
            code, signal_name = _launch(spec, run_worker, cfg, export_dir)
    except Preempted as stop:  # the one worker, in this process
        code, signal_name = int(stop.code), ""
    except LaunchError as e:
        print(e.failure.report(), file=sys.stderr)
        # Not for a run refused its folder (the checkpoints there are another run's) or one that diverged
        # (its own line names the last good checkpoint; continuing as it was would diverge again).
        newest = _newest_checkpoint(cfg) if e.failure.exitcode not in (EXIT_USER_ERROR, EXIT_DIVERGED) else None
        if newest is not None:  # the work so far is not lost: say how to go on from it
            print(f"ddpkit: {_how_to_continue(cfg, args, newest)}", file=sys.stderr)
        return _failed_status(e)
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


def _how_to_continue(cfg: TrainConfig, args: Sequence[str], newest: CheckpointInfo | None) -> str:
    """One line: ``newest``, the run's newest complete checkpoint, and the command that continues from it."""
    if not cfg.output_dir:  # a node other than node 0, which holds the run folder
        return "node 0 names the newest checkpoint; to continue, run the same commands with resume=auto on every node"
    if newest is None:
        return f"no checkpoint was written; run {shlex.join(['ddpkit', 'train', *args])} to start again"
    words = [w for w in args if not w.startswith(("resume=", "output_dir="))]
    words += [f"output_dir={cfg.output_dir}", "resume=auto"]
    command = "ddpkit train " + " ".join(shlex.quote(word) for word in words)
    return f"checkpoint {newest.path} (global step {newest.global_step}) is complete; continue with: {command}"


def _newest_checkpoint(cfg: TrainConfig) -> CheckpointInfo | None:
    from ddpkit.checkpoint.format import list_checkpoints
    from ddpkit.train.run import checkpoint_root

    if not cfg.output_dir:  # another node's launcher: the run folder is node 0's
        return None
    complete = [info for info in list_checkpoints(checkpoint_root(cfg)) if info.complete]
    return complete[-1] if complete else None


def run_command(args: Sequence[str]) -> int:
    """``ddpkit run``: a Python script (or -m module) as nproc workers here, each as ``python SCRIPT ARGS``."""
    if wants_run_help(args):
        print(render_help(COMMANDS["run"].help))
        return 0
    from ddpkit.launchers.server import worker_server

    config, target = parse_run_command(run_words(args))  # bad input is one line before any process starts
    # The server's imports (torch, torch._dynamo) run beside this process's own, not after them: on a GPU
    # machine, where importing torch takes seconds, in sequence they put those seconds twice before the script.
    with worker_server():
        return _run_script(config, target)


_NPROC_FLAG = re.compile(r"--nproc[-_]per[-_]node(?:=(.*))?")
_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")


def run_words(args: Sequence[str]) -> list[str]:
    """The words of ``ddpkit run`` as torchrun users write them, in ddpkit's spelling.

    ``python x.py`` and ``python -m mod`` drop the interpreter word (each worker runs the script with this
    Python), and torchrun's ``--nproc-per-node N`` (``--nproc_per_node=N``) becomes ``nproc=N``; the program's
    own words, from the script or ``-m`` on, are left as they are.
    """
    words: list[str] = []
    i = 0
    while i < len(args):
        word, rest = args[i], args[i + 1 :]
        if word.endswith(".py") or word.startswith("-m") or word in HELP_WORDS:
            return words + list(args[i:])  # the program's command line starts here
        flag = _NPROC_FLAG.fullmatch(word)
        if flag is not None:
            value = flag.group(1) if flag.group(1) is not None else (rest[0] if rest else "")
            words.append(f"nproc={value}")
            i += 1 if flag.group(1) is not None else 2
            continue
        is_python = _PYTHON.fullmatch(os.path.basename(word)) is not None or word == sys.executable
        if not (is_python and rest and (rest[0].endswith(".py") or rest[0].startswith("-m"))):
            words.append(word)
        i += 1
    return words


def _warn_if_oversubscribed(nproc: int, device: str) -> None:
    """One line on stderr when a CPU run starts more workers here than the cores it may use."""
    from ddpkit.train.preflight import cpu_cores, oversubscribed

    crowded = oversubscribed(nproc, device, cpu_cores())
    if crowded is not None:
        print(f"ddpkit: warning: {crowded}", file=sys.stderr)


def _run_script(config: RunConfig, target: ScriptTarget) -> int:
    """``ddpkit run`` once its words are parsed: describe, launch ``target`` as the workers, say how it ended."""
    import torch

    from ddpkit.launchers.output import default_log_dir
    from ddpkit.launchers.script import describe, run_script, worker_environ

    extra = worker_environ(config, torch.cuda.device_count())  # NVML's count: the launcher leaves CUDA uninitialized
    if not config.log_dir:
        name = Path(target.path).stem if target.path else target.module
        config = dataclasses.replace(config, log_dir=str(default_log_dir(name)))
    print(describe(config, target), file=sys.stderr)
    _warn_if_oversubscribed(config.nproc, config.device)
    # Always through the launcher, even for nproc=1 without restarts (where
    # `ddpkit train` runs in-process): a script expects what torchrun gives
    # it, a process of its own with RANK, WORLD_SIZE, MASTER_ADDR... set, and
    # may call sys.exit, os._exit or signal.signal as it likes. The spawn costs
    # about a second; behaviour does not change with nproc.
    program = [target.path] if target.path else ["-m", target.module]
    spec = _launch_spec(
        config,
        forward_signals=DEFAULT_PREEMPT_SIGNALS,
        log_dir=config.log_dir,
        title=shlex.join(program + list(target.args)),
    )
    with _environ_set(extra):  # the workers take the launcher's environment at launch
        code, signal_name = _launch(spec, run_script, target)
    if code == EXIT_PREEMPTED and signal_name:
        print(
            f"ddpkit: preempted by {signal_name}: the workers checkpointed and exited {EXIT_PREEMPTED}; "
            "run the same command again to continue",
            file=sys.stderr,
        )
    elif code == EXIT_PREEMPTED:
        print(
            f"ddpkit: preempted: a worker exited with status {EXIT_PREEMPTED}; run the same command to continue "
            "(a script with a ddpkit.Checkpointer resumes from its checkpoint)",
            file=sys.stderr,
        )
    elif code == EXIT_INTERRUPTED:
        print(
            "ddpkit: interrupted: run the same command to continue (a script with a ddpkit.Checkpointer "
            "wrote a checkpoint at Ctrl-C and resumes from it)",
            file=sys.stderr,
        )
    return code


@contextlib.contextmanager
def _environ_set(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in os.environ for the block, the environment as it was after it."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _launch_spec(config: TrainConfig | RunConfig, **options: Any) -> LaunchSpec:
    """The LaunchSpec of a command's options (nproc, the nodes, the port, restarts, the ranks shown), with
    ``options`` added."""
    from ddpkit.config import shown_ranks
    from ddpkit.launchers.local import LaunchSpec

    return LaunchSpec(
        config.nproc,
        config.master_port,
        config.max_restarts,
        nnodes=config.nnodes,
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        show_ranks=shown_ranks(config.show_ranks),
        **options,
    )


def _launch(spec: LaunchSpec, fn: Callable[..., object], *args: object) -> tuple[int, str]:
    """Run ``fn(*args)`` in ``spec.nproc`` local workers; the exit status of the command, and the signal that ended it.

    The status: 0 when every worker succeeded; EXIT_PREEMPTED when a worker
    exited with it, or when the launcher received a signal, passed it on, and
    every worker still running exited with it (they checkpointed on their way
    out); EXIT_INTERRUPTED after Ctrl-C; 128 + the signal's number when the
    launcher received a signal and the workers did not checkpoint (one line
    says so). The signal: its name when the launcher received one, else "".

    Raises:
        LaunchError: a worker failed (after the allowed restarts).
    """
    import signal

    from ddpkit.launchers.local import StoppedBySignal, launch_local

    try:
        launch_local(spec, fn, *args)
    except LaunchError as e:
        if e.failure.exitcode in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
            return e.failure.exitcode, ""
        if spec.max_restarts:
            print(
                f"error: the job failed after {spec.max_restarts} restart(s) (max_restarts={spec.max_restarts})",
                file=sys.stderr,
            )
        raise
    except StoppedBySignal as e:  # the launcher itself got the signal and passed it on to the workers
        if e.checkpointed_status is not None:
            return e.checkpointed_status, e.signal_name
        print(f"error: stopped by {e.signal_name}{_how_workers_ended(e.exit_codes)}", file=sys.stderr)
        return 128 + int(signal.Signals[e.signal_name]), e.signal_name
    return 0, ""


def _how_workers_ended(exit_codes: Mapping[int, int | None]) -> str:
    """'; the workers were killed by it (no checkpoint)' or '; rank 0 exited 1, rank 1 ...', for the line above."""
    import signal

    if not exit_codes:
        return " before the workers started"
    if len({code for code in exit_codes.values()}) == 1 and (code := next(iter(exit_codes.values()))):
        if code < 0:
            return f": the workers were killed by {signal.Signals(-code).name} (no checkpoint)"
        return f": the workers exited with status {code}"
    ends = [
        f"rank {rank} {'exited ' + str(code) if code is None or code >= 0 else 'killed by ' + signal.Signals(-code).name}"
        for rank, code in sorted(exit_codes.items())
    ]
    return ": " + ", ".join(ends)


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
    if not sys.flags.safe_path and cwd not in sys.path:  # python -P / PYTHONSAFEPATH: the user asked for none
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
        return _failed_status(e)
    except UserError as e:
        record_for_launcher(e)  # under torchrun, its failure summary then names the error
        print(f"error: {e}", file=sys.stderr)
        return getattr(e, "exit_status", EXIT_USER_ERROR)  # a StorageError has its own
    except KeyboardInterrupt:
        print("ddpkit: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED


def _failed_status(error: LaunchError) -> int:
    """The exit status of a command whose workers failed: the root cause's where it has a meaning of its own
    (EXIT_STORAGE: a checkpoint could not be written; EXIT_DIVERGED: the loss became NaN; EXIT_USER_ERROR: the
    run folder is another run's), else EXIT_WORKER_FAILED."""
    code = error.failure.exitcode
    return code if code in (EXIT_STORAGE, EXIT_DIVERGED, EXIT_USER_ERROR) else EXIT_WORKER_FAILED


def load_function(path: str) -> Callable[[Sequence[str]], int]:
    """The function named by ``module:function``."""
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)
