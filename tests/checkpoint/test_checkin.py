"""The save check-in on a real TCPStore: after a stop signal, a rank that still beats is waited for; one that
does not is named within about STOP_GRACE_SECONDS."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
from torch.distributed import TCPStore

from ddpkit.checkpoint.disk.format import CheckpointError
from ddpkit.checkpoint.manager.checkin import STOP_GRACE_SECONDS, LoopProgress, check_in

PREFIX = "save/0/1"
PROGRESS = "progress/0"


@pytest.fixture
def store():
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))


@pytest.fixture
def rank0(store):
    """Rank 0's loop progress, the waiting rank's."""
    progress = LoopProgress(store, PROGRESS, 0)
    yield progress
    progress.stop()


def test_a_rank_in_a_long_step_is_waited_for_after_a_stop_signal(store, rank0):
    """Ctrl-C reached every rank; rank 1 is still in a step longer than the grace, its thread beating."""
    rank1 = LoopProgress(store, PROGRESS, 1)
    late = STOP_GRACE_SECONDS + 2
    arrive = threading.Timer(late, lambda: store.set(f"{PREFIX}/1", "20"))
    arrive.start()
    try:
        start = time.monotonic()
        check_in(store, PREFIX, 0, 2, 20, timeout=60, progress=rank0, stopping=lambda: True)
        assert time.monotonic() - start >= late - 0.5
    finally:
        arrive.cancel()
        rank1.stop()


def test_a_rank_that_no_longer_beats_is_named_soon_after_a_stop_signal(store, rank0):
    """Rank 1 died (its beats stopped): the save fails within the grace, not the 60 s timeout."""
    rank1 = LoopProgress(store, PROGRESS, 1)
    time.sleep(1.2)  # it beat at least once...
    rank1.stop()  # ...then died
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"not by rank\(s\) \[1\] within 3s of a stop signal"):
        check_in(store, PREFIX, 0, 2, 20, timeout=60, progress=rank0, stopping=lambda: True)
    assert time.monotonic() - start < STOP_GRACE_SECONDS + 3


def test_without_a_stop_signal_a_silent_rank_gets_the_whole_timeout(store, rank0):
    start = time.monotonic()
    with pytest.raises(CheckpointError, match=r"not by rank\(s\) \[1\] within 5s"):
        check_in(store, PREFIX, 0, 2, 20, timeout=5, progress=rank0)
    assert time.monotonic() - start >= 5
