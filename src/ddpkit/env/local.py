"""A single process that no launcher started: `python train.py`.

Variables read: MASTER_ADDR (default 127.0.0.1) and MASTER_PORT (default: a
port that the OS reports free on MASTER_ADDR at the time of the call).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.env._vars import parse_port
from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.ports import free_port


class LocalVariables:
    """The fallback: rank 0 of a job of one process, on this host."""

    name = "local"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """Always True: the last resort when no launcher is detected."""
        return True

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment:
        """Resolve a one-process job on this host.

        Args:
            environ: The process environment, e.g. os.environ.

        Returns:
            The resolved environment, source "local": rank 0 of world_size 1.

        Raises:
            InconsistentEnvironment: MASTER_PORT is set but not a TCP port, or
                MASTER_ADDR is set but not an address of this host.
        """
        master_addr = environ.get("MASTER_ADDR", "127.0.0.1")
        master_port = parse_port(environ)
        if master_port is None:
            try:
                master_port = free_port(master_addr)
            except OSError as e:
                raise InconsistentEnvironment(
                    f"MASTER_ADDR={master_addr!r} is not an address of this host ({e}); "
                    "a one-process job is its own master: unset MASTER_ADDR"
                ) from e
        return JobEnvironment(
            source=LocalVariables.name,
            rank=0,
            local_rank=0,
            world_size=1,
            local_world_size=1,
            node_rank=0,
            num_nodes=1,
            master_addr=master_addr,
            master_port=master_port,
        )


_RENAMED = {"LocalEnvironment": "LocalVariables"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
