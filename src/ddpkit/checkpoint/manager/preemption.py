"""Preemption: a signal makes every worker finish its step, checkpoint, and exit 75.

Schedulers announce the end of a job with a signal: Slurm sends SIGTERM (or
the ``--signal`` of the job, e.g. SIGUSR1) a grace period before SIGKILL,
Kubernetes sends SIGTERM, a person runs ``kill``. The signal may reach every
worker, some of them, or only the launcher.

How ddpkit reacts, cheaply:

1. The handler only records the signal (a signal can arrive at any
   instruction; saving from inside it would be unsafe). It is installed with
   ``siginterrupt(False)``, so system calls in progress (a socket read inside
   a collective) are restarted rather than failing with EINTR.
2. The ranks agree at the same optimizer step, every K steps, with one
   all_reduce (MAX) of three integers: the signal seen by any rank, whether
   rank 0's clock says a timed checkpoint is due (``checkpoint.every_seconds``),
   and rank 0's choice of the next K. Rank 0 picks K from the measured step
   time so that agreements are about ``checkpoint.sync_seconds`` apart: about
   one tiny all_reduce per second whatever the step time (W1's 0.3 ms steps:
   one per ~3,000 steps), so the flag costs nothing per step but an integer
   compare, and the reaction comes within about a second::

       step:      ... 2998  2999  3000 ...
       rank 0:    flag=0  ........ all_reduce([0, due, K]) -> [15, 0, 3100]
       rank 1:    flag=15 (SIGTERM) all_reduce([15, 0, 0]) -> [15, 0, 3100]
                  -> both save checkpoint step 3000, then exit 75

3. Every rank then takes part in one checkpoint (rank 0 writes), and exits
   with :data:`EXIT_PREEMPTED` (75, EX_TEMPFAIL: "try again"). Under ddpkit's
   launcher or torchrun with restarts left, the agent restarts the workers,
   which resume from that checkpoint; with ``checkpoint.requeue`` under Slurm,
   rank 0 runs ``scontrol requeue $SLURM_JOB_ID`` once the checkpoint is complete.

SIGINT (Ctrl-C) is a preemption signal by default: the same checkpoint, then
exit status :data:`EXIT_INTERRUPTED` (130) instead of 75, since nobody
should restart a job its user interrupted. A second Ctrl-C stops at once.

The launcher side: torch's elastic agent handles SIGTERM, SIGHUP and SIGQUIT
itself: it passes the signal to the workers, waits for them (30 s by
default, ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``) and then kills them. ddpkit's
launcher adds the preemption signals to that list, so a SIGUSR1 sent to the
launcher reaches the workers too instead of killing the launcher alone; it
handles SIGINT itself (see :mod:`ddpkit.launchers.signals`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

from ddpkit.distributed import NODES_CHANGED_VARIABLE, nodes_joining
from ddpkit.log import get_logger
from ddpkit.names import EXIT_INTERRUPTED, EXIT_PREEMPTED

MAX_SYNC_INTERVAL = 100_000
"""Upper bound of K, the steps between two agreements."""


class Preempted(SystemExit):
    """Raised once the preemption checkpoint is complete; the process exits with EXIT_PREEMPTED.

    A SystemExit, so that it passes through the training loop and the
    launcher's error reporting (it is an orderly exit, not a failure).
    """

    def __init__(self, signal_name: str, checkpoint: str):
        super().__init__(exit_status(signal_name))
        self.signal_name = signal_name
        self.checkpoint = checkpoint


def exit_status(signal_name: str) -> int:
    """The exit status after a preemption checkpoint for that signal: 130 for Ctrl-C (SIGINT), else 75."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


def preempted_line(signal_name: str, global_step: int, checkpoint: object, continue_hint: str) -> str:
    """Rank 0's last line after a preemption checkpoint: the signal, the step, the checkpoint, the status, what next."""
    if signal_name != "SIGINT" and nodes_joining(os.environ):  # the agent stops the workers to take a node in
        return (
            f"a node is joining this elastic job: the workers stopped after global step {global_step} with "
            f"checkpoint {checkpoint}, and the job continues from it at its new size"
        )
    what = "interrupted (Ctrl-C)" if signal_name == "SIGINT" else f"preempted by {signal_name}"
    if os.environ.get(NODES_CHANGED_VARIABLE) and signal_name != "SIGINT":  # an elastic ddpkit launch's worker
        continue_hint = (
            "the nodes of this elastic job that stay go on from it by themselves, at their new size (a node "
            "that left rejoins with the same command)"
        )
    return (
        f"{what} after global step {global_step}: checkpoint {checkpoint} is complete; "
        f"exiting with status {exit_status(signal_name)}; {continue_hint}"
    )


def signal_name(signum: int) -> str:
    """``15 -> "SIGTERM"``."""
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class PreemptionSignals:
    """Handlers that record the first preemption signal received; ``close()`` restores the previous ones.

    A second SIGINT (Ctrl-C pressed again while the first one's checkpoint is
    pending) raises KeyboardInterrupt, as Python's own handler does.

    Args:
        names: signal names, e.g. ("SIGTERM", "SIGUSR1").
    """

    def __init__(self, names: Sequence[str]):
        self.signals = [getattr(signal, name) for name in names]
        self.received = 0
        """The number of the first signal received, 0 if none."""
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Install the handlers (main thread only; elsewhere this does nothing)."""
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals cannot be handled here
                return
            signal.siginterrupt(sig, False)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if signum == signal.SIGINT == self.received:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now, without the checkpoint
        if not self.received:
            self.received = signum

    def close(self) -> None:
        """Restore the handlers that were in place before ``install()``."""
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()


class Agreement:
    """Decides, at the same step on every rank, whether to stop for a signal or save for the clock.

    Args:
        world_size: number of ranks.
        is_main: True on rank 0 (whose clock and step time count).
        device: device of the collective's tensor (CUDA for nccl).
        sync_seconds: target time between two agreements.
        every_seconds: timed checkpoint cadence (0: none).
    """

    def __init__(self, world_size: int, is_main: bool, device: torch.device, sync_seconds: float, every_seconds: float):
        self.world_size = world_size
        self.is_main = is_main
        self.device = device
        self.sync_seconds = sync_seconds
        self.every_seconds = every_seconds
        self.next_step = 1
        """Global step of the next agreement."""
        self._last_save = time.monotonic()  # when the last checkpoint was written (rank 0's clock)
        self._mark_step = 0
        self._mark_time = time.perf_counter()

    def start(self, global_step: int) -> None:
        """Training (re)starts after ``global_step`` steps: agree after the next one, then adapt K."""
        self.next_step = global_step + 1
        self._mark_step, self._mark_time = global_step, time.perf_counter()

    def saved(self) -> None:
        """A checkpoint was written now: the ``every_seconds`` clock starts again."""
        self._last_save = time.monotonic()

    def agree(self, global_step: int, local_signal: int) -> tuple[int, bool]:
        """One collective: returns (the signal any rank received or 0, whether a timed checkpoint is due).

        Also schedules the next agreement (``next_step``).
        """
        time_due = bool(self.every_seconds) and time.monotonic() - self._last_save >= self.every_seconds
        interval = self._next_interval(global_step) if self.is_main else 0
        values = [local_signal, int(time_due and self.is_main), interval]
        # Through the group even with one worker, so a single-GPU (nccl) run exercises this path too.
        if dist.is_available() and dist.is_initialized():
            packed = torch.tensor(values, dtype=torch.int64, device=self.device)
            dist.all_reduce(packed, op=dist.ReduceOp.MAX)
            values = packed.tolist()
        self.next_step = global_step + max(1, values[2])
        return values[0], bool(values[1])

    def _next_interval(self, global_step: int) -> int:
        now = time.perf_counter()
        steps, elapsed = global_step - self._mark_step, now - self._mark_time
        self._mark_step, self._mark_time = global_step, now
        if steps <= 0 or elapsed <= 0:
            return 1
        # At most twice the last interval: the first steps' time says little about the rest (a DataLoader's
        # workers starting, evaluation, saves), and a jump to thousands of steps would leave a Ctrl-C or a
        # preemption unheard for the rest of a short run.
        return int(min(max(self.sync_seconds * steps / elapsed, 1), 2 * steps, MAX_SYNC_INTERVAL))


def say_preempted(
    signal_name: str,
    global_step: int,
    checkpoint: object,
    continue_hint: str,
    requeue: bool,
    environ: Mapping[str, str],
) -> None:
    """Rank 0, after a preemption's checkpoint: :func:`preempted_line`, then the job requeued if ``requeue``."""
    get_logger().warning(preempted_line(signal_name, global_step, checkpoint, continue_hint))
    if requeue and not nodes_joining(os.environ):  # a node joining is no end of the job: nothing to requeue
        get_logger().warning(requeue_slurm_job(environ))


def requeue_slurm_job(environ: Mapping[str, str]) -> str:
    """Run ``scontrol requeue $SLURM_JOB_ID``; return a line for the log.

    Never raises: the checkpoint is written whatever happens here, and a
    failed requeue is reported as such.
    """
    job_id = environ.get("SLURM_JOB_ID")
    if not job_id:
        return "checkpoint.requeue is set but this is not a Slurm job (no SLURM_JOB_ID): nothing requeued"
    try:
        out = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"could not requeue Slurm job {job_id}: {e}; resubmit it with resume=auto"
    if out.returncode != 0:
        return f"scontrol requeue {job_id} failed: {out.stderr.strip() or out.returncode}; resubmit it with resume=auto"
    return f"requeued Slurm job {job_id}: its next run resumes from the checkpoint"
