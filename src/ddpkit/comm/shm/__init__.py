"""Shared-memory all_reduce for CPU tensors among the ranks of one node.

gloo moves bytes over TCP loopback even inside one host; here the ranks of a
process group that all run on one node reduce through one shared-memory
segment instead, synchronized by counters in that segment::

    from ddpkit.comm import shm

    if shm.is_available():
        shm.all_reduce(tensor, op=dist.ReduceOp.SUM, group=None)  # in place
    else:
        shm.warn_unavailable_once()
        dist.all_reduce(tensor)

The segment
    Rank 0 creates it (``/dev/shm/ddpkit-shm-<uid>-<random token>``, mode
    0600: two jobs never meet, other users cannot read it) and sends its name
    to the others through the group (``all_gather_object``, which also checks
    that every rank is on this node). The last rank to map it unlinks the
    name, so from then on nothing is left in /dev/shm whatever happens to the
    processes, SIGKILL included. It holds a 128-byte control line per rank
    (a barrier counter, the call's size/dtype/op) and two buffers ("slots")
    of 1 MiB per rank, used by alternate phases so a rank never waits for a
    slower one to finish reading the previous phase's buffer.

Synchronization
    Rank r arrives at a barrier by storing its count of barriers into its own
    control line and waits until every peer's count has reached it: no
    locks, no system calls while the peers keep up. A waiting rank spins with
    ``pause`` for up to 50 us, then sleeps on the late peer's counter (a
    futex the peer wakes when it arrives), which frees the core for whoever
    needs it: on a shared machine the late peer may be waiting for exactly
    that core. The spin shortens while waits keep ending asleep and grows
    back while they end spinning.
    A rank raises if a peer does not arrive within the timeout, and within
    ~10 ms if a peer's process dies (each rank holds a file lock on its byte
    of the segment; the kernel drops it when the process dies). A rank that
    gives up marks the segment so its peers fail at once instead of waiting.
    Waits return to Python every 50 ms, so Ctrl-C works.

Small messages (<= 256 KiB): one-shot, one barrier::

    rank 0: x0 -> slot0 --.                 .-> x0 = x0 + slot1    (rank order)
                           |-- barrier ----|
    rank 1: x1 -> slot1 --'                 '-> x1 = slot0 + x1

    Per rank: write S, read n*S, write S (S = message bytes, n = world_size).

Large messages: reduce-scatter + all-gather, chunk by chunk (a chunk fills
a slot), sub-chunk r of each chunk reduced by rank r. Rank r copies to its
slot only the sub-chunks its peers reduce, reduces sub-chunk r from its own
tensor and the peers' slots straight into its tensor and its slot, then
copies the peers' reduced sub-chunks back::

    rank 0: x0[1] -> slot0[1]  |  x0[0] = x0[0] + slot1[0] -> slot0[0]  |  x0[1] = slot1[1]
    rank 1: x1[0] -> slot1[0]  |  x1[1] = slot0[1] + x1[1] -> slot1[1]  |  x1[0] = slot0[0]
                            barrier                                 barrier

    The barrier after reducing chunk k also covers copying in chunk k + 1
    (into the other parity's slots): num_chunks + 1 barriers in all.
    Per rank: read ~2S, write ~2S whatever n (each tensor byte once from
    and once to memory; the slots stay in cache); each rank reduces S/n.

Results
    Sources are combined in rank order, each element by one code path (the
    reduction loops are vectorized, elementwise, without FMA contraction), so
    every rank ends with bit-identical values. float16/bfloat16 accumulate in
    float32 and round once. Ops: SUM, PRODUCT, MIN, MAX (NaN propagates), AVG
    (integers: truncated; SUM/PRODUCT wrap). Dtypes: float32/64, float16,
    bfloat16, uint8, int8/16/32/64, bool (SUM = or, PRODUCT = and). Any size
    including 0; non-contiguous tensors go through a copy. World size 1 is a
    no-op.

The work is done by a C library (``shm_all_reduce.c``, plain C11, no Python
headers) built at install time and loaded with ctypes; see ``_lib.py``.
"""

from __future__ import annotations

import warnings

from ddpkit.comm.shm import _lib
from ddpkit.comm.shm.communicator import (
    SUPPORTED_DTYPES,
    ShmCommunicator,
    all_reduce,
    get_communicator,
    segment_bytes,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "ShmCommunicator",
    "all_reduce",
    "get_communicator",
    "is_available",
    "segment_bytes",
    "unavailable_reason",
    "warn_unavailable_once",
]

_warned = False


def is_available() -> bool:
    """Whether the compiled library loads here (loading it on the first call).

    Returns:
        True if :func:`all_reduce` can run on this machine.
    """
    return _lib.load().lib is not None


def unavailable_reason() -> str:
    """Why :func:`is_available` is False.

    Returns:
        The reason, or an empty string when the library is available.
    """
    return _lib.load().reason


def warn_unavailable_once() -> None:
    """Warn, once per process, that all_reduce falls back to gloo and why.

    Callers that fall back to ``dist.all_reduce`` when :func:`is_available` is
    False call this on every fallback; only the first call speaks.
    """
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(
        "ddpkit: the shared-memory all_reduce is unavailable "
        f"({unavailable_reason() or 'not requested'}); falling back to gloo's all_reduce over TCP loopback, "
        "which is several times slower on one node. Fix: install a C compiler (gcc) and reinstall ddpkit "
        "(pip install -e . or pip install .)",
        RuntimeWarning,
        stacklevel=2,
    )
