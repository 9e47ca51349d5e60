"""Every collective algorithm by name, for training options and benchmarks.

``ALLREDUCE_ALGORITHMS`` maps the names accepted by ``allreduce=<name>`` to
functions with ``torch.distributed.all_reduce``'s in-place signature
``fn(tensor, op=ReduceOp.SUM, group=None)``:

=========  ==========================================================
builtin    ``torch.distributed.all_reduce`` (AVG done as SUM + divide,
           since gloo rejects it for integers)
naive      through rank 0 (:mod:`ddpkit.comm.naive`)
ring       pipelined ring (:mod:`ddpkit.comm.ring`)
butterfly  recursive halving and doubling (:mod:`ddpkit.comm.butterfly`)
tree       binary-tree reduce + broadcast (:mod:`ddpkit.comm.tree`)
shm        shared memory between processes of one host
           (:mod:`ddpkit.comm.shm`, loaded on first use)
hierarchical  shared memory in each node, gloo between nodes
           (:mod:`ddpkit.comm.hierarchical`, needs shm)
=========  ==========================================================

``COLLECTIVES`` extends the same idea to every collective:
``COLLECTIVES[collective][algorithm]``, each entry with the signature of the
``torch.distributed`` function of that name. The ``builtin`` entries are
torch's own; note that torch's ``dst``/``src`` are *global* ranks where
ddpkit's are group ranks; they coincide for the world group.

Always go through :func:`resolve_allreduce` or :func:`resolve`: they check
that the algorithm can run here (``shm`` needs its module and a single host)
and name the alternatives when not.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from ddpkit.comm import butterfly, dissemination, linear, naive, ops, pairwise, ring, tree
from ddpkit.comm.ops import Op, ReduceOp
from ddpkit.errors import UserError

AllReduce = Callable[..., None]
"""``fn(tensor, op=ReduceOp.SUM, group=None)``, reducing ``tensor`` in place."""

_SHM_MODULE = "ddpkit.comm.shm"


def builtin_all_reduce(tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """``torch.distributed.all_reduce`` with ddpkit's operator rules (AVG = SUM then divide).

    Args:
        tensor: input and output.
        op: reduction operator (see :mod:`ddpkit.comm.ops`).
        group: process group, or None for the world group.

    Raises:
        ValueError: ``op`` is not supported for ``tensor``'s dtype.
    """
    op = ops.check(op, tensor.dtype)
    dist.all_reduce(tensor, op=ReduceOp.SUM if op == ReduceOp.AVG else op, group=group)
    ops.finish(tensor, op, dist.get_world_size(group))


def _shm_unavailable_reason() -> str | None:
    """Why the shared-memory all_reduce cannot run here, or None when it can."""
    try:
        module = importlib.import_module(_SHM_MODULE)
    except ModuleNotFoundError as e:
        if e.name != _SHM_MODULE:  # the module exists but one of its imports is missing: a real error
            raise
        return f"{_SHM_MODULE} is not installed"
    if module.is_available():
        return None
    explain = getattr(module, "unavailable_reason", None)
    return explain() if explain is not None else f"{_SHM_MODULE}.is_available() is False"


def hierarchical_all_reduce(
    tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> None:
    """Forward to ``ddpkit.comm.hierarchical.all_reduce`` (imported on first call: it needs shm)."""
    importlib.import_module("ddpkit.comm.hierarchical").all_reduce(tensor, op=op, group=group)


def shm_all_reduce(tensor: torch.Tensor, op: Op = ReduceOp.SUM, group: dist.ProcessGroup | None = None) -> None:
    """Forward to ``ddpkit.comm.shm.all_reduce`` (imported on first call)."""
    importlib.import_module(_SHM_MODULE).all_reduce(tensor, op=op, group=group)


ALLREDUCE_ALGORITHMS: dict[str, AllReduce] = {
    "builtin": builtin_all_reduce,
    "naive": naive.all_reduce,
    "ring": ring.all_reduce,
    "butterfly": butterfly.all_reduce,
    "tree": tree.all_reduce,
    "shm": shm_all_reduce,
    "hierarchical": hierarchical_all_reduce,
}
"""all_reduce algorithms by name; see the module docstring."""

_NEEDS_SHM = ("shm", "hierarchical")

COLLECTIVES: dict[str, Mapping[str, Callable[..., object]]] = {
    "all_reduce": ALLREDUCE_ALGORITHMS,
    "reduce": {"builtin": dist.reduce, "tree": tree.reduce},
    "broadcast": {"builtin": dist.broadcast, "tree": tree.broadcast},
    "all_gather": {"builtin": dist.all_gather, "ring": ring.all_gather},
    # torch 2.13 renamed the tensor forms *_single and deprecated the old names.
    "all_gather_into_tensor": {
        "builtin": getattr(dist, "all_gather_single", dist.all_gather_into_tensor),
        "ring": ring.all_gather_into_tensor,
    },
    "reduce_scatter": {"builtin": dist.reduce_scatter, "ring": ring.reduce_scatter},
    "reduce_scatter_tensor": {
        "builtin": getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor),
        "ring": ring.reduce_scatter_tensor,
    },
    "gather": {"builtin": dist.gather, "linear": linear.gather},
    "scatter": {"builtin": dist.scatter, "linear": linear.scatter},
    "all_to_all": {"builtin": dist.all_to_all, "pairwise": pairwise.all_to_all},
    "all_to_all_single": {"builtin": dist.all_to_all_single, "pairwise": pairwise.all_to_all_single},
    "barrier": {"builtin": dist.barrier, "dissemination": dissemination.barrier},
}
"""Every collective's algorithms by name: ``COLLECTIVES["broadcast"]["tree"]``."""


def available_allreduce_algorithms() -> list[str]:
    """Names in :data:`ALLREDUCE_ALGORITHMS` that can run in this process (``shm`` only where available)."""
    return [name for name in ALLREDUCE_ALGORITHMS if name not in _NEEDS_SHM or _shm_unavailable_reason() is None]


def resolve_allreduce(name: str) -> AllReduce:
    """Return the all_reduce function called ``name``.

    Args:
        name: a key of :data:`ALLREDUCE_ALGORITHMS`.

    Returns:
        ``fn(tensor, op=ReduceOp.SUM, group=None)``.

    Raises:
        ValueError: unknown name, or ``shm`` where shared memory is not available.
    """
    if name not in ALLREDUCE_ALGORITHMS:
        available = ", ".join(available_allreduce_algorithms())
        close = difflib.get_close_matches(name, list(ALLREDUCE_ALGORITHMS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"allreduce={name!r} is not an all_reduce algorithm{hint}; choose one of: {available}")
    if name in _NEEDS_SHM:
        reason = _shm_unavailable_reason()
        if reason is not None:
            available = ", ".join(available_allreduce_algorithms())
            raise UserError(
                f"all_reduce algorithm {name!r} is not available here ({reason}); choose one of {available}"
            )
    return ALLREDUCE_ALGORITHMS[name]


def resolve(collective: str, algorithm: str) -> Callable[..., object]:
    """Return ``COLLECTIVES[collective][algorithm]``, checked.

    Args:
        collective: a ``torch.distributed`` collective name, e.g. ``"all_gather"``.
        algorithm: an algorithm of that collective, e.g. ``"ring"`` or ``"builtin"``.

    Returns:
        The function, with the signature of ``torch.distributed.<collective>``.

    Raises:
        ValueError: unknown collective or algorithm, or an algorithm unavailable here.
    """
    if collective not in COLLECTIVES:
        raise UserError(f"unknown collective {collective!r}; choose one of {', '.join(COLLECTIVES)}")
    if collective == "all_reduce":
        return resolve_allreduce(algorithm)
    algorithms = COLLECTIVES[collective]
    if algorithm not in algorithms:
        raise UserError(f"unknown {collective} algorithm {algorithm!r}; choose one of {', '.join(algorithms)}")
    return algorithms[algorithm]
