"""The background thread that runs every ``ddpkit.horovod`` collective, in call order, and ``hvd.join``.

Horovod queues each collective for one background thread and returns a
handle at once; ``synchronize(handle)`` waits. Here too: :class:`Engine`
owns one worker thread, and each collective a rank submits runs there, one
after the other, in the order that rank submitted them. Ranks are matched
by that order (Horovod matches by name after a negotiation round; plain
training code calls its collectives in the same order on every rank, which
is what makes order enough).

Every collective starts with a header exchange: one ``all_gather`` of a
small int64 vector per rank saying what the rank is about to do (kind,
dtype, op, root, first dimension, elements per row, shape and name keys,
alltoall splits) and whether it is still active. This buys three things:

- a rank that called ``hvd.join()`` takes part in the others' collectives
  without knowing them in advance: it reads the header of an active rank
  and contributes the neutral element (zeros to a sum, no rows to an
  allgather), which is Horovod's join with uneven inputs;
- allgather learns every rank's first dimension, alltoall every rank's
  splits, with no extra round;
- a rank calling a different collective, shape, dtype or name than its
  peers fails on every rank with one message naming both calls, rather
  than hanging::

      rank 0 (training):  [active=1, ALLREDUCE, float32, SUM, ..., numel=10] --.
                                                                               |-- all_gather --> every rank reads
      rank 1 (joined):    [active=0, 0, 0, ...]                              --'   every header
      then rank 0 all-reduces its tensor; rank 1 all-reduces 10 zeros.

Cost: one header all_gather (world_size x (9 + world_size) int64) per
collective. The data moves over ddpkit's all_reduce (``allreduce=auto``:
shared memory between the processes of one node on CPU, the backend's
built-in otherwise; see :mod:`ddpkit.comm.grad_sync`) and over
torch.distributed's all_gather, broadcast and all_to_all.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TypeVar

import torch
import torch.distributed as dist

from ddpkit.comm.ops import ReduceOp
from ddpkit.comm.registry import COLLECTIVES

T = TypeVar("T")
Rows = list[list[int]]
"""The exchanged headers, one row per rank."""

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, BARRIER = 1, 2, 3, 4, 5
KIND_NAMES = {ALLREDUCE: "allreduce", ALLGATHER: "allgather", BROADCAST: "broadcast", ALLTOALL: "alltoall",
              BARRIER: "barrier"}
# Header columns.
ACTIVE, KIND, DTYPE, OP, ROOT, DIM0, ROW_NUMEL, SHAPE_KEY, NAME_KEY, SPLITS = range(10)
_MUST_AGREE = (KIND, DTYPE, OP, ROOT, ROW_NUMEL, SHAPE_KEY, NAME_KEY)  # DIM0 may differ: allgather, alltoall

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128)
REDUCE_OPS = (ReduceOp.SUM, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.PRODUCT)

_all_gather_into_tensor = COLLECTIVES["all_gather_into_tensor"]["builtin"]


@dataclass(frozen=True)
class Call:
    """One collective as this rank announces it in the header."""

    kind: int
    dtype: torch.dtype = torch.float32
    op: int = 0
    """Index in REDUCE_OPS (allreduce only)."""
    root: int = 0
    dim0: int = 0
    """Rows this rank sends (allgather, alltoall); 0 otherwise."""
    row_numel: int = 0
    """Elements per row (allgather, alltoall), or of the whole tensor."""
    shape: tuple[int, ...] = ()
    """The shape that must agree: the whole tensor's, or a row's for allgather and alltoall."""
    name: str | None = None
    splits: Sequence[int] = field(default=())
    """Rows for each destination rank (alltoall)."""

    def encode(self, world_size: int) -> list[int]:
        """The header row of an active rank."""
        if self.dtype not in DTYPES:
            raise ValueError(f"ddpkit.horovod cannot reduce or move {self.dtype} tensors; use one of "
                             f"{', '.join(str(d) for d in DTYPES)}")
        splits = list(self.splits) + [0] * (world_size - len(self.splits))
        return [1, self.kind, DTYPES.index(self.dtype), self.op, self.root, self.dim0, self.row_numel,
                _key(repr(self.shape)), _key(self.name) if self.name else 0, *splits]


class Engine:
    """One background thread running this rank's collectives in submission order.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        device: where a joined rank builds its neutral tensors (this worker's device).
        header_device: where header tensors live (``ddpkit.distributed.control_device()``).
        all_reduce: ``fn(tensor, op=ReduceOp.SUM, group=None)``, in place.
    """

    def __init__(self, rank: int, world_size: int, device: torch.device, header_device: torch.device,
                 all_reduce: Callable[..., None]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._header_device = header_device
        self._all_reduce = all_reduce
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddpkit-horovod")
        self._last_active = list(range(world_size))  # the ranks active in the latest exchange that had any

    def submit(self, call: Call, run: Callable[[Rows], T]) -> Future[T]:
        """Queue ``call``: on the worker thread, exchange headers, check them, then ``run(rows)``."""
        return self._executor.submit(self._negotiate_and_run, call, run)

    def join(self) -> int:
        """Take part in the other ranks' collectives with neutral values until every rank has joined.

        Returns:
            The rank that joined last (the highest of those that joined in the same round).
        """
        return self._executor.submit(self._join_loop).result()

    def stop(self) -> None:
        """Finish the queued collectives and end the worker thread."""
        self._executor.shutdown(wait=True)

    # -- on the worker thread ---------------------------------------------------------

    def _negotiate_and_run(self, call: Call, run: Callable[[Rows], T]) -> T:
        rows = self._exchange(call.encode(self.world_size))
        self._check_agreement(rows)
        return run(rows)

    def _join_loop(self) -> int:
        inactive = [0] * (SPLITS + self.world_size)
        while True:
            previous = self._last_active
            rows = self._exchange(inactive)
            if not any(row[ACTIVE] for row in rows):
                self._last_active = list(range(self.world_size))  # everyone is back for what follows
                return max(previous)
            self._check_agreement(rows)
            self._take_part(rows)

    def _exchange(self, header: list[int]) -> Rows:
        mine = torch.tensor(header, dtype=torch.int64, device=self._header_device)
        gathered = torch.empty(self.world_size * len(header), dtype=torch.int64, device=self._header_device)
        _all_gather_into_tensor(gathered, mine)
        rows = gathered.view(self.world_size, len(header)).tolist()
        active = [r for r, row in enumerate(rows) if row[ACTIVE]]
        if active:
            self._last_active = active
        return rows

    def _check_agreement(self, rows: Rows) -> None:
        active = [r for r, row in enumerate(rows) if row[ACTIVE]]
        first = rows[active[0]]
        for r in active[1:]:
            columns = _MUST_AGREE if first[KIND] in (ALLGATHER, ALLTOALL) else (*_MUST_AGREE, DIM0)
            if any(rows[r][c] != first[c] for c in columns):
                raise RuntimeError(
                    f"rank {active[0]} called {_describe(first)} while rank {r} called {_describe(rows[r])}; "
                    f"ddpkit.horovod matches collectives by call order: call them in the same order, with the "
                    f"same names, shapes, dtypes and ops, on every rank"
                )

    def _take_part(self, rows: Rows) -> None:
        """A joined rank's part in the collective that the active ranks announced."""
        call = rows[next(r for r, row in enumerate(rows) if row[ACTIVE])]
        kind = call[KIND]
        if kind == ALLREDUCE:
            self.all_reduce(rows, None)
        elif kind == ALLGATHER:
            self.all_gather(rows, None)
        elif kind == BROADCAST:
            self.broadcast(rows, None)
        elif kind == ALLTOALL:
            self.all_to_all(rows, None)

    # -- the data step of each collective; ``flat`` is None on a joined rank -------------

    def all_reduce(self, rows: Rows, flat: torch.Tensor | None) -> None:
        """Reduce the contiguous 1-d ``flat`` in place with the announced op (a joined rank: its neutral element)."""
        call = _announced(rows)
        op = REDUCE_OPS[call[OP]]
        if flat is None:
            flat = _neutral(op, DTYPES[call[DTYPE]], call[ROW_NUMEL], self.device)
        self._all_reduce(flat, op=op)

    def all_gather(self, rows: Rows, flat: torch.Tensor | None) -> list[torch.Tensor]:
        """Every rank's rows, flat, in rank order (a joined rank contributes none)."""
        call = _announced(rows)
        row_numel, dims = call[ROW_NUMEL], [row[DIM0] for row in rows]
        dtype, device = DTYPES[call[DTYPE]], flat.device if flat is not None else self.device
        width = max(dims) * row_numel  # pad every rank's part to the longest
        mine = torch.zeros(width, dtype=dtype, device=device)
        if flat is not None:
            mine[: flat.numel()] = flat
        gathered = torch.empty(self.world_size * width, dtype=dtype, device=device)
        _all_gather_into_tensor(gathered, mine)
        parts = gathered.view(self.world_size, width)
        return [parts[r, : dims[r] * row_numel] for r in range(self.world_size)]

    def broadcast(self, rows: Rows, flat: torch.Tensor | None) -> None:
        """Copy the root's ``flat`` into every rank's ``flat``."""
        call = _announced(rows)
        root = call[ROOT]
        if not rows[root][ACTIVE]:
            raise RuntimeError(f"broadcast from root rank {root}, which has already called hvd.join(); "
                               f"broadcast from a rank that has not joined")
        if flat is None:
            flat = torch.empty(call[ROW_NUMEL], dtype=DTYPES[call[DTYPE]], device=self.device)
        dist.broadcast(flat, src=root)

    def all_to_all(self, rows: Rows, flat: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        """Send ``splits[d]`` rows to each rank d; return what arrived and the rows from each rank."""
        call = _announced(rows)
        row_numel = call[ROW_NUMEL]
        sent = rows[self.rank][SPLITS:]  # a joined rank's row is all zeros: it sends nothing
        received = [row[SPLITS + self.rank] for row in rows]
        device = flat.device if flat is not None else self.device
        if flat is None:
            flat = torch.empty(0, dtype=DTYPES[call[DTYPE]], device=device)
        out = torch.empty(sum(received) * row_numel, dtype=flat.dtype, device=device)
        dist.all_to_all_single(out, flat, [n * row_numel for n in received], [n * row_numel for n in sent])
        return out, received


def _announced(rows: Rows) -> list[int]:
    """The header of the first active rank: what every rank is doing now."""
    return next(row for row in rows if row[ACTIVE])


def _neutral(op: ReduceOp.RedOpType, dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
    """``numel`` elements that leave ``op``'s result unchanged."""
    if op == ReduceOp.SUM:
        return torch.zeros(numel, dtype=dtype, device=device)
    if op == ReduceOp.PRODUCT:
        return torch.ones(numel, dtype=dtype, device=device)
    if dtype == torch.bool:
        value: float | bool = op == ReduceOp.MIN  # MIN of bools is "and": True leaves it unchanged
    elif dtype.is_floating_point:
        value = float("inf") if op == ReduceOp.MIN else float("-inf")
    else:
        value = torch.iinfo(dtype).max if op == ReduceOp.MIN else torch.iinfo(dtype).min
    return torch.full((numel,), value, dtype=dtype, device=device)


def _describe(row: list[int]) -> str:
    kind = KIND_NAMES.get(row[KIND], f"kind {row[KIND]}")
    if row[KIND] == BARRIER:
        return "barrier"
    what = f"{kind} of {DTYPES[row[DTYPE]]} ({row[ROW_NUMEL]} elements per row)"
    if row[KIND] == ALLREDUCE:
        what = f"{kind} {REDUCE_OPS[row[OP]].name} of {row[ROW_NUMEL]} {DTYPES[row[DTYPE]]} elements"
    elif row[KIND] == BROADCAST:
        what = f"{kind} from rank {row[ROOT]} of {row[ROW_NUMEL]} {DTYPES[row[DTYPE]]} elements"
    return what + (" (named)" if row[NAME_KEY] else " (unnamed)")


def _key(text: str) -> int:
    return zlib.crc32(text.encode())


_engine: Engine | None = None


def start(engine: Engine) -> None:
    """Make ``engine`` the one every collective of this process goes to."""
    global _engine
    _engine = engine


def current() -> Engine:
    """The running engine.

    Raises:
        ValueError: ``hvd.init()`` has not been called.
    """
    if _engine is None:
        raise ValueError("ddpkit.horovod is not initialized; call hvd.init() first")
    return _engine


def stop() -> None:
    """Finish the queued collectives and forget the engine (safe to call more than once)."""
    global _engine
    if _engine is not None:
        _engine.stop()
    _engine = None
