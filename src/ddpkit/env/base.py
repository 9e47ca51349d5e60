"""The resolved identity of one worker process, whatever started it."""

from __future__ import annotations

from dataclasses import dataclass

from ddpkit.errors import UserError


@dataclass(frozen=True)
class ClusterEnvironment:
    """Who this process is in the job, resolved from one environment source.

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
