"""How a process learns who it is in the job: one small module per launcher.

    detect_environment(os.environ) -> ClusterEnvironment

asks each source of detect.SOURCES in turn (torchrun, OpenMPI, MPICH/Hydra,
Slurm, a multi-host SageMaker job, then the one-process fallback) and resolves the first that detects
itself. network.gloo_interface_environ chooses gloo's network interface, and
ports has the port helpers the launchers share.
"""

from ddpkit.env.base import ClusterEnvironment, InconsistentEnvironment
from ddpkit.env.detect import detect_environment
from ddpkit.env.network import gloo_interface_environ, interface_for
from ddpkit.env.ports import free_port, port_from_job_id

__all__ = [
    "ClusterEnvironment",
    "InconsistentEnvironment",
    "detect_environment",
    "free_port",
    "gloo_interface_environ",
    "interface_for",
    "port_from_job_id",
]
