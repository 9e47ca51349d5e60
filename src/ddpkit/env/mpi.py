"""Processes started by mpirun / mpiexec: OpenMPI, and MPICH or Intel MPI (Hydra).

Variables read, OpenMPI (as mpirun 4.1 sets them):

- OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE: rank, world_size,
  local_rank, local_world_size.
- OMPI_MCA_orte_num_nodes: num_nodes, when set (OpenMPI 4); it only checks
  that every node runs the same number of processes.
- PMIX_NAMESPACE, else OMPI_MCA_ess_base_jobid: the job id that the master
  port is derived from, the same in every rank of one mpirun.

OMPI_COMM_WORLD_NODE_RANK is not read: despite its name it is a process's
rank among the processes of all jobs on its node, not the index of its node.

MPICH and Intel MPI (Hydra's mpiexec):

- PMI_RANK, PMI_SIZE, MPI_LOCALRANKID, MPI_LOCALNRANKS. Hydra exports no
  job id, so MASTER_PORT must be set.

MPI tells neither node indices nor where rank 0 runs, so:

- node_rank is RANK // LOCAL_SIZE: every node is assumed to run the same
  number of processes holding consecutive ranks, which is what mpirun's
  default placement (fill a node's slots, then the next) and
  ``--map-by ppr:N:node`` / ``-ppn N`` give. A rank whose local rank shows
  another placement raises InconsistentEnvironment.
- master_addr is MASTER_ADDR, else 127.0.0.1 when every rank is on one node;
  a multi-node job without MASTER_ADDR raises InconsistentEnvironment.
- master_port is MASTER_PORT, else ``10000 + crc32(job id) % 20000`` (see
  ports.port_from_job_id).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.env._vars import check_below, checked_environment, first_set, parse_int, parse_port
from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.ports import port_from_job_id


@dataclass(frozen=True)
class _Dialect:
    """How one MPI implementation names things."""

    source: str
    rank: str
    size: str
    local_rank: str
    local_size: str
    num_nodes: str | None
    job_ids: tuple[str, ...]
    launcher: str
    export: str
    """The launcher's option passing a variable to every rank: format with NAME and VALUE."""
    placement: str
    """The launcher's option placing N consecutive ranks on each node."""


_OPENMPI = _Dialect(
    source="openmpi",
    rank="OMPI_COMM_WORLD_RANK",
    size="OMPI_COMM_WORLD_SIZE",
    local_rank="OMPI_COMM_WORLD_LOCAL_RANK",
    local_size="OMPI_COMM_WORLD_LOCAL_SIZE",
    num_nodes="OMPI_MCA_orte_num_nodes",
    job_ids=("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid"),
    launcher="mpirun",
    export="-x {NAME}={VALUE}",
    placement="--map-by ppr:N:node",
)
_MPICH = _Dialect(
    source="mpich",
    rank="PMI_RANK",
    size="PMI_SIZE",
    local_rank="MPI_LOCALRANKID",
    local_size="MPI_LOCALNRANKS",
    num_nodes=None,
    job_ids=(),
    launcher="mpiexec",
    export="-genv {NAME} {VALUE}",
    placement="-ppn N",
)


class OpenMPIVariables:
    """The variables OpenMPI's mpirun sets for each rank."""

    name = _OPENMPI.source

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when OMPI_COMM_WORLD_RANK is set: only mpirun sets it, before MPI_Init."""
        return _OPENMPI.rank in environ

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment:
        """Resolve this rank's place in the job from OpenMPI's variables.

        Args:
            environ: The process environment, e.g. os.environ.

        Returns:
            The resolved environment, source "openmpi".

        Raises:
            InconsistentEnvironment: a variable is missing or malformed, the
                job spans several nodes and MASTER_ADDR is unset, or the ranks
                are not placed in equal consecutive blocks per node.
        """
        return _from_env(environ, _OPENMPI)


class MPICHVariables:
    """The variables Hydra (MPICH's and Intel MPI's mpiexec) sets for each rank."""

    name = _MPICH.source

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when PMI_RANK and MPI_LOCALRANKID are set.

        srun --mpi=pmi2 also sets PMI_RANK, but not MPI_LOCALRANKID: such
        tasks are left to SlurmVariables.
        """
        return _MPICH.rank in environ and _MPICH.local_rank in environ

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment:
        """Resolve this rank's place in the job from Hydra's variables.

        Args:
            environ: The process environment, e.g. os.environ.

        Returns:
            The resolved environment, source "mpich".

        Raises:
            InconsistentEnvironment: as OpenMPIVariables.from_env, and when
                MASTER_PORT is unset.
        """
        return _from_env(environ, _MPICH)


def _from_env(environ: Mapping[str, str], mpi: _Dialect) -> JobEnvironment:
    fix = f"start the job with {mpi.launcher}"
    rank = parse_int(environ, mpi.rank, fix)
    world_size = parse_int(environ, mpi.size, fix, minimum=1)
    local_rank = parse_int(environ, mpi.local_rank, fix)
    local_size = parse_int(environ, mpi.local_size, fix, minimum=1)
    check_below(mpi.rank, rank, mpi.size, world_size, fix)
    check_below(mpi.local_rank, local_rank, mpi.local_size, local_size, fix)

    if mpi.num_nodes is not None and mpi.num_nodes in environ:
        num_nodes = (mpi.num_nodes, parse_int(environ, mpi.num_nodes, fix, minimum=1))
    else:
        num_nodes = (f"{mpi.size} // {mpi.local_size}", world_size // local_size)
    uneven = f"start the same number of processes on every node ({mpi.launcher} {mpi.placement})"
    if num_nodes[1] * local_size != world_size:
        raise InconsistentEnvironment(
            f"{mpi.local_size}={local_size} processes on this node do not divide "
            f"{mpi.size}={world_size} evenly over {num_nodes[0]}={num_nodes[1]} nodes; {uneven}"
        )
    if rank % local_size != local_rank:
        raise InconsistentEnvironment(
            f"{mpi.rank}={rank} has {mpi.local_rank}={local_rank}, so ranks are not placed in "
            f"consecutive blocks of {mpi.local_size}={local_size} per node; place them with "
            f"{mpi.launcher} {mpi.placement}"
        )

    if "MASTER_ADDR" in environ:
        master_addr = environ["MASTER_ADDR"]
    elif local_size == world_size:
        master_addr = "127.0.0.1"
    else:
        raise InconsistentEnvironment(
            f"MASTER_ADDR is unset and {mpi.source} does not tell where rank 0 runs in this "
            f"{num_nodes[1]}-node job; pass it to every rank: {mpi.launcher} "
            + mpi.export.format(NAME="MASTER_ADDR", VALUE="<host of rank 0>")
        )

    master_port = parse_port(environ)
    if master_port is None:
        job_id_var = first_set(environ, *mpi.job_ids)
        if job_id_var is None:
            raise InconsistentEnvironment(
                f"MASTER_PORT is unset and {mpi.source} exports no job id to derive it from; "
                f"pass it to every rank: {mpi.launcher} " + mpi.export.format(NAME="MASTER_PORT", VALUE="29500")
            )
        master_port = port_from_job_id(environ[job_id_var])

    return checked_environment(
        mpi.source,
        fix,
        rank=(mpi.rank, rank),
        world_size=(mpi.size, world_size),
        local_rank=(mpi.local_rank, local_rank),
        local_world_size=(mpi.local_size, local_size),
        node_rank=(f"{mpi.rank} // {mpi.local_size}", rank // local_size),
        num_nodes=num_nodes,
        master_addr=master_addr,
        master_port=master_port,
    )


_RENAMED = {"OpenMPIEnvironment": "OpenMPIVariables", "MPICHEnvironment": "MPICHVariables"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
