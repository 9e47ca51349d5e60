"""sbatch scripts for ddpkit training jobs: ``render_sbatch(SbatchSpec(...))``.

``render_sbatch`` is a pure function from a :class:`SbatchSpec` to the text
of a batch script; ``ddpkit slurm`` (:mod:`ddpkit.commands.slurm`) prints,
writes or submits it. The script has four parts, in this order:

1. ``#SBATCH`` directives: nodes, tasks per node, GPUs per node, CPUs per
   task, partition, account, QoS, time limit, output files, ``--chdir`` to
   the project root, preemption signal and requeue.
2. The software environment, one of three ``env_mode``\\ s:

   - ``venv``: ``source <venv>/bin/activate`` (after ``module load`` of any
     listed modules, for clusters where Python itself is a module);
   - ``modules``: ``module load ...``, then ``python`` from the PATH;
   - ``apptainer``: every process runs inside the image,
     ``apptainer exec [--nv] -B <project root> <image> ...``; ``--nv`` (the
     host's NVIDIA driver) when GPUs are requested. Listed modules (say,
     apptainer itself) are loaded first.

   When modules are listed the script is a login shell (``#!/bin/bash -l``):
   a login shell's profile is what defines ``module``.

3. Job-wide variables: ``MASTER_ADDR`` is the first node of the job (the
   batch script runs there) and ``MASTER_PORT`` is derived from the job id
   exactly as :func:`ddpkit.env.ports.port_from_job_id` does, then moved up
   while something already listens on it, so every worker agrees on it and it
   is checked; ``OMP_NUM_THREADS`` is the CPUs per task;
   ``NCCL_DEBUG``/``NCCL_DEBUG_SUBSYS`` when asked; node-local data staging
   (one copy per node, before training starts).
4. The launch, one of three ``launch_mode``\\ s, each running
   ``python -m ddpkit train <train_args>`` (or ``command``) once per worker:

   - ``srun``: one Slurm task per worker; ddpkit reads SLURM_* itself::

         srun --nodes=N --ntasks-per-node=T --cpus-per-task=C python -m ddpkit train ...

   - ``torchrun``: one Slurm task per node, each a torchrun starting T
     workers, joined by a c10d rendezvous on the first node::

         srun --ntasks-per-node=1 torchrun --nnodes=N --nproc-per-node=T
             --rdzv-backend=c10d --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT -m ddpkit train ...

   - ``mpirun``: OpenMPI's mpirun (built with Slurm support, it reads the
     allocation itself) starts N*T ranks, T per node; ddpkit reads OMPI_*::

         mpirun -np N*T --map-by ppr:T:node --bind-to none python -m ddpkit train ...

An elastic job (``min_nodes``: ``ddpkit slurm nodes=MIN-MAX``) asks for a
node range, survives the loss of nodes and starts one launcher per node:
:mod:`ddpkit.launchers.sbatch_elastic`.

Preemption (``preempt_signal``, e.g. "USR1"): the script asks Slurm for
``--signal=B:USR1@<grace>``, i.e. the signal goes to the *batch shell*
``grace`` seconds before the time limit. A trap in the shell passes it to
the launcher: srun forwards it to its job step, where Slurm signals every
process of the step (the workers, and under torchrun the workers and
torchrun, which ignores it); OpenMPI's mpirun forwards SIGUSR1 and SIGUSR2
to its ranks. Each training process gets the signal once, checkpoints and
exits 0; its handler should only set a flag, acted on between steps, since
a signal can come at any instruction. When the launcher has returned, the
script runs ``scontrol requeue $SLURM_JOB_ID`` (if ``requeue``): the job
goes back to the queue, keeps its id, and its next run resumes from the
checkpoint (SLURM_RESTART_COUNT counts the restarts). ``--open-mode=append``
keeps the output of every run in the same files. Slurm sends ``--signal``
before the time limit; before preempting a job for another it sends it only
if the cluster sets ``SlurmctldParameters=preempt_send_user_signal``.

Why ``B:`` and a trap rather than ``--signal=USR1@<grace>``, which signals
every job step directly: that form misses the ranks of mpirun (they are not
in a job step: mpirun runs them from the batch shell), and the batch shell,
which it does not signal, cannot tell a preempted run from a finished one,
so it cannot decide to requeue. Why torchrun ignores the signal: its
workers get it from Slurm already, and torchrun's own handling (with
``--signals-to-handle``) stops its workers and exits non-zero, whereupon
srun (``--kill-on-bad-exit``) kills the other nodes' workers, perhaps in
the middle of writing the checkpoint. The trap needs the launcher in the
background and ``wait``: bash runs a trap only between commands, and
``wait`` returns early (status > 128) when one runs, so the script waits
again until the launcher has really exited.
"""

from __future__ import annotations

import re
import shlex
import signal
from dataclasses import dataclass

from ddpkit.env.ports import JOB_PORT_BASE, JOB_PORT_SPAN
from ddpkit.errors import UserError
from ddpkit.launchers.sbatch_elastic import elastic_directives, elastic_launcher, validate_elastic
from ddpkit.launchers.slurm_time import time_limit_seconds

LAUNCH_MODES = ("srun", "torchrun", "mpirun")
"""Ways to start the workers, see the module docstring."""
ENV_MODES = ("venv", "modules", "apptainer")
"""Ways to set up the software environment, see the module docstring."""
NCCL_DEBUG_LEVELS = ("VERSION", "WARN", "INFO", "TRACE")
"""Values NCCL accepts for NCCL_DEBUG."""

DEFAULT_COMMAND = ("-m", "ddpkit", "train")
"""What each worker runs after the Python executable unless ``command`` is given."""

# Values written into #SBATCH lines: sbatch splits them at whitespace.
_DIRECTIVE_VALUE = re.compile(r"[^\s'\"]+")
# Paths expanded by the batch shell (staging): $VAR and ${VAR} allowed, but
# nothing that runs a command or ends the double quotes around them.
_SHELL_PATH = re.compile(r"(?:[^\s\"'`\\$]|\$[A-Za-z_][A-Za-z0-9_]*|\$\{[A-Za-z_][A-Za-z0-9_]*\})+")
# Signals a shell cannot trap, or that Slurm and the launchers use themselves.
_UNUSABLE_SIGNALS = {"KILL", "STOP", "CHLD", "CONT"}


@dataclass(frozen=True)
class SlurmResources:
    """What a job asks Slurm for in its ``#SBATCH`` lines: nodes, tasks, GPUs, CPUs, where, how long, its name and output.

    Declared once: :class:`SbatchSpec` and ``ddpkit slurm``'s options
    (:class:`ddpkit.commands.slurm.SlurmConfig`) extend it. Empty strings and
    zeros mean "not set": the directive is left out and the cluster's default applies.
    """

    nodes: int = 1
    """Number of nodes (--nodes); the most nodes of an elastic job (see min_nodes)."""
    tasks_per_node: int = 1
    """Workers per node: Slurm tasks, torchrun processes or MPI ranks (--ntasks-per-node)."""
    gpus_per_node: int = 0
    """GPUs per node (--gpus-per-node); 0 requests none."""
    cpus_per_task: int = 1
    """CPU cores per worker (--cpus-per-task)."""
    partition: str = ""
    """Partition to run in; empty for the cluster's default."""
    account: str = ""
    """Account charged for the job; empty for the user's default."""
    qos: str = ""
    """Quality of service; empty for the default."""
    time: str = ""
    """Time limit, e.g. 90 (minutes), 2:00:00, 1-12:00; empty for the partition's."""
    job_name: str = "ddpkit"
    """Name shown by squeue."""
    output: str = "ddpkit-%j.out"
    """Standard output file, relative to project_root (%j: the job id)."""
    error: str = ""
    """Standard error file; empty: with the standard output."""


@dataclass(frozen=True)
class SbatchSpec(SlurmResources):
    """Everything an sbatch script for a ddpkit job depends on: the resources, and how the job runs.

    Empty strings and zeros mean "not set": the directive or step is left
    out and the cluster's default applies.
    """

    launch_mode: str = "srun"
    """How workers start: "srun", "torchrun" or "mpirun"."""
    env_mode: str = "venv"
    """How the software environment is set up: "venv", "modules" or "apptainer"."""
    venv: str = ""
    """Virtual environment directory to activate (env_mode "venv", or "modules" after the modules)."""
    modules: tuple[str, ...] = ()
    """Environment modules to load before anything else."""
    apptainer_image: str = ""
    """Apptainer image every worker runs in (env_mode "apptainer")."""
    project_root: str = ""
    """Directory the job runs in (--chdir) and apptainer binds; empty for the submit directory."""
    nccl_debug: str = ""
    """NCCL_DEBUG level: VERSION, WARN, INFO or TRACE; empty leaves it unset."""
    nccl_debug_subsys: str = ""
    """NCCL_DEBUG_SUBSYS, e.g. "INIT,NET"; empty leaves it unset."""
    stage_data_from: str = ""
    """Data set directory on shared storage to copy to every node before training; empty: no staging."""
    stage_data_to: str = "/tmp/ddpkit-data-$SLURM_JOB_ID"
    """Node-local directory the data set is copied to; $VAR is expanded on the node."""
    stage_data_key: str = "data_dir"
    """Training config key set to stage_data_to when staging (TrainConfig.data_dir); empty to pass nothing."""
    preempt_signal: str = ""
    """Signal sent to the training processes before the time limit, e.g. "USR1"; empty: none."""
    preempt_grace_seconds: int = 90
    """Seconds before the time limit that preempt_signal is sent."""
    requeue: bool = False
    """Make the job requeueable (--requeue) and requeue it after a preemption signal."""
    train_args: tuple[str, ...] = ()
    """Words after the command, e.g. ("model=mlp", "epochs=1")."""
    python: str = "python"
    """Python executable of the workers, inside the environment."""
    command: tuple[str, ...] = ()
    """Program each worker runs instead of ``python -m ddpkit train``, e.g. ("python", "my_train.py")."""
    max_restarts: int = 0
    """Times torchrun restarts the workers of a node after a failure (launch_mode torchrun, or an elastic job)."""
    min_nodes: int = 0
    """Elastic job: the fewest nodes it runs on, going on when others fail (:mod:`~ddpkit.launchers.sbatch_elastic`);
    0: exactly ``nodes``."""

    def __post_init__(self) -> None:
        _validate(self)


def render_sbatch(spec: SbatchSpec) -> str:
    """The text of the batch script for spec.

    Args:
        spec: The job; validated when it was built.

    Returns:
        A bash script with #SBATCH directives, ending in a newline.
    """
    lines = [_shebang(spec), "# Written by `ddpkit slurm`; submit it with: sbatch <this file>"]
    lines += [f"#SBATCH {d}" for d in _directives(spec)]
    lines += ["", "set -eo pipefail"]
    lines += _environment(spec)
    lines += _rendezvous()
    lines += _threads(spec)
    lines += _nccl(spec)
    lines += _staging(spec)
    lines += _launch(spec)
    return "\n".join(lines) + "\n"


def _shebang(spec: SbatchSpec) -> str:
    # `module` is a shell function that a login shell's /etc/profile defines.
    return "#!/bin/bash -l" if spec.modules else "#!/bin/bash"


def _directives(spec: SbatchSpec) -> list[str]:
    nodes = elastic_directives(spec) if spec.min_nodes else [f"--nodes={spec.nodes}"]
    out = [f"--job-name={spec.job_name}", *nodes, f"--ntasks-per-node={spec.tasks_per_node}"]
    if spec.gpus_per_node:
        out.append(f"--gpus-per-node={spec.gpus_per_node}")
    out.append(f"--cpus-per-task={spec.cpus_per_task}")
    for name in ("partition", "account", "qos", "time", "output", "error"):
        value = getattr(spec, name)
        if value:
            out.append(f"--{name}={value}")
    if spec.project_root:
        out.append(f"--chdir={spec.project_root}")
    if spec.preempt_signal:
        out.append(f"--signal=B:{spec.preempt_signal}@{spec.preempt_grace_seconds}")
    if spec.requeue:
        out += ["--requeue", "--open-mode=append"]
    return out


def _environment(spec: SbatchSpec) -> list[str]:
    out = ["", "# Software environment"]
    if spec.modules:
        out.append("module load " + " ".join(shlex.quote(m) for m in spec.modules))
    if spec.venv:
        out.append(f"source {shlex.quote(spec.venv.rstrip('/') + '/bin/activate')}")
    if spec.env_mode == "apptainer":
        out.append(f"# Every worker runs inside {spec.apptainer_image} (apptainer exec, below).")
    return out


def _rendezvous() -> list[str]:
    return [
        "",
        "# Rendezvous on the first node, where this script runs, at a port derived from the",
        "# job id (as ddpkit.env.ports.port_from_job_id does), moved up while it is taken.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT=$(( {JOB_PORT_BASE} + SLURM_JOB_ID % {JOB_PORT_SPAN} ))",
        'while (exec 3<>"/dev/tcp/$MASTER_ADDR/$MASTER_PORT") 2>/dev/null; do MASTER_PORT=$(( MASTER_PORT + 1 )); done',
        "export MASTER_ADDR MASTER_PORT",
    ]


def _threads(spec: SbatchSpec) -> list[str]:
    return [
        "",
        "# One OpenMP thread per CPU of a worker: torch would otherwise start one per core of the node.",
        f"export OMP_NUM_THREADS={spec.cpus_per_task}",
    ]


def _nccl(spec: SbatchSpec) -> list[str]:
    out = [f"export NCCL_DEBUG={spec.nccl_debug}"] if spec.nccl_debug else []
    if spec.nccl_debug_subsys:
        out.append(f"export NCCL_DEBUG_SUBSYS={spec.nccl_debug_subsys}")
    return ["", "# NCCL diagnostics", *out] if out else []


def _staging(spec: SbatchSpec) -> list[str]:
    if not spec.stage_data_from:
        return []
    return [
        "",
        "# Copy the data set to node-local storage, once per node, before training.",
        f'STAGED_DATA="{spec.stage_data_to}"',
        f"srun --nodes={spec.nodes} --ntasks={spec.nodes} --ntasks-per-node=1 \\",
        f'    bash -c \'mkdir -p "$1" && cp -a "$2/." "$1/"\' stage "$STAGED_DATA" {shlex.quote(spec.stage_data_from)}',
    ]


def _worker_command(spec: SbatchSpec) -> str:
    """The program and arguments of one worker, as shell words."""
    words = spec.command or (spec.python, *DEFAULT_COMMAND)
    return " ".join(shlex.quote(w) for w in (*words, *spec.train_args)) + _staged_arg(spec)


def _staged_arg(spec: SbatchSpec) -> str:
    # Double quotes: $STAGED_DATA is expanded by the batch shell.
    if spec.stage_data_from and spec.stage_data_key:
        return f' "{spec.stage_data_key}=$STAGED_DATA"'
    return ""


def _container_prefix(spec: SbatchSpec) -> str:
    if spec.env_mode != "apptainer":
        return ""
    root = shlex.quote(spec.project_root) if spec.project_root else '"$SLURM_SUBMIT_DIR"'
    binds = f"-B {root}"
    if spec.stage_data_from:
        binds += ' -B "$STAGED_DATA"'
    nv = "--nv " if spec.gpus_per_node else ""
    return f"apptainer exec {nv}{binds} {shlex.quote(spec.apptainer_image)} "


def _launcher(spec: SbatchSpec) -> list[str]:
    """The launch command as lines joined by backslash-newlines."""
    container = _container_prefix(spec)
    n, t, c = spec.nodes, spec.tasks_per_node, spec.cpus_per_task
    # torchrun ignores the preemption signal (see the module docstring).
    sig = spec.preempt_signal
    ignore = f'bash -c \'trap "" {sig}; exec "$@"\' ignore-{sig} ' if sig else ""
    if spec.min_nodes:
        return elastic_launcher(spec, container, ignore)
    # srun reads no --cpus-per-task from sbatch's environment (Slurm 22.05 to 23.02),
    # so every step states its own.
    if spec.launch_mode == "srun":
        return [
            f"srun --nodes={n} --ntasks-per-node={t} --cpus-per-task={c} --kill-on-bad-exit=1",
            f"    {container}{_worker_command(spec)}",
        ]
    if spec.launch_mode == "torchrun":
        if spec.command:
            worker = "--no-python " + _worker_command(spec)
        else:
            worker = " ".join(shlex.quote(w) for w in (*DEFAULT_COMMAND, *spec.train_args)) + _staged_arg(spec)
        # One task per node holding the CPUs of all its workers.
        return [
            f"srun --nodes={n} --ntasks={n} --ntasks-per-node=1 --cpus-per-task={t * c} --kill-on-bad-exit=1",
            f"    {container}{ignore}torchrun --nnodes={n} --nproc-per-node={t}{_restarts(spec)}",
            '    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"',
            f"    {worker}",
        ]
    # mpirun: --bind-to none, or OpenMPI pins each rank to one core and torch's threads with it;
    # -x passes variables on to the ranks of other nodes explicitly.
    exported = ["PATH", "MASTER_ADDR", "MASTER_PORT"]
    exported += [name for name in ("NCCL_DEBUG", "NCCL_DEBUG_SUBSYS") if getattr(spec, name.lower())]
    return [
        f"mpirun -np {n * t} --map-by ppr:{t}:node --bind-to none",
        "    " + " ".join(f"-x {name}" for name in exported),
        f"    {container}{_worker_command(spec)}",
    ]


def _restarts(spec: SbatchSpec) -> str:
    """torchrun's option for ``max_restarts`` (its workers resume from the newest checkpoint), or ""."""
    return f" --max-restarts={spec.max_restarts}" if spec.max_restarts else ""


def _launch(spec: SbatchSpec) -> list[str]:
    launcher = _launcher(spec)
    joined = [line + " \\" for line in launcher[:-1]] + [launcher[-1]]
    if not spec.preempt_signal:
        return ["", "# Training", *joined]
    sig = spec.preempt_signal
    requeue = ['if [ "$preempted" = 1 ]; then', '    scontrol requeue "$SLURM_JOB_ID"', "fi"] if spec.requeue else []
    how = {
        "srun": "srun, which signals every process of its step",
        "torchrun": "srun, which signals every process of its step (torchrun ignores it)",
        "mpirun": "mpirun, which forwards it to its ranks",
    }[spec.launch_mode]
    return [
        "",
        f"# Preemption: Slurm sends SIG{sig} to this shell {spec.preempt_grace_seconds} s before the time limit.",
        f"# The trap passes it to {how};",
        "# each training process writes a checkpoint and exits.",
        "preempted=0",
        "interrupted=0",
        "launcher_pid=",
        "on_preempt() {",
        "    preempted=1",
        "    interrupted=1",
        f'    echo "ddpkit: SIG{sig}: asking the training processes to checkpoint and exit" >&2',
        f'    [ -n "$launcher_pid" ] && kill -{sig} "$launcher_pid" 2>/dev/null || true',
        "}",
        f"trap on_preempt {sig}",
        "",
        "# Training, in the background: bash runs the trap only between commands.",
        *joined[:-1],
        joined[-1] + " &",
        "launcher_pid=$!",
        "# wait returns early when the trap runs; wait again until the launcher has exited.",
        "while :; do",
        "    interrupted=0",
        '    status=0; wait "$launcher_pid" || status=$?',
        '    [ "$interrupted" = 1 ] || break',
        "done",
        *requeue,
        'exit "$status"',
    ]


def _validate(spec: SbatchSpec) -> None:
    """Raise ValueError naming the first wrong field of spec and its fix."""
    for name in ("nodes", "tasks_per_node", "cpus_per_task"):
        value = getattr(spec, name)
        if not isinstance(value, int) or value < 1:
            raise UserError(f"{name}={value!r} must be an integer >= 1")
    if not isinstance(spec.gpus_per_node, int) or spec.gpus_per_node < 0:
        raise UserError(f"gpus_per_node={spec.gpus_per_node!r} must be an integer >= 0")
    if spec.launch_mode not in LAUNCH_MODES:
        raise UserError(f"launch_mode={spec.launch_mode!r} is unknown; choose one of: {', '.join(LAUNCH_MODES)}")
    if not isinstance(spec.max_restarts, int) or spec.max_restarts < 0:
        raise UserError(f"max_restarts={spec.max_restarts!r} must be an integer >= 0")
    if spec.max_restarts and spec.launch_mode != "torchrun" and not spec.min_nodes:
        raise UserError(
            f"max_restarts={spec.max_restarts} needs launch=torchrun: srun and mpirun do not restart a job's "
            "workers; pass launch=torchrun, or requeue=true to have Slurm start the job again from its checkpoint"
        )
    validate_elastic(spec)
    if spec.env_mode not in ENV_MODES:
        raise UserError(f"env_mode={spec.env_mode!r} is unknown; choose one of: {', '.join(ENV_MODES)}")
    for name in ("job_name", "partition", "account", "qos", "output", "error", "project_root"):
        value = getattr(spec, name)
        if value and not _DIRECTIVE_VALUE.fullmatch(value):
            raise UserError(f"{name}={value!r} contains whitespace or quotes, which #SBATCH lines cannot hold")
    if not spec.job_name:
        raise UserError("job_name is empty; give the job a name")
    if not spec.output:
        raise UserError("output is empty; give a file name such as ddpkit-%j.out")
    if spec.time:
        time_limit_seconds(spec.time)
    _validate_environment(spec)
    if spec.nccl_debug and spec.nccl_debug not in NCCL_DEBUG_LEVELS:
        raise UserError(f"nccl_debug={spec.nccl_debug!r} is unknown; choose one of: {', '.join(NCCL_DEBUG_LEVELS)}")
    if spec.nccl_debug_subsys and not re.fullmatch(r"\^?[A-Za-z0-9_]+(,[A-Za-z0-9_]+)*", spec.nccl_debug_subsys):
        raise UserError(f"nccl_debug_subsys={spec.nccl_debug_subsys!r} is not a comma-separated list such as INIT,NET")
    if spec.stage_data_from:
        for name in ("stage_data_from", "stage_data_to"):
            value = getattr(spec, name)
            if not (_SHELL_PATH.fullmatch(value) and value.startswith(("/", "$"))):
                raise UserError(f"{name}={value!r} must be an absolute path without spaces or quotes ($VAR allowed)")
        if spec.stage_data_key and not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.]*", spec.stage_data_key):
            raise UserError(f"stage_data_key={spec.stage_data_key!r} is not a config key such as data_dir")
    _validate_preemption(spec)
    if not spec.python:
        raise UserError("python is empty; give the workers' Python executable, e.g. python")
    for name in ("modules", "train_args", "command"):
        value = getattr(spec, name)
        if not isinstance(value, tuple) or not all(isinstance(w, str) for w in value):
            raise UserError(f"{name}={value!r} must be a tuple of strings")


def _validate_environment(spec: SbatchSpec) -> None:
    if spec.env_mode == "venv" and not spec.venv:
        raise UserError("env_mode='venv' needs venv, the virtual environment directory; or choose modules or apptainer")
    if spec.env_mode == "modules" and not spec.modules:
        raise UserError("env_mode='modules' needs at least one module to load; or choose venv or apptainer")
    if spec.env_mode == "apptainer":
        if not spec.apptainer_image:
            raise UserError("env_mode='apptainer' needs apptainer_image, the image file; or choose venv or modules")
        if spec.venv:
            raise UserError("venv is not used with env_mode='apptainer'; put the Python environment in the image")
    elif spec.apptainer_image:
        raise UserError(f"apptainer_image is set but env_mode={spec.env_mode!r}; set env_mode='apptainer'")


def _validate_preemption(spec: SbatchSpec) -> None:
    if not isinstance(spec.preempt_grace_seconds, int) or not 0 < spec.preempt_grace_seconds <= 65535:
        raise UserError(f"preempt_grace_seconds={spec.preempt_grace_seconds!r} must be an integer in 1..65535")
    if not spec.preempt_signal:
        return
    valid = sorted(s.name[3:] for s in signal.Signals if s.name.startswith("SIG") and not s.name.startswith("SIG_"))
    if spec.preempt_signal not in valid or spec.preempt_signal in _UNUSABLE_SIGNALS:
        usable = [s for s in valid if s not in _UNUSABLE_SIGNALS]
        raise UserError(
            f"preempt_signal={spec.preempt_signal!r} is not a signal name a shell can trap; "
            f"use USR1 or USR2 (or one of {', '.join(usable)}), without the SIG prefix"
        )
    if spec.time and time_limit_seconds(spec.time) <= spec.preempt_grace_seconds:
        raise UserError(
            f"preempt_grace_seconds={spec.preempt_grace_seconds} is not shorter than time={spec.time!r}; "
            "lengthen the time limit or shorten the grace period"
        )
