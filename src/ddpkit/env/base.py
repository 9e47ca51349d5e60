"""The resolved identity of one worker process, whatever started it: a :class:`JobEnvironment`.

Names, for readers who know Lightning: there, ``ClusterEnvironment`` is the
interface of the *sources* (``SLURMEnvironment`` reads Slurm's variables on
every call). Here the value and its sources are distinct kinds, and named so:
a ``JobEnvironment`` is one frozen set of resolved values, and each launcher's
source is a class named after what it reads (``SlurmVariables``,
``TorchrunVariables``, ...; see ``ddpkit.env.detect``), whose ``from_env``
returns a JobEnvironment. The names before (``ClusterEnvironment``,
``SlurmEnvironment``, ...) still work for one release, with a
DeprecationWarning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.errors import UserError


@dataclass(frozen=True)
class JobEnvironment:
    """Who this process is in the job, resolved from one launcher's variables.

    Every field is a resolved value: sources fill them all, nothing is left
    for later code to guess.
    """

    source: str
    """Name of the source that produced it: torchrun, slurm, openmpi, mpich, local."""
    rank: int
    """Global rank of this process, 0 <= rank < world_size."""
    local_rank: int
    """Rank of this process among the processes of its node."""
    world_size: int
    """Number of processes in the job."""
    local_world_size: int
    """Number of processes on this process's node."""
    node_rank: int
    """Index of this process's node, 0 <= node_rank < num_nodes."""
    num_nodes: int
    """Number of nodes in the job."""
    master_addr: str
    """Host name or address of rank 0, where the rendezvous store listens."""
    master_port: int
    """TCP port of the rendezvous store on master_addr."""

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size, self
        assert 0 <= self.local_rank < self.local_world_size, self
        assert 0 <= self.node_rank < self.num_nodes, self

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0

    @property
    def is_single_node(self) -> bool:
        """True when every process of the job runs on one host."""
        return self.num_nodes == 1


class InconsistentEnvironment(UserError):
    """The environment variables of a launcher are missing or contradict each other."""


_RENAMED = {"ClusterEnvironment": "JobEnvironment"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
