"""ShmCommunicator: one shared-memory segment per process group, and its all_reduce."""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import socket
import threading
import time
import weakref
from typing import NoReturn, cast

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from ddpkit.comm.shm import _lib
from ddpkit.env import shared_memory

SLOT_BYTES = 1 << 20
"""Bytes each rank owns per buffer parity (the segment holds 2 per rank): the
chunk size of the reduce-scatter + all-gather path. From 256 KiB to 1 MiB
measured alike; smaller chunks add barriers, larger ones fall out of L2."""

SEGMENT_MAX_BYTES = 32 << 20
"""Cap on the segment's size: slots shrink (to 256 KiB at least) beyond 16
ranks so a small /dev/shm (docker's 64 MB default) still holds it."""

ONE_SHOT_MAX_BYTES = 256 << 10
"""Largest message reduced one-shot (every rank reduces all of it, one barrier);
larger ones take reduce-scatter + all-gather (one barrier per chunk, each rank
reduces 1/world_size of the data). One-shot moves more bytes but waits once:
equal when ranks have their cores, better when they share them."""

SPIN_SECONDS = 50e-6
"""Longest a waiting rank spins before it sleeps until its peer arrives; the
library shortens it while waits keep ending asleep (cores shared with other
processes) and restores it while they end spinning. Waking a sleeper costs
tens of microseconds; spinning costs a core others might need."""

_DTYPE_CODES = {
    torch.float32: 0,
    torch.float64: 1,
    torch.float16: 2,
    torch.bfloat16: 3,
    torch.uint8: 4,
    torch.bool: 4,  # as uint8 0/1, with the ops mapped in _BOOL_OPS
    torch.int8: 5,
    torch.int16: 6,
    torch.int32: 7,
    torch.int64: 8,
}
_OP_CODES = {ReduceOp.SUM: 0, ReduceOp.PRODUCT: 1, ReduceOp.MIN: 2, ReduceOp.MAX: 3, ReduceOp.AVG: 4}
_OP_NAMES = {code: str(op).rsplit(".", 1)[-1] for op, code in _OP_CODES.items()}
_DTYPE_NAMES = {code: str(dtype) for dtype, code in _DTYPE_CODES.items() if dtype is not torch.bool}
# On bool, SUM is logical or and PRODUCT logical and, as in torch's reductions.
_BOOL_OPS = {0: 3, 1: 2, 2: 2, 3: 3}

SUPPORTED_DTYPES = tuple(_DTYPE_CODES)
"""Tensor dtypes :meth:`ShmCommunicator.all_reduce` accepts."""

_LINE = 128  # bytes of the header and of each rank's control line, as LINE in the C source
_PAGE = 4096  # the data starts at a page boundary, as PAGE in the C source

_SEGMENT_PREFIX = "ddpkit-shm"
_ABANDONED_AFTER_S = 60.0


class ShmCommunicator:
    """All-reduce among the ranks of one process group, all on one node, through shared memory.

    Creating it is a collective: every rank of ``group`` must create it,
    in the same order relative to the group's other collectives. Use
    :func:`get_communicator` to get the one cached per group.

    Args:
        group: the process group (None: the default group). Its backend must
            handle CPU tensors (gloo); it carries the setup handshake only.
        timeout: seconds a rank waits for its peers at any step of a collective
            before it raises; None takes the group's own timeout (30 min by
            default in torch). A peer whose process dies is noticed within
            about 10 ms whatever the timeout.

    Raises:
        ValueError: this process is not in ``group``, or the ranks of ``group``
            are not all on one node.
        RuntimeError: the library is unavailable (see :func:`is_available`), or
            the shared-memory segment could not be created or mapped.
    """

    def __init__(self, group: dist.ProcessGroup | None = None, timeout: float | None = None) -> None:
        group = group if group is not None else dist.group.WORLD
        if group is None:
            raise ValueError("shm all_reduce needs an initialized process group; call dist.init_process_group first")
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the group; create the communicator on member ranks only")
        self.timeout = float(timeout) if timeout is not None else _group_timeout(group)
        if not self.timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
        self._lock = threading.Lock()
        self._failure: str | None = None
        self._handle = ctypes.c_void_p()
        self._lib: ctypes.CDLL | None = None
        self._name = ""
        if self.world_size > 1:
            self._connect(group)

    def _connect(self, group: dist.ProcessGroup) -> None:
        loaded = _lib.load()
        lib = self._lib = loaded.lib
        name, problem = None, None
        if lib is None:
            # Still take part in the handshake, so every rank fails alike instead of the others hanging.
            problem = f"its library is unavailable ({loaded.reason}); check is_available() first"
        elif self.rank == 0:
            _remove_abandoned_segments(lib)
            # A random name per job: two jobs on one node never meet.
            name = f"/{_SEGMENT_PREFIX}-{os.getuid()}-{secrets.token_hex(8)}"
            problem = self._open(name)
        try:
            gathered: list[object] = [None] * self.world_size
            dist.all_gather_object(gathered, (_node_id(), name, problem), group=group)
            first = cast("list[tuple[tuple[str, str], str | None, str | None]]", gathered)
            nodes = [node for node, _, _ in first]
            if len(set(nodes)) > 1:
                by_node = {node: [r for r, n in enumerate(nodes) if n == node] for node in dict.fromkeys(nodes)}
                where = ", ".join(f"ranks {ranks} on {node[0]}" for node, ranks in by_node.items())
                raise ValueError(
                    f"shm all_reduce needs every rank of the group on one node, but the group has {where}; "
                    "use the process group's own all_reduce across nodes"
                )
            for rank, (_, _, why) in enumerate(first):
                if why:
                    raise RuntimeError(f"shm all_reduce: rank {rank} could not set up the shared-memory segment: {why}")
            name = first[0][1]
            assert name is not None, "rank 0 named the segment, or said why not"
            if self.rank != 0:
                problem = self._open(name)
            problems: list[str | None] = [None] * self.world_size
            dist.all_gather_object(problems, problem, group=group)
            failed = [(r, p) for r, p in enumerate(problems) if p]
            if failed:
                rank, why = failed[0]
                raise RuntimeError(
                    f"shm all_reduce: rank {rank} could not map the shared-memory segment {name}: {why}; "
                    "the ranks must share /dev/shm (same node, same container)"
                )
        except BaseException:
            self.close()
            if self.rank == 0 and name and lib is not None:
                lib.ddpkit_shm_unlink(name.encode())  # gone already if every rank mapped it
            raise
        assert lib is not None, "a rank without the library failed the handshake"
        self._name = name  # unlinked already; kept for error messages and tests
        self._info = (ctypes.c_int64 * 8)()
        self._all_reduce_fn = lib.ddpkit_shm_all_reduce
        self._resume_fn = lib.ddpkit_shm_resume

    def _open(self, name: str) -> str | None:
        assert self._lib is not None, "loaded by _connect"
        slot = slot_bytes(self.world_size)
        rc = self._lib.ddpkit_shm_open(
            name.encode(),
            self.rank,
            self.world_size,
            slot,
            min(ONE_SHOT_MAX_BYTES, slot),
            self.timeout,
            SPIN_SECONDS,
            ctypes.byref(self._handle),
        )
        if rc == _lib.RC_OK:
            return None
        if rc == _lib.RC_BAD_SEGMENT:
            return "its size or layout differs from what this rank expects (different ddpkit versions?)"
        if rc == _lib.RC_RANK_TAKEN:
            return f"another live process already holds rank {self.rank}"
        if rc == _lib.RC_BAD_ARG:
            return "invalid parameters"
        if -rc == errno.ENOSPC:
            space = shared_memory.measure()
            assert space is not None  # shm_open has just worked there
            return shared_memory.too_small(
                f"its segment for {self.world_size} ranks", segment_bytes(self.world_size), space
            )
        return os.strerror(-rc)

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM) -> None:
        """Reduce ``tensor`` across the group, in place, like ``dist.all_reduce``.

        Every rank ends with bit-identical values. Float16 and bfloat16 are
        accumulated in float32 and rounded once. AVG on integers truncates
        toward zero; SUM and PRODUCT on integers wrap around.

        Args:
            tensor: a CPU tensor of a dtype in :data:`SUPPORTED_DTYPES`, any size
                and any strides (a non-contiguous one goes through a copy).
            op: SUM, PRODUCT, MIN, MAX or AVG (not AVG for bool).

        Raises:
            ValueError: unsupported device, layout, dtype or op.
            RuntimeError: a peer did not arrive within the timeout, died, gave
                up, or called all_reduce with a different size, dtype or op; the
                communicator is then unusable.
        """
        dtype_code = _DTYPE_CODES.get(tensor.dtype)
        op_code = _OP_CODES.get(op)
        if dtype_code is None or op_code is None or not tensor.is_cpu or tensor.layout is not torch.strided:
            _reject(tensor, op)
        if tensor.dtype is torch.bool:
            op_code = _BOOL_OPS.get(op_code)
            if op_code is None:
                raise ValueError("AVG is not defined on bool tensors; use SUM (logical or) or MIN (logical and)")
        if self.world_size == 1:
            return
        if not tensor.is_contiguous():
            work = tensor.contiguous()
            self._all_reduce(work, dtype_code, op_code)
            tensor.copy_(work)
            return
        self._all_reduce(tensor, dtype_code, op_code)

    def _all_reduce(self, tensor: torch.Tensor, dtype_code: int, op_code: int) -> None:
        numel = tensor.numel()
        if numel == 0:
            return
        with self._lock:  # one collective at a time, whichever thread calls
            if self._failure is not None:
                raise RuntimeError(
                    f"shm all_reduce: this communicator failed earlier ({self._failure}); it cannot be reused"
                )
            handle, info = self._handle, self._info
            try:
                rc = self._all_reduce_fn(handle, tensor.data_ptr(), numel, dtype_code, op_code, info)
                while rc == _lib.RC_AGAIN:  # every ~50 ms: signal handlers (Ctrl-C) run here
                    rc = self._resume_fn(handle, info)
            except BaseException:
                assert self._lib is not None, "a communicator of several ranks has its library"
                self._lib.ddpkit_shm_abort(handle)
                self._failure = "interrupted during a collective"
                raise
            if rc != _lib.RC_OK:
                self._failure = self._describe(rc, numel, dtype_code, op_code)
                raise RuntimeError(self._failure)

    def _describe(self, rc: int, numel: int, dtype_code: int, op_code: int) -> str:
        peer = self._info[0]
        if rc == _lib.RC_TIMEOUT:
            return (
                f"shm all_reduce: rank {peer} did not arrive within {self.timeout:.1f} s (it may be stuck, or be "
                "calling a different collective); raise the timeout if it legitimately works that long alone"
            )
        if rc == _lib.RC_PEER_DEAD:
            return f"shm all_reduce: rank {peer} exited during the collective; restart the job (all ranks)"
        if rc == _lib.RC_ABORTED:
            return (
                f"shm all_reduce: rank {peer} gave up on the collective (it timed out, saw a rank die or was "
                f"interrupted); see rank {peer}'s error"
            )
        if rc == _lib.RC_MISMATCH:
            their_dtype, their_op = _DTYPE_NAMES.get(self._info[2], "?"), _OP_NAMES.get(self._info[3], "?")
            theirs = f"{self._info[1]} {their_dtype} elements with {their_op}"
            return (
                f"shm all_reduce: rank {self.rank} reduces {numel} {_DTYPE_NAMES[dtype_code]} elements with "
                f"{_OP_NAMES[op_code]} but rank {peer} reduces {theirs}; every rank must call all_reduce with the "
                "same numel, dtype and op, in the same order"
            )
        return f"shm all_reduce: internal error (code {rc})"

    def close(self) -> None:
        """Unmap the segment; the communicator is unusable afterwards. Called on garbage collection too."""
        lib, self._lib = self._lib, None
        if lib is not None and self._handle:
            lib.ddpkit_shm_close(self._handle)
            self._handle = ctypes.c_void_p()
        self._failure = self._failure or "closed"

    def __del__(self) -> None:
        if getattr(self, "_lib", None) is not None:
            self.close()


def slot_bytes(world_size: int) -> int:
    """Bytes of each rank's buffer per parity in the segment of ``world_size`` ranks (see SEGMENT_MAX_BYTES)."""
    return max(256 << 10, min(SLOT_BYTES, SEGMENT_MAX_BYTES // (2 * world_size) // _PAGE * _PAGE))


def segment_bytes(world_size: int) -> int:
    """Bytes of /dev/shm the segment of a group of ``world_size`` ranks on one node takes (0 for one rank).

    The layout of the C library: a header line and a control line per rank,
    rounded up to a page, then two slots per rank.
    """
    if world_size < 2:
        return 0
    control = -(-_LINE * (world_size + 1) // _PAGE) * _PAGE
    return control + 2 * world_size * slot_bytes(world_size)


# Keyed weakly: a destroyed process group takes its communicator (and mapping) with it.
_communicators: weakref.WeakKeyDictionary[dist.ProcessGroup, ShmCommunicator] = weakref.WeakKeyDictionary()
_communicators_lock = threading.Lock()


def get_communicator(group: dist.ProcessGroup | None = None, timeout: float | None = None) -> ShmCommunicator:
    """The communicator of ``group``, created (collectively) on first use.

    Args:
        group: the process group (None: the default group).
        timeout: used only when this call creates it; see :class:`ShmCommunicator`.

    Returns:
        The communicator cached for ``group``.

    Raises:
        ValueError, RuntimeError: see :class:`ShmCommunicator`.
    """
    key = group if group is not None else dist.group.WORLD
    comm = _communicators.get(key) if key is not None else None
    if comm is None:
        with _communicators_lock:
            comm = _communicators.get(key) if key is not None else None
            if comm is None:
                comm = ShmCommunicator(key, timeout)
                assert key is not None, "ShmCommunicator refuses a missing group"
                _communicators[key] = comm
    return comm


def all_reduce(
    tensor: torch.Tensor, op: ReduceOp.RedOpType = ReduceOp.SUM, group: dist.ProcessGroup | None = None
) -> None:
    """Reduce ``tensor`` in place across ``group`` through shared memory.

    The drop-in for ``dist.all_reduce(tensor, op, group)`` (synchronous) when
    every rank of ``group`` runs on this node. The first call on a group sets
    up its segment, a collective of its own (see :func:`get_communicator`).

    Args:
        tensor: a CPU tensor; see :meth:`ShmCommunicator.all_reduce`.
        op: SUM, PRODUCT, MIN, MAX or AVG.
        group: the process group (None: the default group).

    Raises:
        ValueError: ``tensor`` is not on the CPU (checked before the group's
            segment is set up); see also :meth:`ShmCommunicator.all_reduce`.
        RuntimeError: see :meth:`ShmCommunicator.all_reduce` and :class:`ShmCommunicator`.
    """
    if not tensor.is_cpu:
        _reject(tensor, op)
    get_communicator(group).all_reduce(tensor, op)


def _reject(tensor: torch.Tensor, op: object) -> NoReturn:
    if not tensor.is_cpu:
        raise ValueError(
            f"ddpkit.comm.shm.all_reduce takes CPU tensors, got one on {tensor.device}; "
            "use allreduce=builtin (the backend's own, nccl) for CUDA tensors"
        )
    if tensor.layout is not torch.strided:
        raise ValueError(f"shm all_reduce takes dense tensors, got layout {tensor.layout}; use dist.all_reduce for it")
    if tensor.dtype not in _DTYPE_CODES:
        names = ", ".join(str(d) for d in _DTYPE_CODES)
        raise ValueError(f"shm all_reduce does not handle dtype {tensor.dtype}; supported: {names}")
    raise ValueError(f"shm all_reduce does not handle op {op!r}; supported: SUM, PRODUCT, MIN, MAX, AVG")


def _group_timeout(group: dist.ProcessGroup) -> float:
    """The group's collective timeout in seconds (torch exposes it only privately)."""
    try:
        return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()
    except (AttributeError, RuntimeError):
        return dist.default_pg_timeout.total_seconds()


def _node_id() -> tuple[str, str]:
    """Identifies this node: host name and kernel boot id (host names can repeat across machines)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot_id = f.read().strip()
    except OSError:
        boot_id = ""
    return socket.gethostname(), boot_id


def _remove_abandoned_segments(lib: ctypes.CDLL) -> None:
    """Unlink this user's segments left by jobs killed during setup.

    A segment's name exists only between rank 0 creating it and the last rank
    mapping it; a job SIGKILLed in between leaves it. Rank 0 holds a lock on
    the segment for its whole life, so an old segment nobody locks is litter.
    """
    prefix = f"{_SEGMENT_PREFIX}-{os.getuid()}-"
    try:
        entries = [e for e in os.scandir("/dev/shm") if e.name.startswith(prefix)]
    except OSError:
        return
    for entry in entries:
        try:
            old = time.time() - entry.stat().st_mtime > _ABANDONED_AFTER_S
        except OSError:
            continue
        if old and lib.ddpkit_shm_is_abandoned(f"/{entry.name}".encode()) == 1:
            lib.ddpkit_shm_unlink(f"/{entry.name}".encode())
