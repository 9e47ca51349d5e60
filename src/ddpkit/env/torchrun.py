"""Processes started by torchrun (torch.distributed.run), or by anything following torch's env:// contract.

Variables read:

- RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT:
  required (torchrun sets them all).
- GROUP_RANK, GROUP_WORLD_SIZE: node rank and number of nodes (torchrun's
  "agent groups", one per node). Without them every node is assumed to run
  LOCAL_WORLD_SIZE processes holding consecutive ranks, so node_rank is
  RANK // LOCAL_WORLD_SIZE and num_nodes is WORLD_SIZE // LOCAL_WORLD_SIZE.

ROLE_WORLD_SIZE is not a node count: torchrun sets it to the number of
workers sharing a role, which is WORLD_SIZE for the usual single-role job.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.env._vars import checked_environment, parse_int, parse_port, require
from ddpkit.env.base import InconsistentEnvironment, JobEnvironment

_FIX = (
    "start the job with torchrun, or set RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT together (torch's env:// contract)"
)


class TorchrunVariables:
    """The env:// variables that torchrun sets for each worker."""

    name = "torchrun"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True when RANK or WORLD_SIZE is set.

        Either one is enough, so that a half-set env:// contract fails loudly
        in from_env instead of silently becoming a one-process job.
        """
        return "RANK" in environ or "WORLD_SIZE" in environ

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment:
        """Resolve this process's place in the job from torchrun's variables.

        Args:
            environ: The process environment, e.g. os.environ.

        Returns:
            The resolved environment, source "torchrun".

        Raises:
            InconsistentEnvironment: a variable is missing, not an integer, or
                contradicts another.
        """
        rank = parse_int(environ, "RANK", _FIX)
        world_size = parse_int(environ, "WORLD_SIZE", _FIX, minimum=1)
        local_rank = parse_int(environ, "LOCAL_RANK", _FIX)
        local_world_size = parse_int(environ, "LOCAL_WORLD_SIZE", _FIX, minimum=1)
        master_addr = require(environ, "MASTER_ADDR", _FIX)
        master_port = parse_port(environ, "MASTER_PORT")
        if master_port is None:
            raise InconsistentEnvironment(f"MASTER_PORT is unset; {_FIX}")

        if "GROUP_WORLD_SIZE" in environ:
            num_nodes = ("GROUP_WORLD_SIZE", parse_int(environ, "GROUP_WORLD_SIZE", _FIX, minimum=1))
        elif world_size % local_world_size == 0:
            num_nodes = ("WORLD_SIZE // LOCAL_WORLD_SIZE", world_size // local_world_size)
        else:
            raise InconsistentEnvironment(
                f"LOCAL_WORLD_SIZE={local_world_size} does not divide WORLD_SIZE={world_size} "
                "and GROUP_WORLD_SIZE is unset; set GROUP_RANK and GROUP_WORLD_SIZE to the node "
                "rank and number of nodes (torchrun sets them)"
            )
        if "GROUP_RANK" in environ:
            node_rank = ("GROUP_RANK", parse_int(environ, "GROUP_RANK", _FIX))
        else:
            node_rank = ("RANK // LOCAL_WORLD_SIZE", rank // local_world_size)

        return checked_environment(
            TorchrunVariables.name,
            _FIX,
            rank=("RANK", rank),
            world_size=("WORLD_SIZE", world_size),
            local_rank=("LOCAL_RANK", local_rank),
            local_world_size=("LOCAL_WORLD_SIZE", local_world_size),
            node_rank=node_rank,
            num_nodes=num_nodes,
            master_addr=master_addr,
            master_port=master_port,
        )


_RENAMED = {"TorchrunEnvironment": "TorchrunVariables"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def uses_agent_store(environ: Mapping[str, str]) -> bool:
    """True when torchrun's agent already runs the store at MASTER_ADDR:MASTER_PORT, shared across rounds
    (torch's own test)."""
    return environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
