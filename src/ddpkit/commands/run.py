"""``ddpkit run``: the user's own Python program as nproc workers here, as torchrun runs it.

The words and the program's target are read by :mod:`ddpkit.launchers.script` (RunConfig, ScriptTarget),
which also holds what each worker runs; this module launches them and says how they ended.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from ddpkit.commands.help import HELP_WORDS, CommandHelp, render_help
from ddpkit.commands.launching import (
    environ_set,
    exit_statuses,
    launch,
    launch_spec,
    quiet_cpp_logs,
    warn_if_oversubscribed,
)
from ddpkit.launchers.script import RunConfig, ScriptTarget, parse_run_command, wants_run_help
from ddpkit.names import DEFAULT_PREEMPT_SIGNALS, EXIT_INTERRUPTED, EXIT_PREEMPTED

RUN_EXIT_STATUSES = exit_statuses("run the same command again to continue (a script with a ddpkit.Checkpointer)")


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
    examples=(
        "ddpkit run nproc=2 train.py --lr 0.1",
        "ddpkit run nproc=2 max_restarts=1 -m mypackage.train",
        "ddpkit run nproc=4 nnodes=1:4 master_addr=login1 master_port=29500 train.py   # elastic: on each node",
    ),
    exit_statuses=RUN_EXIT_STATUSES,
)


def run_command(args: Sequence[str]) -> int:
    """``ddpkit run``: a Python script (or -m module) as nproc workers here, each as ``python SCRIPT ARGS``."""
    if wants_run_help(args):
        print(render_help(RUN_HELP))
        return 0
    from ddpkit.launchers.server import worker_server

    config, target = parse_run_command(run_words(args))  # bad input is one line before any process starts
    # The server's imports (torch, torch.distributed) run beside this process's own, not after them: on a GPU
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


def _run_script(config: RunConfig, target: ScriptTarget) -> int:
    """``ddpkit run`` once its words are parsed: describe, launch ``target`` as the workers, say how it ended."""
    with environ_set(quiet_cpp_logs(config.nodes.elastic)):  # read once, at torch's import; not the workers'
        import torch

    from ddpkit.launchers.output import default_log_dir
    from ddpkit.launchers.script import describe, run_script, worker_environ

    extra = worker_environ(config, torch.cuda.device_count())  # NVML's count: the launcher leaves CUDA uninitialized
    if not config.log_dir:
        name = Path(target.path).stem if target.path else target.module
        config = dataclasses.replace(config, log_dir=str(default_log_dir(name)))
    print(describe(config, target), file=sys.stderr)
    warn_if_oversubscribed(config.nproc, config.device)
    # Always through the launcher, even for nproc=1 without restarts (where
    # `ddpkit train` runs in-process): a script expects what torchrun gives
    # it, a process of its own with RANK, WORLD_SIZE, MASTER_ADDR... set, and
    # may call sys.exit, os._exit or signal.signal as it likes. The spawn costs
    # about a second; behaviour does not change with nproc.
    program = [target.path] if target.path else ["-m", target.module]
    spec = launch_spec(
        config,
        forward_signals=DEFAULT_PREEMPT_SIGNALS,
        log_dir=config.log_dir,
        title=shlex.join(program + list(target.args)),
    )
    with environ_set(extra):  # the workers take the launcher's environment at launch
        code, signal_name = launch(spec, run_script, target)
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
