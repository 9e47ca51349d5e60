"""Choosing the environment source of this process: the first in SOURCES that detects itself.

A source is a class named after what it reads (``SlurmVariables``: the
variables srun sets) with ``detect(environ)`` and ``from_env(environ)``; the
value it resolves is a :class:`~ddpkit.env.base.JobEnvironment`.

Launchers nest and a process inherits the variables of every launcher above
it, so the launcher that started the process directly must be asked first:

- torchrun runs inside Slurm steps, sbatch scripts and mpirun, and its
  workers inherit SLURM_* or OMPI_* variables that describe torchrun itself;
- mpirun / mpiexec run inside Slurm allocations and batch scripts, whose
  SLURM_* variables they pass on to their ranks;
- Slurm tasks (see SlurmVariables.detect for what counts as one);
- a SageMaker training job of several hosts, one process per host. The
  container is the outermost layer: under the estimator's torch_distributed
  or mpi distribution the toolkit's torchrun or mpirun started the process
  and is asked first (mpirun also hands every rank the master's
  SM_CURRENT_HOST, so SageMaker's variables cannot tell a rank's host there).
  Inside such a job, MASTER_ADDR defaults to the first host for every source
  (sagemaker.with_master_addr): where the toolkit's mpirun puts rank 0;
- local, which always matches: a single process.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from ddpkit.env.base import JobEnvironment
from ddpkit.env.local import LocalVariables
from ddpkit.env.mpi import MPICHVariables, OpenMPIVariables
from ddpkit.env.sagemaker import SageMakerVariables, with_master_addr
from ddpkit.env.slurm import SlurmVariables
from ddpkit.env.torchrun import TorchrunVariables


class EnvironmentSource(Protocol):
    """One launcher's variables: recognize them, then resolve them."""

    name: str

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool: ...

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment: ...


# Innermost launcher first, as explained in the module docstring.
SOURCES: tuple[type[EnvironmentSource], ...] = (
    TorchrunVariables,
    OpenMPIVariables,
    MPICHVariables,
    SlurmVariables,
    SageMakerVariables,
    LocalVariables,
)


def detect_environment(environ: Mapping[str, str]) -> JobEnvironment:
    """Resolve who this process is from the variables of the launcher that started it.

    Args:
        environ: The process environment, e.g. os.environ; read, never written.

    Returns:
        The resolved environment of the first source in SOURCES that detects
        itself (LocalVariables always does).

    Raises:
        InconsistentEnvironment: the detected source's variables are missing,
            malformed or contradict each other; the message names the
            variable and the fix.
    """
    environ = with_master_addr(environ)
    source = next(source for source in SOURCES if source.detect(environ))
    return source.from_env(environ)
