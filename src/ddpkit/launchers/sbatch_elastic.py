"""The launch of an elastic Slurm job: one launcher per node that goes on when a node is lost.

``ddpkit slurm nodes=MIN-MAX`` (sbatch's own spelling of a node range; the
``nodes=MIN:MAX`` of torchrun's ``--nnodes`` is taken too) writes a job that
Slurm starts on MIN to MAX nodes and that goes on training when some of them
fail, as long as MIN are left. Its script differs from a fixed job's in
three places:

- ``#SBATCH --nodes=MIN-MAX`` and ``#SBATCH --no-kill``: without
  ``--no-kill`` Slurm ends the whole job when one of its nodes fails.
- One launcher per node, each starting the node's workers and joining the
  others through torch's dynamic (c10d) rendezvous at
  ``$MASTER_ADDR:$MASTER_PORT``, the first node of the job::

      srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \\
          --cpus-per-task=T*C --no-kill --kill-on-bad-exit=0 --wait=0 \\
          python -m ddpkit train nnodes=MIN:MAX nproc=T master_addr="$MASTER_ADDR" master_port="$MASTER_PORT" ...

  (``launch=torchrun``: ``torchrun --nnodes=MIN:MAX --rdzv-backend=c10d
  --max-restarts=R ...`` in its place). The step's options keep it alive
  when a node goes: ``--no-kill`` (the step is not ended by a node
  failure), ``--kill-on-bad-exit=0`` (nor by one launcher's non-zero
  exit, such as a node that leaves after a preemption notice) and
  ``--wait=0`` (nor by the cluster's WaitTime after the first launcher
  ends). The number of nodes is the allocation's (``$SLURM_JOB_NUM_NODES``):
  Slurm may start the job on fewer than MAX.
- The rendezvous id, and with it the run folder ``slurm-<job id>``, is the
  job id, which a requeued job keeps: after ``scontrol requeue`` (or a
  preemption with ``requeue``) the job's next run rendezvous again under the
  same id and resumes from the newest checkpoint of the same run.

Which node must stay: the first one. The batch script runs there, so Slurm
ends the job when it fails, and the rendezvous store is served there (by its
launcher). To put the store on a machine that does not go away, run
``ddpkit store port=P`` there (a login node) and pass that host and port as
``master_addr``/``master_port`` to ``ddpkit train`` yourself.

torchrun counts every loss of a node as one of its ``--max-restarts``; an
elastic job without ``max_restarts`` gets :data:`ELASTIC_MAX_RESTARTS`.
MPI cannot change the size of a running job, so ``launch=mpirun`` is refused.
"""

from __future__ import annotations

import os
import re
import shlex
from typing import Protocol

from ddpkit.errors import UserError

ELASTIC_MAX_RESTARTS = 3
"""torchrun's --max-restarts in an elastic job that does not set max_restarts: the losses of nodes it survives."""

KEEP_STEP_ALIVE = "--no-kill --kill-on-bad-exit=0 --wait=0"
"""srun's options that keep a step running when one of its nodes fails or one of its launchers ends."""


class SbatchSpec(Protocol):
    """What this module reads of :class:`ddpkit.launchers.sbatch.SbatchSpec` (which imports this module)."""

    @property
    def nodes(self) -> int: ...
    @property
    def min_nodes(self) -> int: ...
    @property
    def tasks_per_node(self) -> int: ...
    @property
    def cpus_per_task(self) -> int: ...
    @property
    def launch_mode(self) -> str: ...
    @property
    def command(self) -> tuple[str, ...]: ...
    @property
    def train_args(self) -> tuple[str, ...]: ...
    @property
    def python(self) -> str: ...
    @property
    def max_restarts(self) -> int: ...
    @property
    def stage_data_from(self) -> str: ...
    @property
    def stage_data_key(self) -> str: ...


_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")
_NODE_RANGE = re.compile(r"\s*(\d+)\s*[-:]\s*(\d+)\s*")


def split_node_range(words: list[str]) -> list[str]:
    """``ddpkit slurm``'s words with ``nodes=MIN-MAX`` (or ``MIN:MAX``) as ``min_nodes=MIN nodes=MAX``.

    Every other word is left as it is; ``nodes=N`` stays a fixed job.
    """
    out = []
    for word in words:
        key, _, value = word.partition("=")
        match = _NODE_RANGE.fullmatch(value) if key == "nodes" else None
        out += [f"min_nodes={match.group(1)}", f"nodes={match.group(2)}"] if match else [word]
    return out


def validate_elastic(spec: SbatchSpec) -> None:
    """Raise UserError naming what an elastic spec (``min_nodes`` set) cannot have, and the fix."""
    if not isinstance(spec.min_nodes, int) or spec.min_nodes < 0:
        raise UserError(f"min_nodes={spec.min_nodes!r} must be an integer >= 0 (0: a fixed number of nodes)")
    if not spec.min_nodes:
        return
    if spec.min_nodes > spec.nodes:
        raise UserError(
            f"nodes={spec.min_nodes}-{spec.nodes} has more nodes at least than at most; write nodes=MIN-MAX, "
            f"e.g. nodes={spec.nodes}-{spec.min_nodes}"
        )
    if spec.launch_mode == "mpirun":
        raise UserError(
            "launch=mpirun cannot run an elastic job (nodes=MIN-MAX): MPI fixes the ranks at start; use "
            "launch=srun (ddpkit's launcher on each node) or launch=torchrun"
        )
    if spec.launch_mode == "srun" and spec.command and not _PYTHON.fullmatch(os.path.basename(spec.command[0])):
        raise UserError(
            f"command={' '.join(spec.command)!r} is not a Python program: an elastic job's launcher (ddpkit run) "
            "starts python SCRIPT.py or python -m MODULE; use launch=torchrun for another program"
        )


def elastic_directives(spec: SbatchSpec) -> list[str]:
    """The #SBATCH options of an elastic job: the node range and --no-kill."""
    return [f"--nodes={spec.min_nodes}-{spec.nodes}", "--no-kill"]


def elastic_launcher(spec: SbatchSpec, container: str, ignore_signal: str) -> list[str]:
    """The srun command of an elastic job, as lines to be joined by backslash-newlines.

    Args:
        spec: the job, with ``min_nodes`` set.
        container: the ``apptainer exec ...`` prefix of every process, or "".
        ignore_signal: the wrapper making torchrun ignore the preemption signal, or "".
    """
    cpus = spec.tasks_per_node * spec.cpus_per_task  # one task per node holds the CPUs of all its workers
    nnodes = f"{spec.min_nodes}:{spec.nodes}"
    lines = [
        'srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 '
        f"--cpus-per-task={cpus}",
        f"    {KEEP_STEP_ALIVE}",
    ]
    staged = f' "{spec.stage_data_key}=$STAGED_DATA"' if spec.stage_data_from and spec.stage_data_key else ""
    if spec.launch_mode == "torchrun":
        restarts = spec.max_restarts or ELASTIC_MAX_RESTARTS
        words = ("--no-python", *spec.command) if spec.command else ("-m", "ddpkit", "train")
        return [
            *lines,
            f"    {container}{ignore_signal}torchrun --nnodes={nnodes} --nproc-per-node={spec.tasks_per_node} "
            f"--max-restarts={restarts}",
            '    --rdzv-backend=c10d --rdzv-endpoint="$MASTER_ADDR:$MASTER_PORT" --rdzv-id="$SLURM_JOB_ID"',
            f"    {_words(words, spec.train_args)}{staged}",
        ]
    # ddpkit's own launcher: train, or run for the user's Python program (its interpreter word dropped).
    command = ("run", *spec.command[1:]) if spec.command else ("train",)
    launch = f"nnodes={nnodes} nproc={spec.tasks_per_node}"
    if spec.max_restarts:
        launch += f" max_restarts={spec.max_restarts}"
    endpoint = 'master_addr="$MASTER_ADDR" master_port="$MASTER_PORT"'
    # ddpkit's options come before the program: after it, ddpkit run passes every word to the program.
    program = f"{_words(command[1:], spec.train_args)}{staged}".strip()
    return [
        *lines,
        f"    {container}{shlex.quote(spec.python)} -m ddpkit {command[0]} {launch} {endpoint}",
        *([f"    {program}"] if program else []),
    ]


def _words(*groups: tuple[str, ...]) -> str:
    return " ".join(shlex.quote(word) for group in groups for word in group)
