"""A worker process that ends with its loader's workers alive exits at once, not after 20 s.

A failed step (a peer died), a preemption's SystemExit or an error ends a
training process mid-epoch, its loader's iterator still referenced (by the
exception's traceback) and its workers waiting for indices. Under a
launcher the training process is a multiprocessing child, and its exit runs
multiprocessing's finalizers: the workers are told to stop through their
index queues, which multiprocessing closes at exit too. A stop message put
on a closed queue is lost, and torch then waits 5 s for each worker. That
happened from the second epoch on (its queues are newer than the exit
handler, and of equal priority newer finalizers run first): a round
restarted after the SIGKILL of a peer began 24 s after it instead of 1 s.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from tests.cli_runner import PYTHONPATH

LEAVE_MID_EPOCH = """
import multiprocessing
from ddpkit.data.loader import DataLoader
from tests.data.helpers import IndexDataset

def train():
    global batches  # kept alive past the function, as an exception's traceback keeps it
    loader = DataLoader(IndexDataset(64), global_batch_size=8, num_workers=2, rank=0, world_size=1,
                        persistent_workers={persistent})
    for batch in loader:  # a whole epoch: the exit handler is registered here
        pass
    loader.set_epoch(1)
    batches = iter(loader)  # the second epoch's queues, newer than the handler
    next(batches), next(batches)
    print("leaving", flush=True)

if __name__ == "__main__":
    worker = multiprocessing.get_context("fork").Process(target=train)  # as a launcher's worker
    worker.start()
    worker.join()
    print("exit status", worker.exitcode, flush=True)
"""

TORCH_STOP_WAIT = 5.0
"""Seconds torch's shutdown waits for each worker that did not get its stop message."""


@pytest.mark.parametrize("persistent", [False, True])
def test_leaving_mid_epoch_does_not_wait_for_the_workers(persistent):
    script = LEAVE_MID_EPOCH.format(persistent=persistent)
    with subprocess.Popen(
        [sys.executable, "-c", script],
        env={"PYTHONPATH": PYTHONPATH, "PATH": "/usr/bin:/bin"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as process:
        assert process.stdout is not None
        line = process.stdout.readline()
        left = time.monotonic()
        stdout, stderr = process.communicate(timeout=120)
        exited = time.monotonic()
    assert line == "leaving\n" and "exit status 0" in stdout, stdout + stderr
    # Two workers not told to stop take 2 x 5 s or more; stopped the orderly way, well under one such wait.
    assert exited - left < TORCH_STOP_WAIT, f"the worker process took {exited - left:.1f} s to exit"
