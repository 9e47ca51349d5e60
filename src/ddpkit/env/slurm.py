"""Tasks started by srun in a Slurm job step.

Variables read (srun sets the SLURM_STEP_* ones to describe the step, which
may use fewer tasks and nodes than the job; they win over the job's):

- SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID: rank, world_size,
  local_rank, node_rank. srun sets SLURM_NTASKS to the step's task count.
- SLURM_STEP_NUM_NODES, else SLURM_NNODES, else SLURM_JOB_NUM_NODES: num_nodes.
- SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE (both in the
  ``2(x3),1`` syntax, one count per node), else SLURM_NTASKS_PER_NODE (one
  count for every node; sbatch's value leaks into steps, hence last): the
  local_world_size is the count of this task's node. On one node, without any
  of them, it is SLURM_NTASKS.
- SLURM_STEP_NODELIST, else SLURM_NODELIST, else SLURM_JOB_NODELIST: the
  master is the first host of the list, where rank 0 runs under srun's
  block and cyclic distributions. MASTER_ADDR, when set, overrides it.
- SLURM_JOB_ID: the master port is ``10000 + SLURM_JOB_ID % 20000``
  (see ports.port_from_job_id), the same in every task and different for
  consecutive jobs. MASTER_PORT, when set, overrides it.
- SLURM_STEP_ID: which processes are tasks (see SlurmVariables.detect).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.env._vars import check_below, checked_environment, first_set, parse_int, parse_port, require
from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.hostlist import first_host
from ddpkit.env.ports import port_from_job_id

_FIX = "start the workers with srun inside the allocation (srun python train.py ...)"

# Slurm numbers its special steps from the top of uint32: 0xfffffffa is the
# interactive step (salloc with use_interactive_step), 0xfffffffb the batch
# script, 0xfffffffc the extern step; ordinary srun steps count up from 0.
_FIRST_SPECIAL_STEP_ID = 0xFFFFFFFA

_TASKS_PER_NODE_ITEM = re.compile(r"([0-9]+)(?:\(x([0-9]+)\))?")


class SlurmVariables:
    """The variables srun sets for each task of a job step."""

    name = "slurm"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True in a task that srun started, False in the shells around it.

        The rule: SLURM_PROCID and SLURM_NTASKS are set, and SLURM_STEP_ID is
        the number of an ordinary step (below 0xfffffffa). The sbatch batch
        script also has SLURM_PROCID=0 and SLURM_NTASKS=N, but no SLURM_STEP_ID,
        so a program it runs directly (or a torchrun or mpirun it calls) is not
        taken for task 0 of N; salloc's shell has neither SLURM_PROCID nor
        SLURM_STEP_ID, and its interactive step has SLURM_STEP_ID=4294967290.
        """
        step_id = environ.get("SLURM_STEP_ID", environ.get("SLURM_STEPID", ""))  # old name, still set
        return (
            "SLURM_PROCID" in environ
            and "SLURM_NTASKS" in environ
            and step_id.isdecimal()
            and int(step_id) < _FIRST_SPECIAL_STEP_ID
        )

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment:
        """Resolve this task's place in the job step from Slurm's variables.

        Args:
            environ: The process environment, e.g. os.environ.

        Returns:
            The resolved environment, source "slurm".

        Raises:
            InconsistentEnvironment: a variable is missing, malformed, or
                contradicts another.
        """
        rank = parse_int(environ, "SLURM_PROCID", _FIX)
        world_size = parse_int(environ, "SLURM_NTASKS", _FIX, minimum=1)
        local_rank = parse_int(environ, "SLURM_LOCALID", _FIX)
        node_rank = parse_int(environ, "SLURM_NODEID", _FIX)
        nodes_var = first_set(environ, "SLURM_STEP_NUM_NODES", "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
        nodes_var = nodes_var or "SLURM_NNODES"
        num_nodes = parse_int(environ, nodes_var, _FIX, minimum=1)
        check_below("SLURM_NODEID", node_rank, nodes_var, num_nodes, _FIX)

        tasks_var = first_set(environ, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
        if tasks_var is None:
            if num_nodes > 1:
                raise InconsistentEnvironment(
                    f"SLURM_NTASKS={world_size} on {num_nodes} nodes but SLURM_TASKS_PER_NODE "
                    "and SLURM_NTASKS_PER_NODE are unset; pass --ntasks-per-node to sbatch or srun"
                )
            tasks_per_node = [world_size]
        elif tasks_var == "SLURM_NTASKS_PER_NODE":
            tasks_per_node = [parse_int(environ, tasks_var, _FIX, minimum=1)] * num_nodes
        else:
            tasks_per_node = parse_tasks_per_node(environ[tasks_var], tasks_var)
        if len(tasks_per_node) != num_nodes or sum(tasks_per_node) != world_size:
            assert tasks_var is not None, "without it, one node's tasks are all the tasks"
            raise InconsistentEnvironment(
                f"{tasks_var}={environ.get(tasks_var)!r} does not spread SLURM_NTASKS={world_size} "
                f"over {nodes_var}={num_nodes} nodes; {_FIX}"
            )

        return checked_environment(
            SlurmVariables.name,
            _FIX,
            rank=("SLURM_PROCID", rank),
            world_size=("SLURM_NTASKS", world_size),
            local_rank=("SLURM_LOCALID", local_rank),
            local_world_size=(tasks_var or "SLURM_NTASKS", tasks_per_node[node_rank]),
            node_rank=("SLURM_NODEID", node_rank),
            num_nodes=(nodes_var, num_nodes),
            master_addr=environ.get("MASTER_ADDR") or _first_host(environ),
            master_port=parse_port(environ) or port_from_job_id(str(parse_int(environ, "SLURM_JOB_ID", _FIX))),
        )


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> list[int]:
    """Expand Slurm's tasks-per-node syntax into one count per node.

    Args:
        value: Counts such as "2(x3),1": 2 tasks on each of 3 nodes, then 1.
        name: Variable the value came from, for the error message.

    Returns:
        One task count per node, e.g. [2, 2, 2, 1].

    Raises:
        InconsistentEnvironment: value is not in that syntax.
    """
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_PER_NODE_ITEM.fullmatch(item)
        if match is None:
            raise InconsistentEnvironment(f"{name}={value!r} is not a tasks-per-node list such as '2(x3),1'; {_FIX}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _first_host(environ: Mapping[str, str]) -> str:
    """First host of the step's node list: where rank 0 runs."""
    name = first_set(environ, "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_NODELIST")
    value = require(environ, name or "SLURM_JOB_NODELIST", f"{_FIX}, or set MASTER_ADDR")
    try:
        host = first_host(value)  # a legal node list can name billions of hosts: never expand it
    except ValueError as e:
        raise InconsistentEnvironment(f"{name}: {e}; {_FIX}, or set MASTER_ADDR") from e
    if host is None:
        raise InconsistentEnvironment(f"{name} is empty; {_FIX}, or set MASTER_ADDR")
    return host


_RENAMED = {"SlurmEnvironment": "SlurmVariables"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
