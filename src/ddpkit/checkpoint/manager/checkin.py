"""Every rank arrives at a save, or the save fails fast, naming the ranks and the fix.

Saving is collective: rank 0 writes, the others send their RNG states. Each
rank announces the save in the job's store and waits for the others::

    rank 0:  set save/7/0 ──┐              ┌─ wait(save/7/*) ── write
    rank 1:  set save/7/1 ──┴── store ─────┘

A rank that is merely slow arrives within ``timeout``. A save reached by some
ranks only (the tutorials' ``if rank == 0: save(...)``) would wait the whole
``timeout`` for ranks that went on training. To tell the two apart within
about a second, each rank counts the points where its loop asks the
ddpkit.DataLoader for the next batch (:class:`LoopProgress`), and a thread
publishes the count to the store twice a second, also while the main thread
is blocked in a collective. A waiting rank that sees an absent rank's count
beyond its own knows that rank passed the save without calling it.

The thread also beats (a number it increments at each publication): once a
stop signal arrived (a Ctrl-C, the launcher stopping the job after a rank
died), an absent rank whose beat stood still for STOP_GRACE_SECONDS is gone,
and the save fails at once rather than after ``timeout``; an absent rank
that still beats is alive, in a long step, and is waited for.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint.disk.format import CheckpointError

PUBLISH_SECONDS = 0.5
"""How often a rank's loop progress is published to the store (when it changed)."""
WAIT_SLICE_SECONDS = 1.0
"""How long a waiting rank waits before it looks at the absent ranks' progress again."""
STOP_GRACE_SECONDS = 3.0
"""Once a stop signal reached the waiting rank: how long an absent rank may not beat before it counts as gone."""


class LoopProgress:
    """This rank's count of loop points (batches asked for), published to the job's store by a thread.

    Args:
        store: the job's store (torch.distributed's default store).
        prefix: the store keys' prefix (distinct per restart of the job).
        rank: this rank.
    """

    def __init__(self, store: Any, prefix: str, rank: int):
        self.store, self.prefix = store, prefix
        self.count = 0
        """Loop points passed so far (counted by :meth:`advance`, on the loop's thread)."""
        self._published = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publish, args=(rank,), name="ddpkit-loop-progress", daemon=True)
        self._thread.start()

    def advance(self) -> None:
        """Count one loop point (the loop asked for its next batch); the thread publishes it."""
        self.count += 1

    def _publish(self, rank: int) -> None:
        key, beat = f"{self.prefix}/{rank}", 0
        while not self._stop.wait(PUBLISH_SECONDS):
            beat += 1
            try:
                self.store.set(key, f"{self.count} {beat}")
            except (RuntimeError, dist.DistError):
                return  # the job's store is gone: the job is ending

    def read(self, rank: int) -> tuple[int, int]:
        """(count, beat) that ``rank`` published last; (-1, -1) before its first."""
        key = f"{self.prefix}/{rank}"
        if not self.store.check([key]):
            return -1, -1
        count, beat = self.store.get(key).split()
        return int(count), int(beat)

    def stop(self) -> None:
        """Stop publishing (safe to call twice)."""
        self._stop.set()


def check_in(
    store: Any,
    prefix: str,
    rank: int,
    world_size: int,
    global_step: int,
    timeout: float,
    progress: LoopProgress | None,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Announce this rank at the save ``prefix`` and wait until every rank has.

    ``stopping`` tells that a stop signal reached this process (a Ctrl-C, a
    preemption, the launcher stopping the job after a rank died): an absent
    rank that no longer beats (see LoopProgress) is then gone after
    STOP_GRACE_SECONDS, not after the whole ``timeout``. Without a
    LoopProgress, every absent rank gets STOP_GRACE_SECONDS.

    Raises:
        CheckpointError: a rank went past the save without calling it, or did
            not arrive in time; or the ranks are at different steps.
    """
    keys = [f"{prefix}/{r}" for r in range(world_size)]
    store.set(keys[rank], str(global_step))
    here = progress.count if progress is not None else 0
    start = time.monotonic()
    deadline, pause, next_look = start + timeout, 0.0005, start + WAIT_SLICE_SECONDS
    beats = _Beats(progress)
    # Polled with check(), which never blocks: a wait() that times out makes torch log a warning each time.
    while not store.check(keys):
        now = time.monotonic()
        if now >= next_look:
            next_look = now + WAIT_SLICE_SECONDS
            absent = [r for r, key in enumerate(keys) if not store.check([key])]
            gone = beats.still_since(absent, now) if stopping() else []
            _fail_if_absent(keys, absent, here, progress, gone, timeout if now >= deadline else None)
        time.sleep(pause)
        pause = min(2 * pause, 0.05)
    steps = {r: int(store.get(key)) for r, key in enumerate(keys)}
    if len(set(steps.values())) > 1:
        raise CheckpointError(
            f"ranks reached a checkpoint save at different global steps ({steps}); call "
            "Checkpointer.step() once per optimizer step on every rank"
        )


class _Beats:
    """When each absent rank's beat last moved, as seen by the waiting rank."""

    def __init__(self, progress: LoopProgress | None):
        self.progress = progress
        self.seen: dict[int, tuple[int, float]] = {}

    def still_since(self, absent: list[int], now: float) -> list[int]:
        """The absent ranks whose beat has not moved for STOP_GRACE_SECONDS (all of them, once, without beats)."""
        gone = []
        for r in absent:
            beat = self.progress.read(r)[1] if self.progress is not None else -1
            last_beat, since = self.seen.get(r, (beat, now))
            if beat != last_beat:
                since = now
            self.seen[r] = (beat, since)
            if now - since >= STOP_GRACE_SECONDS:
                gone.append(r)
        return gone


def _fail_if_absent(
    keys: list[str], absent: list[int], here: int, progress: LoopProgress | None, gone: list[int], timeout: float | None
) -> None:
    """Raise if an absent rank went on past the save, is gone after a stop signal, or (``timeout`` given) is late."""
    present = [r for r in range(len(keys)) if r not in absent]
    went_on = [r for r in absent if progress is not None and progress.read(r)[0] > here]
    if went_on:
        raise CheckpointError(
            f"a checkpoint save was called on rank(s) {present} only: rank(s) {went_on} went on training "
            f"past it; saving is collective: call save() on every rank, not under `if rank == 0` "
            f"(rank 0 writes, the others send their random states)"
        )
    if gone or timeout is not None:
        waited = f"within {STOP_GRACE_SECONDS:g}s of a stop signal" if gone else f"within {timeout:g}s"
        raise CheckpointError(
            f"a checkpoint save was reached by rank(s) {present} but not by rank(s) {gone or absent} {waited}; "
            f"saving is collective: call Checkpointer.step()/save() on every rank at the same point"
        )


class SaveCheckIns:
    """One Checkpointer's check-ins: a store key per save, and the loop progress that tells a rank went on.

    Every rank makes its Checkpointers in the same order and counts their
    saves alike, so the keys agree across ranks; a process may hold several
    Checkpointers in its life (a resumed run, a test), each with its keys.

    Args:
        instance: this Checkpointer's number among the process's (the same on every rank).
        rank: this rank.
        world_size: number of ranks (1: no check-in at all).
        restart: the elastic restart's number (each round of workers has keys of its own).
        timeout: seconds a save waits for every rank.
    """

    def __init__(self, instance: int, rank: int, world_size: int, restart: str, timeout: float):
        self.instance, self.rank, self.world_size = instance, rank, world_size
        self.restart, self.timeout = restart, timeout
        self.progress: LoopProgress | None = None
        """This rank's loop progress, once :meth:`follow_loop` started publishing it."""
        self._saves = 0

    def follow_loop(self, store: Callable[[], Any]) -> LoopProgress | None:
        """Start publishing the loop's progress to ``store()`` (with several ranks); the caller counts it."""
        if self.world_size > 1 and self.progress is None:
            self.progress = LoopProgress(store(), f"ddpkit/progress/{self.restart}", self.rank)
        return self.progress

    def count_loop_point(self) -> None:
        """The loop asked for its next batch: one more loop point, for the ranks waiting at a save to see."""
        if self.progress is not None:
            self.progress.advance()

    def check_in(self, store: Callable[[], Any], global_step: int, stopping: Callable[[], bool]) -> None:
        """Announce this save in ``store()`` and wait for every rank (see :func:`check_in`); nothing with one rank."""
        if self.world_size == 1:
            return
        self._saves += 1
        prefix = f"ddpkit/save/{self.restart}/{self.instance}/{self._saves}"
        check_in(store(), prefix, self.rank, self.world_size, global_step, self.timeout, self.progress, stopping)

    def stop(self) -> None:
        """Stop publishing the loop's progress (safe to call twice)."""
        if self.progress is not None:
            self.progress.stop()
