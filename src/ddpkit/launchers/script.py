"""``ddpkit run``: any Python program as N workers on this machine, like ``torchrun``.

::

    ddpkit run nproc=2 train.py --lr 0.1          # python train.py --lr 0.1, twice
    ddpkit run nproc=2 max_restarts=1 -m mypackage.train --lr 0.1

Grammar: ``ddpkit run [key=value ...] (SCRIPT.py | -m MODULE) [ARGS ...]``.
The words before the script are ddpkit's options (:class:`RunConfig`:
``nproc``, ``max_restarts``, ``master_port``, and for a job of several
machines ``nnodes``, ``node_rank``, ``master_addr``); the first word ending in
``.py``, or ``-m MODULE``, starts the program's own command line, which
ddpkit does not read: each worker sees ``sys.argv = [SCRIPT, *ARGS]``.

Each worker is a process spawned by torch's elastic agent
(:func:`ddpkit.launchers.local.launch_local`, the launcher of ``ddpkit
train``), with torchrun's environment variables set (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``GROUP_RANK``, ``TORCHELASTIC_RUN_ID``,
``TORCHELASTIC_RESTART_COUNT``, ...), so a plain
``dist.init_process_group("gloo")`` joins the job, and so does
``ddpkit.init()``. :func:`run_script` then runs the program as
``__main__``, as ``python SCRIPT.py`` or ``python -m MODULE`` would: with
the script's folder (for ``-m``, the current folder) first on ``sys.path``.

Pipeline: words -> (RunConfig, ScriptTarget) -> LaunchSpec -> launch_local
(run_script in every worker) -> exit status.

Exit status, per worker: returning, or ``SystemExit`` with code 0 or None,
is success; ``SystemExit(n)`` fails that rank with exit code ``n``
(75, ddpkit's preemption status, makes ``ddpkit run`` exit 75); an
exception fails it with exit code 1 and is reported once, by the launcher,
with its rank and traceback. With ``max_restarts=K`` the agent restarts all
workers after a failure, up to K times (``TORCHELASTIC_RESTART_COUNT``
counts them).
"""

from __future__ import annotations

import dataclasses
import importlib.machinery
import importlib.util
import os
import runpy
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from ddpkit.keyvalue import ConfigError, check_choice, parse
from ddpkit.launchers.options import LaunchOptions

USAGE = (
    "usage: ddpkit run [nproc=N] [device=auto|cpu] [max_restarts=K] [master_port=P] [nnodes=N node_rank=R | nnodes=MIN:MAX] [master_addr=HOST] "
    "SCRIPT.py [ARGS ...] | -m MODULE [ARGS ...]"
)


@dataclass
class RunConfig(LaunchOptions):
    """ddpkit's options of ``ddpkit run``: the key=value words before the script (the launch options first)."""

    device: str = "auto"
    """auto: ddpkit.init() gives each worker a GPU of its own where CUDA is available (nproc at most the GPUs); cpu: the workers see no GPU (CUDA_VISIBLE_DEVICES empty)."""
    log_dir: str = ""
    """Folder of each rank's whole stdout and stderr (rank-N.stdout.log, rank-N.stderr.log; a restart k's in
    restart-k/), created for this launch (taken already: log_dir-2, -3...); empty: a new folder under
    <tmp>/ddpkit-logs-<uid>/, which keeps the newest 20 launches' folders; named on the first line."""

    def __post_init__(self) -> None:
        check_choice("device", self.device, ("auto", "cpu"))
        super().__post_init__()


@dataclass(frozen=True)
class ScriptTarget:
    """The program each worker runs: a script path or a module name, and its arguments."""

    path: str = ""
    """Path of the script, as given (relative to the current folder); empty for a module."""
    module: str = ""
    """Module name given with -m; empty for a script."""
    args: tuple[str, ...] = ()
    """The program's arguments: sys.argv[1:] in every worker."""

    def __post_init__(self) -> None:
        assert bool(self.path) != bool(self.module), "a target is either a script or a module"


def parse_run_command(words: Sequence[str]) -> tuple[RunConfig, ScriptTarget]:
    """ddpkit's options and the program to run, from the words after ``ddpkit run``.

    Raises:
        ConfigError: no script or module given, an unknown or bad option, a
            script that does not exist, or a module that cannot be found.
    """
    options, target = _split(words)
    config = parse(RunConfig, options)
    if target.path and not os.path.isfile(target.path):
        what = "is a folder, not a Python file" if os.path.isdir(target.path) else "does not exist"
        raise ConfigError(
            f"script {target.path!r} {what}; give the path of a .py file "
            f"(relative paths start from the current folder {os.getcwd()})"
        )
    if target.module and not _module_exists(target.module.partition(".")[0]):
        raise ConfigError(
            f"no module named {target.module.partition('.')[0]!r} in the current folder or on "
            f"sys.path; check the name after -m, or run the command from the folder that holds it"
        )
    return config, target


def wants_run_help(words: Sequence[str]) -> bool:
    """True if -h or --help comes before the program (after it, the words are the program's)."""
    for word in words:
        if word in ("-h", "--help"):
            return True
        if word.startswith("-m") or word.endswith(".py"):
            return False
    return False


def _split(words: Sequence[str]) -> tuple[list[str], ScriptTarget]:
    # The first word ending in .py, or -m, starts the program's command line:
    # nothing after it is ddpkit's, as with `python [options] script.py args`.
    for i, word in enumerate(words):
        if word.startswith("-m"):  # -m MODULE, or -mMODULE as python also accepts
            module = word[2:] or (words[i + 1] if i + 1 < len(words) else "")
            if not module:
                raise ConfigError(f"-m needs a module name; {USAGE}")
            rest = words[i + 1 :] if word[2:] else words[i + 2 :]
            return list(words[:i]), ScriptTarget(module=module, args=tuple(rest))
        if word.endswith(".py"):
            return list(words[:i]), ScriptTarget(path=word, args=tuple(words[i + 1 :]))
    raise ConfigError(f"no script to run (a path ending in .py, or -m MODULE); {USAGE}")


def _module_exists(top_level: str) -> bool:
    # Only the top-level name: finding `pkg.mod` would import `pkg`, running the
    # user's code in the launcher. The current folder first, as in the workers.
    if importlib.machinery.PathFinder.find_spec(top_level, [os.getcwd()]) is not None:
        return True
    try:
        return importlib.util.find_spec(top_level) is not None
    except (ImportError, ValueError):
        return False


def run_script(target: ScriptTarget) -> None:
    """Run ``target`` as ``__main__`` in this worker, as ``python SCRIPT.py ARGS`` (or ``-m MODULE``) would.

    Module-level: spawned workers unpickle it by reference.

    Raises:
        SystemExit: the program exited with a non-zero status (this rank fails with it).
        Exception: whatever the program raised (the launcher reports it).
    """
    # As python does: the script's folder first on sys.path (symlinks resolved);
    # for -m, the current folder.
    folder = os.path.dirname(os.path.realpath(target.path)) if target.path else os.getcwd()
    sys.path.insert(0, folder)
    sys.argv = [target.path or target.module, *target.args]  # run_module sets argv[0] to the module's file
    try:
        if target.path:
            runpy.run_path(target.path, run_name="__main__")
        else:
            runpy.run_module(target.module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        # sys.exit(), sys.exit(0): success. Returning matters: a worker that
        # exits 0 without handing back a result leaves torch's agent waiting.
        if e.code not in (None, 0):
            raise


def worker_environ(config: RunConfig, num_gpus: int) -> dict[str, str]:
    """Variables the workers get on top of the launcher's environment: none, or no GPU for device=cpu.

    Raises:
        ConfigError: device=auto with more workers than visible GPUs (one line naming the fixes).
        UserError: DDPKIT_MALLOC names no choice (ddpkit.allocator), which every worker's init would refuse.
    """
    from ddpkit.allocator import setting
    from ddpkit.distributed import gpu_shortage

    setting(os.environ)

    if config.device == "cpu":
        return {"CUDA_VISIBLE_DEVICES": ""}  # ddpkit.init()'s device auto, and torch.cuda, then see no GPU
    shortage = gpu_shortage(config.nproc, num_gpus, config.device)
    if shortage is not None:
        raise ConfigError(shortage)
    return {}


def describe(config: RunConfig, target: ScriptTarget) -> str:
    """One line for the start of a run: the program and the options."""
    program = target.path or f"-m {target.module}"
    said_after = ("show_ranks", "log_dir")  # the launcher's line says what the console shows, and where the rest is
    options = " ".join(
        f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config) if f.name not in said_after
    )
    return f"ddpkit run: {program} on {config.nproc} worker(s) ({options})"
