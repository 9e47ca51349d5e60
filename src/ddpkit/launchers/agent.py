"""ddpkit's elastic agent: torch's local agent, with the changes ddpkit makes to it for one launch.

torch's ``elastic_launch`` supervises the workers through its
``LocalElasticAgent``. For the length of one launch (:func:`ddpkit_agent`),
it builds :class:`DdpkitAgent` instead, which:

- says once per restart which rank failed, how, and which restart this is
  (torch restarts the group silently, its logs being quieted here);
- keeps node 0's agent, which serves the rendezvous store, until every
  node's agent has left torch's exit barrier: node 0 would otherwise close
  the store while another agent still reads the barrier's answer from it,
  which then prints c10d's "Failed to recv ... Did the remote server
  shutdown or crash?" with a C++ stack after a job that succeeded;
- tells the workers that nodes are joining an elastic job before it stops
  them for that (:func:`~ddpkit.launchers.elastic.write_nodes_change`), so
  their checkpoint on that SIGTERM is not announced as a preemption;
- notes how each worker ended when a signal stopped it, in the launch's
  :class:`AgentReport`, for :class:`~ddpkit.launchers.local.StoppedBySignal`;
- takes a worker that exited with status 0 without returning (``os._exit(0)``)
  as finished (:class:`~ddpkit.launchers.torch_internals.HookedAgent`).

When the launch ends, torch's agent, its logging levels and torch's launcher
are as they were.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.distributed_c10d import Store
from torch.distributed.elastic.multiprocessing import ProcessFailure

from ddpkit.distributed import NODES_JOINING
from ddpkit.launchers.elastic import write_nodes_change
from ddpkit.launchers.torch_internals import HookedAgent, agent_for_launch

AGENTS_LEFT_KEY = "ddpkit/agents_left_exit_barrier"
"""Store key each node's agent increments once past torch's exit barrier."""
EXIT_BARRIER_GRACE_S = 30.0
"""The longest node 0's agent waits, past the exit barrier, for the other agents to leave it."""
QUIETED_LOGGERS = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing")
"""torch's loggers quieted for a launch: the agent logs every lifecycle step, and each failure with a traceback
of its own polling code; ddpkit reports the root cause itself."""


@dataclass
class AgentReport:
    """What the agent of one launch tells the launcher beyond torch's result."""

    exit_codes: dict[int, int | None] = field(default_factory=dict)
    """When a signal stopped the agent: how each worker ended, by global rank (negative: killed by that signal)."""


class DdpkitAgent(HookedAgent):
    """torch's local agent that announces restarts, outlives the exit barrier on node 0, and reports its stop."""

    def __init__(self, *args: Any, report: AgentReport, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.report = report
        self.failures: Mapping[int, ProcessFailure] = {}
        """The newest failed round's failures by global rank."""

    def round_failed(self, failures: Mapping[int, ProcessFailure]) -> None:
        self.failures = failures

    def restarting(self, restart: int, max_restarts: int) -> None:
        print(
            f"ddpkit: {first_failure(self.failures)}; restarting the workers "
            f"(restart {restart} of {max_restarts}); they resume from the newest checkpoint",
            file=sys.stderr,
            flush=True,
        )

    def stopping_for_joining_nodes(self) -> None:
        write_nodes_change(NODES_JOINING)

    def left_exit_barrier(self, store: Store, group_rank: int, group_world_size: int) -> None:
        if group_world_size < 2:
            return
        try:
            left = store.add(AGENTS_LEFT_KEY, 1)
            deadline = time.monotonic() + EXIT_BARRIER_GRACE_S
            while group_rank == 0 and left < group_world_size and time.monotonic() < deadline:
                time.sleep(0.05)
                left = store.add(AGENTS_LEFT_KEY, 0)
        except RuntimeError:  # the store is gone (node 0 ended first after all): nothing left to wait for
            pass

    def stopped_by_signal(self, exit_codes: Mapping[int, int | None]) -> None:
        self.report.exit_codes = dict(exit_codes)


def first_failure(failures: Mapping[int, ProcessFailure]) -> str:
    """'rank 1 was killed by SIGKILL' for the earliest of a round's failures (the root cause)."""
    if not failures:
        return "a worker failed"
    rank, failure = min(failures.items(), key=lambda item: item[1].timestamp)
    if failure.exitcode < 0:
        return f"rank {rank} was killed by {failure.signal_name()}"
    return f"rank {rank} exited with status {failure.exitcode}"


@contextlib.contextmanager
def ddpkit_agent() -> Iterator[AgentReport]:
    """For the block (one launch), torch's launcher runs :class:`DdpkitAgent`, its logs quieted; yields its report."""
    report = AgentReport()
    with _quiet_logs(), agent_for_launch(functools.partial(DdpkitAgent, report=report)):
        yield report


@contextlib.contextmanager
def _quiet_logs() -> Iterator[None]:
    """Set torch's launcher loggers (:data:`QUIETED_LOGGERS`) to CRITICAL for the block, then back."""
    names = [name for name in [*QUIETED_LOGGERS, *logging.root.manager.loggerDict] if name.startswith(QUIETED_LOGGERS)]
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
