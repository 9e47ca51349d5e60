"""The background thread that runs every ``ddpkit.horovod`` collective, in call order, and ``hvd.join``.

Horovod queues each collective for one background thread and returns a
handle at once; ``synchronize(handle)`` waits. Here too: :class:`Engine`
owns one worker thread, and the collectives a rank submits run there, one
after the other, in the order that rank submitted them. Ranks are matched
by that order (Horovod matches by name after a negotiation round; plain
training code calls its collectives in the same order on every rank, which
is what makes order enough).

Every collective starts with a header exchange: one ``all_gather`` of a
small int64 vector per rank saying what the rank is about to do (kind,
dtype, op, root, first dimension, elements per row, shape and name keys,
alltoall splits, and for allreduces how many are queued and their sizes)
and whether it is still active. This buys four things:

- a rank that called ``hvd.join()`` takes part in the others' collectives
  without knowing them in advance: it reads the header of an active rank
  and contributes the neutral element (zeros to a sum, no rows to an
  allgather), which is Horovod's join with uneven inputs;
- allgather learns every rank's first dimension, alltoall every rank's
  splits, with no extra round;
- tensor fusion, as Horovod's: the allreduces queued back to back (same
  dtype, op and device, up to FUSION_LIMIT) on every rank travel as one
  buffer, one all_reduce; each rank announces how many it has queued and
  the smallest count is fused;
- a rank calling a different collective, shape, dtype or name than its
  peers fails on every rank with one message naming both calls, rather
  than hanging::

      rank 0 (training):  [active=1, ALLREDUCE, float32, SUM, ..., queued=3, sizes 10 30 40] --.
      rank 1 (training):  [active=1, ALLREDUCE, float32, SUM, ..., queued=2, sizes 10 30]    --|-- all_gather
      rank 2 (joined):    [active=0, 0, 0, ...]                                            --'
      then ranks 0 and 1 all-reduce their first 2 gradients as one buffer of 30 elements;
      rank 2 all-reduces 30 zeros.

Cost: one header exchange, an all_reduce of (world_size x (10 + world_size + 2 x
FUSION_LIMIT) int64, per collective or fused group of allreduces. The data
moves over ddpkit's all_reduce (``allreduce=auto``: shared memory between
the processes of one node on CPU, the backend's built-in otherwise; see
:mod:`ddpkit.comm.grad_sync`) and over torch.distributed's all_gather,
broadcast and all_to_all.
"""

from __future__ import annotations

import collections
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from ddpkit.comm.ops import ReduceOp
from ddpkit.comm.registry import COLLECTIVES

T = TypeVar("T")
Rows = list[list[int]]
"""The exchanged headers, one row per rank."""

ALLREDUCE, ALLGATHER, BROADCAST, ALLTOALL, BARRIER = 1, 2, 3, 4, 5
KIND_NAMES = {
    ALLREDUCE: "allreduce",
    ALLGATHER: "allgather",
    BROADCAST: "broadcast",
    ALLTOALL: "alltoall",
    BARRIER: "barrier",
}
# Header columns; then world_size splits, FUSION_LIMIT running sizes and FUSION_LIMIT running keys.
ACTIVE, KIND, DTYPE, OP, ROOT, DIM0, ROW_NUMEL, SHAPE_KEY, NAME_KEY, QUEUED, SPLITS = range(11)
_MUST_AGREE = (KIND, DTYPE, OP, ROOT, ROW_NUMEL, SHAPE_KEY, NAME_KEY)  # DIM0 may differ: allgather, alltoall
FUSION_LIMIT = 64
"""Most allreduces fused into one all_reduce."""

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
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
    shape: tuple[int, ...] | tuple[tuple[int, ...], ...] = ()
    """The shape that must agree: the whole tensor's, or a row's for allgather and alltoall."""
    name: str | None = None
    splits: Sequence[int] = field(default=())
    """Rows for each destination rank (alltoall)."""

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(
                f"ddpkit.horovod cannot reduce or move {self.dtype} tensors; use one of "
                f"{', '.join(str(d) for d in DTYPES)}"
            )

    @property
    def key(self) -> int:
        """What must agree across ranks besides the sizes: the shape and the name."""
        return _key(repr(self.shape))

    @property
    def name_key(self) -> int:
        return _key(self.name) if self.name else 0


@dataclass(eq=False)
class _Item:
    """A queued collective: ``run(rows)`` on the worker thread, or for a fusable allreduce, prepare/finish."""

    call: Call | None  # None: a join
    future: Future[Any]
    run: Callable[[Rows], Any] | None = None
    prepare: Callable[[], torch.Tensor] | None = None
    """The flat buffer to reduce (scaled, on its device)."""
    finish: Callable[[torch.Tensor], Any] | None = None
    """From the reduced part of the fused buffer to the result."""
    device: torch.device | None = None


_STOP = _Item(None, Future())  # ends the worker thread (compared by identity)


def _prepared(item: _Item) -> torch.Tensor:
    """The flat buffer of a fusable allreduce."""
    assert item.prepare is not None, "a fusable allreduce"
    return item.prepare()


def _finished(item: _Item, part: torch.Tensor) -> Any:
    """A fusable allreduce's result from its reduced ``part`` of the fused buffer."""
    assert item.finish is not None, "a fusable allreduce"
    return item.finish(part)


class Engine:
    """One background thread running this rank's collectives in submission order.

    Args:
        rank: this process's global rank.
        world_size: number of processes.
        device: where a joined rank builds its neutral tensors (this worker's device).
        header_device: where header tensors live (``ddpkit.distributed.control_device()``).
        all_reduce: ``fn(tensor, op=ReduceOp.SUM, group=None)``, in place.
    """

    def __init__(
        self,
        rank: int,
        world_size: int,
        device: torch.device,
        header_device: torch.device,
        all_reduce: Callable[..., None],
    ) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self._header_device = header_device
        self._all_reduce = all_reduce
        self._sizes_column = SPLITS + world_size
        self._keys_column = self._sizes_column + FUSION_LIMIT
        self._header_length = self._keys_column + FUSION_LIMIT
        self._last_active = list(range(world_size))  # the ranks active in the latest exchange that had any
        self._queue: collections.deque[_Item] = collections.deque()
        self._condition = threading.Condition()
        # A daemon: a script that never calls hvd.shutdown() still exits.
        self._thread = threading.Thread(target=self._loop, name="ddpkit-horovod", daemon=True)
        self._thread.start()

    def submit(self, call: Call, run: Callable[[Rows], T]) -> Future[T]:
        """Queue ``call``: on the worker thread, exchange headers, check them, then ``run(rows)``."""
        return self._put(_Item(call, Future(), run=run))

    def submit_allreduce(
        self, call: Call, prepare: Callable[[], torch.Tensor], finish: Callable[[torch.Tensor], T], device: torch.device
    ) -> Future[T]:
        """Queue an allreduce that may travel fused with the allreduces queued right after it."""
        return self._put(_Item(call, Future(), prepare=prepare, finish=finish, device=device))

    def join(self) -> int:
        """Take part in the other ranks' collectives with neutral values until every rank has joined.

        Returns:
            The rank that joined last (the highest of those that joined in the same round).
        """
        last: int = self._put(_Item(None, Future())).result()
        return last

    def stop(self) -> None:
        """Finish the queued collectives and end the worker thread."""
        with self._condition:
            self._queue.append(_STOP)
            self._condition.notify()
        self._thread.join()

    def _put(self, item: _Item) -> Future[Any]:
        with self._condition:
            self._queue.append(item)
            self._condition.notify()
        return item.future

    # -- on the worker thread ---------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._condition:
                while not self._queue:
                    self._condition.wait()
                head = self._queue.popleft()
                if head is _STOP:
                    return
                followers = self._fusable_followers(head) if head.prepare is not None else []
            batch = [head]
            try:
                if head.call is None:
                    head.future.set_result(self._join_loop())
                elif head.prepare is not None:
                    self._allreduce_fused(batch, followers)
                else:
                    assert head.run is not None, "a collective other than a fusable allreduce has its run"
                    rows = self._exchange(self._header([head.call]))
                    self._check_agreement(rows)
                    head.future.set_result(head.run(rows))
            except BaseException as e:  # the caller's synchronize() raises it
                for item in batch:
                    if not item.future.done():
                        item.future.set_exception(e)

    def _fusable_followers(self, head: _Item) -> list[_Item]:
        """The allreduces queued right behind ``head`` that can share its buffer (the lock is held)."""
        assert head.call is not None, "an allreduce"
        followers: list[_Item] = []
        for item in self._queue:
            if (
                len(followers) == FUSION_LIMIT - 1
                or item is _STOP
                or item.prepare is None
                or item.call is None  # (a join, which has no prepare either)
                or (item.call.dtype, item.call.op, item.device) != (head.call.dtype, head.call.op, head.device)
            ):
                break
            followers.append(item)
        return followers

    def _allreduce_fused(self, batch: list[_Item], followers: list[_Item]) -> None:
        """Announce ``batch[0]`` and its followers; reduce as many as every rank has queued, in one buffer.

        The fused followers are appended to ``batch`` as soon as they leave the queue.
        """
        # (Every allreduce has its call; only a join, never fused, has none.)
        rows = self._exchange(self._header([item.call for item in [*batch, *followers] if item.call is not None]))
        count = self._fused_count(rows)
        with self._condition:  # the fused followers are still the first in the queue: only this thread pops
            batch += [self._queue.popleft() for _ in range(count - 1)]
        self._check_agreement(rows)
        flats = [_prepared(item) for item in batch]
        fused = flats[0] if count == 1 else torch.cat(flats)
        self.all_reduce(rows, fused)
        parts = [fused] if count == 1 else torch.split(fused, [f.numel() for f in flats])
        for item, part in zip(batch, parts):
            item.future.set_result(_finished(item, part))

    def _header(self, calls: list[Call]) -> list[int]:
        """This rank's header row announcing ``calls`` (several only for fusable allreduces)."""
        first = calls[0]
        header = [0] * self._header_length
        header[:SPLITS] = [
            1,
            first.kind,
            DTYPES.index(first.dtype),
            first.op,
            first.root,
            first.dim0,
            first.row_numel,
            first.key,
            first.name_key,
            len(calls) if first.kind == ALLREDUCE else 0,
        ]
        header[SPLITS : SPLITS + len(first.splits)] = list(first.splits)
        numel, key = 0, 0
        for i, call in enumerate(calls if first.kind == ALLREDUCE else []):
            numel += call.row_numel
            key = zlib.crc32(f"{call.key},{call.name_key}".encode(), key)
            header[self._sizes_column + i], header[self._keys_column + i] = numel, key
        return header

    def _fused_count(self, rows: Rows) -> int:
        return min(row[QUEUED] for row in rows if row[ACTIVE])

    def _join_loop(self) -> int:
        inactive = [0] * self._header_length
        while True:
            previous = self._last_active
            rows = self._exchange(inactive)
            if not any(row[ACTIVE] for row in rows):
                self._last_active = list(range(self.world_size))  # everyone is back for what follows
                return max(previous)
            self._check_agreement(rows)
            self._take_part(rows)

    def _exchange(self, header: list[int]) -> Rows:
        # An all_gather as a sum of rows that are zero but for each rank's own: it then runs on the
        # fast all_reduce (microseconds through shared memory, where gloo's all_gather takes ~100 us).
        gathered = torch.zeros(self.world_size, len(header), dtype=torch.int64)
        gathered[self.rank] = torch.tensor(header, dtype=torch.int64)
        gathered = gathered.to(self._header_device)
        self._all_reduce(gathered, op=ReduceOp.SUM)
        rows = gathered.tolist()
        active = [r for r, row in enumerate(rows) if row[ACTIVE]]
        if active:
            self._last_active = active
        return rows

    def _check_agreement(self, rows: Rows) -> None:
        active = [r for r, row in enumerate(rows) if row[ACTIVE]]
        first = rows[active[0]]
        columns = _MUST_AGREE if first[KIND] in (ALLGATHER, ALLTOALL) else (*_MUST_AGREE, DIM0)
        if first[KIND] == ALLREDUCE:
            fused = self._fused_count(rows) - 1
            columns = (*columns, self._sizes_column + fused, self._keys_column + fused)
        for r in active[1:]:
            if any(rows[r][c] != first[c] for c in columns):
                raise RuntimeError(
                    f"rank {active[0]} called {_describe(first)} while rank {r} called {_describe(rows[r])}; "
                    f"ddpkit.horovod matches collectives by call order: call them in the same order, with the "
                    f"same names, shapes, dtypes and ops, on every rank"
                )

    def _take_part(self, rows: Rows) -> None:
        """A joined rank's part in the collective that the active ranks announced."""
        kind = _announced(rows)[KIND]
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
            numel = call[self._sizes_column + self._fused_count(rows) - 1]
            flat = _neutral(op, DTYPES[call[DTYPE]], numel, self.device)
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
            raise RuntimeError(
                f"broadcast from root rank {root}, which has already called hvd.join(); "
                f"broadcast from a rank that has not joined"
            )
        if flat is None:
            flat = torch.empty(call[ROW_NUMEL], dtype=DTYPES[call[DTYPE]], device=self.device)
        dist.broadcast(flat, src=root)

    def all_to_all(self, rows: Rows, flat: torch.Tensor | None) -> tuple[torch.Tensor, list[int]]:
        """Send ``splits[d]`` rows to each rank d; return what arrived and the rows from each rank."""
        call = _announced(rows)
        row_numel = call[ROW_NUMEL]
        sent = rows[self.rank][SPLITS : SPLITS + self.world_size]  # a joined rank's row is all zeros: it sends nothing
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
