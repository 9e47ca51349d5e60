"""How a process learns who it is in the job: one small module per launcher.

    detect_environment(os.environ) -> JobEnvironment

asks each source of detect.SOURCES in turn (torchrun, OpenMPI, MPICH/Hydra,
Slurm, a multi-host SageMaker job, then the one-process fallback) and resolves the first that detects
itself. network.gloo_interface_environ chooses gloo's network interface, and
ports has the port helpers the launchers share.
"""

from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.detect import detect_environment
from ddpkit.env.network import gloo_interface_environ, interface_for
from ddpkit.env.ports import free_port, port_from_job_id

__all__ = [
    "JobEnvironment",
    "InconsistentEnvironment",
    "detect_environment",
    "free_port",
    "gloo_interface_environ",
    "interface_for",
    "port_from_job_id",
]


_RENAMED = {"ClusterEnvironment": "JobEnvironment"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
