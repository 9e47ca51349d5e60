"""``ddpkit slurm``: write, print or submit the sbatch script of a training job.

Words are key=value, as for every command: the keys of :class:`SlurmConfig`
name the Slurm resources and how to launch; any other key=value word is a
training option that every worker's ``python -m ddpkit train`` receives
(checked against ``ddpkit train``'s options here, before anything is
submitted); ``train.KEY=VALUE`` says so explicitly, and every word after
``--`` is passed on unread (the arguments of ``command=``)::

    ddpkit slurm nodes=2 tasks_per_node=4 gpus_per_node=4 time=2:00:00 \\
        launch=torchrun preempt_signal=USR1 model=mlp epochs=5
    ddpkit slurm ... output_script=train.sbatch      # write it
    ddpkit slurm ... submit=true                     # sbatch it, print the job id
    ddpkit slurm nodes=1-4 tasks_per_node=2 model=cnn  # elastic: goes on while one node is left

The environment is the virtual environment ddpkit runs from unless
``venv``, ``modules`` or ``apptainer`` says otherwise. The former
``--flag value`` spelling is refused with a line naming the key=value form.
Every job writes into its own run folder (``runs/<model>-<dataset>/slurm-<job
id>``, see ``ddpkit train --help``: output_dir), so resubmitting the same
script starts a new run and a requeued job continues its own. See
:mod:`ddpkit.launchers.sbatch` for what the script does.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from ddpkit.commands.help import CommandHelp
from ddpkit.errors import UserError
from ddpkit.keyvalue import ConfigError, check_choice, parse
from ddpkit.launchers.sbatch import ENV_MODES, LAUNCH_MODES, SbatchSpec, SlurmResources, render_sbatch
from ddpkit.launchers.sbatch_elastic import split_node_range
from ddpkit.train.config import TrainConfig

SBATCH_MISSING = "sbatch not found: install Slurm's client or run without submit=true"
NODE_LOCAL_PREFIXES = ("/tmp/", "/var/tmp/", "/dev/shm/", "/run/")
"""Folders that are on each node's own disk on most clusters: other nodes do not see what is there."""
_DEFAULTS: dict[str, Any] = {field.name: field.default for field in dataclasses.fields(SbatchSpec)}


@dataclasses.dataclass(frozen=True)
class SlurmConfig(SlurmResources):
    """Options of ``ddpkit slurm``; every field can be set as key=value.

    The resources (nodes to output files) are :class:`~ddpkit.launchers.sbatch.SlurmResources`, shared with
    :class:`~ddpkit.launchers.sbatch.SbatchSpec`; the rest says how to launch and what to do with the script.
    """

    min_nodes: int = 0
    """Elastic job: the fewest nodes it goes on with when others fail; nodes=MIN-MAX (or MIN:MAX) sets both;
    0: exactly nodes."""
    launch: str = "srun"
    """How workers start: srun (a task per worker; in an elastic job, ddpkit's launcher per node), torchrun
    (one per node) or mpirun (OpenMPI ranks)."""
    env: str = "auto"
    """Software environment: venv, modules or apptainer; auto: apptainer with apptainer=, modules with only
    modules=, else venv."""
    venv: str = ""
    """Virtual environment to activate; empty: the one running ddpkit."""
    modules: str = ""
    """Comma-separated environment modules to load first, e.g. modules=cuda/12.4,python/3.11."""
    apptainer: str = ""
    """Apptainer image every worker runs in."""
    project_root: str = ""
    """Folder the job runs in (--chdir); empty: the current folder. Every node must see it."""
    python: str = "python"
    """Python executable of the workers, inside the environment."""
    command: str = ""
    """Run this instead of `python -m ddpkit train`, e.g. command="python my_train.py"; words after -- follow it."""
    nccl_debug: str = ""
    """NCCL_DEBUG: VERSION, WARN, INFO or TRACE; empty leaves it unset."""
    nccl_debug_subsys: str = ""
    """NCCL_DEBUG_SUBSYS, e.g. INIT,NET; empty leaves it unset."""
    stage_data: str = ""
    """Data folder on shared storage to copy to node-local storage on every node first; empty: no staging."""
    stage_data_to: str = _DEFAULTS["stage_data_to"]
    """The node-local copy; $VAR is expanded on the node."""
    stage_data_key: str = _DEFAULTS["stage_data_key"]
    """Training option given the node-local path (empty: none)."""
    preempt_signal: str = ""
    """Signal the training processes get before the time limit, e.g. USR1; they checkpoint, and the job
    is requeued."""
    preempt_grace: int = _DEFAULTS["preempt_grace_seconds"]
    """Seconds before the time limit that preempt_signal is sent."""
    requeue: str = "auto"
    """Make the job requeueable: true, false, or auto (true with preempt_signal)."""
    output_script: str = ""
    """Write the script to this file (else it is printed, unless submit=true)."""
    submit: bool = False
    """Submit the script with sbatch and print the job id."""

    def __post_init__(self) -> None:
        check_choice("launch", self.launch, LAUNCH_MODES)
        check_choice("env", self.env, ("auto", *ENV_MODES))
        check_choice("requeue", str(self.requeue).lower(), ("auto", "true", "false"))


SLURM_HELP = CommandHelp(
    usage="ddpkit slurm [key=value ...] [training key=value ...] [-- words for command=]",
    summary="Write, print or submit an sbatch script that trains with ddpkit: #SBATCH resources, the "
    "environment (venv, modules or Apptainer), the rendezvous, and the launch (srun, torchrun or "
    "mpirun). Key=value words that are not the options below are training options, checked against "
    "ddpkit train's (ddpkit train --help); train.KEY=VALUE says so explicitly. Each job trains into its "
    "own folder runs/<model>-<dataset>/slurm-<job id>.",
    schema="ddpkit.commands.slurm:SlurmConfig",
    examples=(
        "ddpkit slurm nodes=2 tasks_per_node=4 gpus_per_node=4 time=2:00:00 model=cnn epochs=5",
        'ddpkit slurm nodes=2 tasks_per_node=2 launch=mpirun command="python train.py" submit=true',
        "ddpkit slurm launch=torchrun preempt_signal=USR1 output_script=train.sbatch",
        "ddpkit slurm nodes=2-4 tasks_per_node=4 requeue=true model=cnn   # elastic: goes on while 2 nodes are left",
    ),
)
"""What ``ddpkit slurm --help`` shows."""


def split_words(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """(ddpkit slurm's words, the training words, the words after ``--``) from the words after ``ddpkit slurm``.

    Raises:
        ConfigError: a ``--flag`` (the former spelling) before ``--``.
    """
    argv = list(argv)
    head, tail = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    own_keys = {field.name for field in dataclasses.fields(SlurmConfig)}
    own, train = [], []
    for i, word in enumerate(head):
        if word.startswith("-"):
            value = head[i + 1] if i + 1 < len(head) and not head[i + 1].startswith("-") else ""
            raise ConfigError(_new_spelling(word, value if "=" not in value else ""))
        key = word.split("=", 1)[0].split(".", 1)[0]
        if "=" not in word or key in own_keys:
            own.append(word)  # a YAML file of slurm options, or one of them
        else:
            train.append(word.removeprefix("train."))
    return own, train, tail


def _new_spelling(flag: str, following: str) -> str:
    """The error for a former ``--flag [value]``: the key=value word to write instead."""
    aliases = {
        "N": "nodes",
        "c": "cpus_per_task",
        "p": "partition",
        "A": "account",
        "t": "time",
        "J": "job_name",
        "o": "output",
        "e": "error",
        "ntasks-per-node": "tasks_per_node",
        "module": "modules",
        "no-requeue": "requeue",
    }
    name, _, inline = flag.lstrip("-").partition("=")
    key = aliases.get(name, name.replace("-", "_"))
    switches = {"submit": "true", "requeue": "true", "no-requeue": "false"}
    value = switches.get(name) or inline or following or "VALUE"
    given = flag if name in switches or inline or not following else f"{flag} {following}"
    return f"ddpkit slurm takes key=value words: write {given} as {key}={value} (ddpkit slurm --help lists them)"


def spec_from_config(config: SlurmConfig, train_args: Sequence[str], unread: Sequence[str] = ()) -> SbatchSpec:
    """The SbatchSpec that the options describe; ``train_args`` are checked as ``ddpkit train``'s, ``unread`` not.

    Raises:
        UserError: they do not make one (no environment, bad time, ...).
    """
    env_mode = config.env if config.env != "auto" else _infer_env_mode(config)
    venv = config.venv
    if env_mode == "venv" and not venv:
        venv = _running_venv()
        if not venv:
            raise UserError("no environment to run in: pass venv=PATH, modules=NAME or apptainer=IMAGE")
    max_restarts = 0
    if not config.command:  # the workers run `ddpkit train`: check its words here, not on the cluster
        max_restarts = _check_train_words(train_args).max_restarts
        # A worker of torchrun restarts nothing itself: the launcher does, told by its own option.
        train_args = [word for word in train_args if word.split("=", 1)[0] != "max_restarts"]
    signal_name = config.preempt_signal.upper().removeprefix("SIG")
    requeue = str(config.requeue).lower()
    # The resources are the options of the same names (SlurmConfig extends SlurmResources).
    resources = {field.name: getattr(config, field.name) for field in dataclasses.fields(SlurmResources)}
    return SbatchSpec(
        **{**resources, "time": str(config.time)},
        launch_mode=config.launch,
        env_mode=env_mode,
        venv=_absolute(venv),
        modules=tuple(m.strip() for m in config.modules.split(",") if m.strip()),
        apptainer_image=_absolute(config.apptainer),
        project_root=_absolute(config.project_root or os.getcwd()),
        nccl_debug=config.nccl_debug.upper(),
        nccl_debug_subsys=config.nccl_debug_subsys,
        stage_data_from=_absolute(config.stage_data),
        stage_data_to=config.stage_data_to,
        stage_data_key=config.stage_data_key,
        preempt_signal=signal_name,
        preempt_grace_seconds=config.preempt_grace,
        requeue=bool(signal_name) if requeue == "auto" else requeue == "true",
        train_args=(*train_args, *unread),
        python=config.python,
        command=_command_words(config.command),
        max_restarts=max_restarts,
        min_nodes=config.min_nodes,
    )


def _command_words(command: str) -> tuple[str, ...]:
    """The words of ``command`` as a shell splits them.

    Raises:
        ConfigError: an unclosed quotation or a trailing backslash.
    """
    try:
        return tuple(shlex.split(command))
    except ValueError as e:
        raise ConfigError(
            f"command={command!r} cannot be split into words ({str(e).lower()}); close each quotation, "
            "e.g. 'command=python train.py --name \"a b\"'"
        ) from None


def _check_train_words(words: Sequence[str]) -> TrainConfig:
    from ddpkit.train.config import parse_train_config

    try:
        return parse_train_config(words)
    except ConfigError as e:
        raise ConfigError(f"training option: {e}") from None


def node_local_warnings(spec: SbatchSpec) -> list[str]:
    """Warnings for paths the job needs on every node that are on one node's own disk."""
    paths = {
        "project_root (the job's --chdir)": spec.project_root,
        "venv": spec.venv,
        "apptainer": spec.apptainer_image,
    }
    return [
        f"warning: {name} {path} is node-local on most clusters: the other nodes (and this one, "
        "in a later job) may not see it; use a folder on shared storage"
        for name, path in paths.items()
        if path and (path + "/").startswith(NODE_LOCAL_PREFIXES)
    ]


def main(argv: Sequence[str]) -> int:
    """Run ``ddpkit slurm`` with argv (the words after "slurm").

    Returns:
        0 on success, sbatch's status when it fails.

    Raises:
        UserError: bad input, or sbatch missing with submit=true.
    """
    own, train, unread = split_words(argv)
    config = parse(SlurmConfig, split_node_range(own))
    spec = spec_from_config(config, train, unread)
    for warning in node_local_warnings(spec):
        print(warning, file=sys.stderr)
    script = render_sbatch(spec)
    if config.output_script:
        with open(config.output_script, "w") as f:
            f.write(script)
        os.chmod(config.output_script, 0o755)
        print(f"wrote {config.output_script}", file=sys.stderr)
    if config.submit:
        _make_log_folders(spec)
        return _submit(script, config.output_script)
    if not config.output_script:
        sys.stdout.write(script)
    return 0


def _submit(script: str, path: str) -> int:
    """sbatch the script (the written file, else on stdin) and print the job id."""
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise UserError(SBATCH_MISSING)
    command = [sbatch, "--parsable", *([path] if path else [])]
    result = subprocess.run(command, input=None if path else script, capture_output=True, text=True)
    if result.returncode != 0:
        reason = " ".join(result.stderr.split()) or f"exit status {result.returncode}"
        print(f"ddpkit slurm: error: sbatch failed: {reason}", file=sys.stderr)
        return result.returncode
    # --parsable prints "jobid" or "jobid;cluster".
    print(result.stdout.strip().split(";")[0])
    return 0


def _make_log_folders(spec: SbatchSpec) -> None:
    """Create the folders of the output files: Slurm does not, and the job would fail without a word."""
    for path in (spec.output, spec.error):
        folder = os.path.dirname(path)
        if folder and "%" not in folder:
            os.makedirs(os.path.join(spec.project_root, folder), exist_ok=True)


def _infer_env_mode(config: SlurmConfig) -> str:
    if config.apptainer:
        return "apptainer"
    if config.modules and not config.venv:
        return "modules"
    return "venv"


def _running_venv() -> str:
    """The virtual environment of this Python, or "" outside one."""
    return sys.prefix if sys.prefix != sys.base_prefix else ""


def _absolute(path: str) -> str:
    # Paths are resolved where the script is written; the job may run elsewhere.
    # $VAR paths are left for the batch shell.
    return os.path.abspath(os.path.expanduser(path)) if path and not path.startswith("$") else path
