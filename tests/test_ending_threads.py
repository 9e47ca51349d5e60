"""Threads about to end are waited for before a fork (ddpkit.ending_threads)."""

from __future__ import annotations

import threading
import time

from ddpkit import ending_threads
from ddpkit.checkpoint.disk.async_save import BackgroundWriter


def test_a_thread_that_said_it_ends_is_joined_and_one_that_never_ends_is_left_after_the_timeout() -> None:
    release = threading.Event()

    def slow_to_end() -> None:
        ending_threads.about_to_end()
        time.sleep(0.3)  # its teardown, stretched: a fork now would inherit a lock it holds

    def stuck() -> None:
        release.wait()

    ending, blocked = threading.Thread(target=slow_to_end), threading.Thread(target=stuck)
    ending.start()
    blocked.start()
    try:
        while ending not in ending_threads._ENDING:
            time.sleep(0.01)
        start = time.monotonic()
        ending_threads.join_ending_threads([blocked], timeout=1.0)
        assert not ending.is_alive()  # waited for
        assert blocked.is_alive() and time.monotonic() - start < 1.5  # a thread that never ends: left in time
        assert not ending_threads._ENDING
    finally:
        release.set()
        blocked.join()


def test_a_background_checkpoint_writers_thread_says_it_ends() -> None:
    writer = BackgroundWriter()
    writer.submit(lambda: 1)
    writer.collect(wait=True)
    assert writer._thread in ending_threads._ENDING
    ending_threads.join_ending_threads()
