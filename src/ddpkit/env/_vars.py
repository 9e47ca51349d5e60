"""Reading launcher variables: integers, ports and rank ranges, with errors that name them.

Every source resolves its variables through these helpers so that a missing,
malformed or contradictory value is reported the same way: one line naming the
variable, its value and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ddpkit.env.base import InconsistentEnvironment, JobEnvironment

Named = tuple[str, int]
"""A value with the name of the variable it came from, for error messages."""


def require(environ: Mapping[str, str], name: str, fix: str) -> str:
    """Return environ[name], or raise naming the missing variable and the fix."""
    if name not in environ:
        raise InconsistentEnvironment(f"{name} is unset; {fix}")
    return environ[name]


def first_set(environ: Mapping[str, str], *names: str) -> str | None:
    """Return the first of names that is set in environ, or None."""
    return next((name for name in names if name in environ), None)


def parse_int(environ: Mapping[str, str], name: str, fix: str, minimum: int = 0) -> int:
    """Return environ[name] as an int >= minimum, or raise naming the variable and the fix."""
    value = require(environ, name, fix)
    # Stricter than int(): no spaces, "+" or "_" separators, which no launcher writes.
    if re.fullmatch(r"-?[0-9]+", value) is None:
        raise InconsistentEnvironment(f"{name}={value!r} is not an integer; {fix}")
    number = int(value)
    if number < minimum:
        raise InconsistentEnvironment(f"{name}={value!r} must be at least {minimum}; {fix}")
    return number


def parse_port(environ: Mapping[str, str], name: str = "MASTER_PORT") -> int | None:
    """Return environ[name] as a TCP port, None when unset; raise when it is not one."""
    if name not in environ:
        return None
    fix = f"set {name} to a TCP port in 1..65535"
    port = parse_int(environ, name, fix, minimum=1)
    if port > 65535:
        raise InconsistentEnvironment(f"{name}={port} is not a TCP port; {fix}")
    return port


def check_below(name: str, value: int, bound_name: str, bound: int, fix: str) -> None:
    """Raise unless value < bound (values are parsed >= 0), naming both variables and the fix."""
    if not value < bound:
        raise InconsistentEnvironment(f"{name}={value} is not below {bound_name}={bound}; {fix}")


def checked_environment(
    source: str,
    fix: str,
    *,
    rank: Named,
    world_size: Named,
    local_rank: Named,
    local_world_size: Named,
    node_rank: Named,
    num_nodes: Named,
    master_addr: str,
    master_port: int,
) -> JobEnvironment:
    """Check that the ranks fit their sizes, then build the JobEnvironment.

    Each integer comes as (variable name, value) so that an error names the
    variable it was read from.

    Raises:
        InconsistentEnvironment: a rank is not below its size, or there are
            more processes on the node, or more nodes, than in the job.
    """
    check_below(*rank, *world_size, fix)
    check_below(*local_rank, *local_world_size, fix)
    check_below(*node_rank, *num_nodes, fix)
    for name, value in (local_world_size, num_nodes):
        if value > world_size[1]:
            raise InconsistentEnvironment(f"{name}={value} exceeds {world_size[0]}={world_size[1]}; {fix}")
    return JobEnvironment(
        source=source,
        rank=rank[1],
        local_rank=local_rank[1],
        world_size=world_size[1],
        local_world_size=local_world_size[1],
        node_rank=node_rank[1],
        num_nodes=num_nodes[1],
        master_addr=master_addr,
        master_port=master_port,
    )
