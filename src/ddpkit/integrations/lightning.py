"""A Lightning ``ClusterEnvironment`` backed by ddpkit's environment detection: ``DdpkitEnvironment``.

A Lightning script started by ``ddpkit run``, srun or mpirun learns its rank,
world size, node, master address and port the way ``ddpkit.init`` does
(:func:`ddpkit.env.detect_environment`, the innermost launcher first), and
gloo gets the network interface that routes to the master
(:func:`ddpkit.env.gloo_interface_environ`)::

    from ddpkit.integrations.lightning import DdpkitEnvironment

    env = DdpkitEnvironment()
    trainer = L.Trainer(accelerator="cpu", strategy="ddp", devices=env.devices, num_nodes=env.num_nodes,
                        plugins=[env], use_distributed_sampler=False)   # keep ddpkit's sampler
    fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=env.devices, num_nodes=env.num_nodes,
                      plugins=[env])

The processes are the launcher's (``creates_processes_externally``): Lightning
starts none. ``ddpkit.DataLoader(dataset, global_batch_size=..., rank=env.global_rank(),
world_size=env.world_size())`` hands each rank its share of batches that do not
depend on the world size; ``use_distributed_sampler=False`` (Trainer) or
``fabric.setup_dataloaders(loader, use_distributed_sampler=False)`` keeps
Lightning from replacing its sampler with a DistributedSampler.
"""

from __future__ import annotations

import os

from lightning.fabric.plugins.environments.cluster_environment import ClusterEnvironment

from ddpkit.env import JobEnvironment, detect_environment, gloo_interface_environ
from ddpkit.errors import UserError


class DdpkitEnvironment(ClusterEnvironment):
    """Lightning's view of the job ddpkit detects from the launcher's variables (see ``ddpkit.env.detect``).

    Resolved once, when constructed: every method answers from that one
    :class:`~ddpkit.env.JobEnvironment`. Construct it in each worker process
    (the script's top level is).
    """

    def __init__(self) -> None:
        super().__init__()
        self._job: JobEnvironment = detect_environment(os.environ)
        # gloo binds to the interface that reaches the master, as ddpkit.init chooses it; a setting the user
        # made (GLOO_SOCKET_IFNAME) is kept. Lightning forms the group later, from this process's environment.
        if self._job.world_size > 1:
            os.environ.update(gloo_interface_environ(os.environ, self._job.master_addr))

    @property
    def job(self) -> JobEnvironment:
        """The resolved environment (source, ranks, nodes, master) this plugin reports."""
        return self._job

    @property
    def devices(self) -> int:
        """Processes on this node: the Trainer's or Fabric's ``devices``."""
        return self._job.local_world_size

    @property
    def num_nodes(self) -> int:
        """Nodes of the job: the Trainer's or Fabric's ``num_nodes``."""
        return self._job.num_nodes

    @property
    def creates_processes_externally(self) -> bool:
        """True: the launcher (ddpkit run, srun, mpirun, torchrun) started every process."""
        return True

    @property
    def main_address(self) -> str:
        """Host name or address of rank 0, where the rendezvous store listens."""
        return self._job.master_addr

    @property
    def main_port(self) -> int:
        """TCP port of the rendezvous store."""
        return self._job.master_port

    @staticmethod
    def detect() -> bool:
        """True when a launcher's variables describe a job of several processes."""
        return detect_environment(os.environ).world_size > 1

    def world_size(self) -> int:
        """Number of processes in the job."""
        return self._job.world_size

    def set_world_size(self, size: int) -> None:
        """Ignored: the launcher fixed the world size (Lightning calls this with devices * num_nodes, which
        :meth:`validate_settings` has checked)."""

    def global_rank(self) -> int:
        """Global rank of this process."""
        return self._job.rank

    def set_global_rank(self, rank: int) -> None:
        """Ignored: the launcher fixed the rank (Lightning calls this with the rank it computed)."""

    def local_rank(self) -> int:
        """Rank of this process among those of its node."""
        return self._job.local_rank

    def node_rank(self) -> int:
        """Index of this process's node."""
        return self._job.node_rank

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        """Refuse, in one line, a Trainer or Fabric whose devices or num_nodes contradict the launcher."""
        if (num_devices, num_nodes) != (self._job.local_world_size, self._job.num_nodes):
            raise UserError(
                f"Lightning was given devices={num_devices}, num_nodes={num_nodes} but the launcher "
                f"({self._job.source}) started {self._job.local_world_size} processes per node on "
                f"{self._job.num_nodes} node(s); pass devices=env.devices, num_nodes=env.num_nodes "
                "(env = DdpkitEnvironment())"
            )
