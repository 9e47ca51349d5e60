"""Every private part of torch the launchers use, in one place, each with the reason.

torch's documented launcher API (``elastic_launch``, ``LaunchConfig``,
``LocalElasticAgent``, the rendezvous handler registry) leaves out what
ddpkit changes about a launch, so the launchers reach into torch here and
nowhere else; tests/launchers/test_torch_internals.py checks that each of
these still exists, with the expected signature, on the installed torch.

- ``torch.distributed.launcher.api.LocalElasticAgent`` (the module's global
  name, which ``launch_agent`` calls): replaced for one launch by a factory of
  ddpkit's agent (:func:`agent_for_launch`), then put back. torch has no
  parameter to choose the agent class.
- ``LocalElasticAgent._monitor_workers``: overridden to read each round's
  failures (for the restart line) and to finish a round whose workers all
  exited with status 0 without sending a return value (``os._exit(0)``):
  torch's agent would wait for their values forever.
- ``LocalElasticAgent._restart_workers`` and its ``_remaining_restarts``:
  overridden to say, once per restart, which rank failed and which restart
  this is, to give back the restart of a round that failed because a
  node left an elastic job, and to tell the workers, before torch stops
  them, that nodes are joining.
- ``LocalElasticAgent._exit_barrier``, ``_store`` and ``_worker_group``:
  overridden so that node 0's agent, which serves the store, waits for the
  other agents to leave the barrier.
- ``LocalElasticAgent._shutdown`` and ``_pcontext``: overridden to note how
  each worker ended when a signal stopped the agent.
- ``MultiprocessContext._pc``, ``_ret_vals``, ``_return_values``,
  ``_worker_finished_event``: read by the silent-exit check above.
- ``torch.distributed.elastic.multiprocessing.api.SignalException``: what
  the agent raises when a signal stopped it (not exported by the package).
- ``torch.distributed.elastic.rendezvous.utils.parse_rendezvous_endpoint``:
  the host and port of an endpoint as torch's own rendezvous reads it.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed.launcher.api as launcher_api
from torch.distributed.distributed_c10d import Store
from torch.distributed.elastic.agent.server.api import RunResult, WorkerGroup, WorkerState
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent
from torch.distributed.elastic.multiprocessing import ProcessFailure
from torch.distributed.elastic.multiprocessing.api import MultiprocessContext, SignalException
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = ["HookedAgent", "SignalException", "agent_for_launch", "parse_rendezvous_endpoint"]


class HookedAgent(LocalElasticAgent):
    """torch's local agent with ddpkit's changes behind five public hooks, for a subclass to fill.

    The overrides of torch's private methods live here; what they do for
    ddpkit lives in the hooks (:mod:`ddpkit.launchers.agent`).
    """

    def round_failed(self, failures: Mapping[int, ProcessFailure]) -> None:
        """Called with a round's failures by global rank when torch's agent finds it failed."""

    def restarting(self, restart: int, max_restarts: int) -> None:
        """Called before the group is restarted, for the ``restart``-th time of ``max_restarts``."""

    def stopping_for_joining_nodes(self) -> None:
        """Called when nodes wait to join an elastic job, just before torch's agent stops the healthy workers."""

    def left_exit_barrier(self, store: Store, group_rank: int, group_world_size: int) -> None:
        """Called when this agent has passed torch's exit barrier, with the rendezvous store."""

    def stopped_by_signal(self, exit_codes: Mapping[int, int | None]) -> None:
        """Called when a signal stopped the agent, with how each worker ended by global rank."""

    def _monitor_workers(self, worker_group: WorkerGroup) -> RunResult:
        result: RunResult = super()._monitor_workers(worker_group)
        if result.state is WorkerState.FAILED:
            self.round_failed(result.failures)
        elif result.state is WorkerState.HEALTHY and isinstance(self._pcontext, MultiprocessContext):
            returned = _all_exited_without_returning(self._pcontext)
            if returned is not None:
                by_global_rank = {worker_group.workers[local].global_rank: value for local, value in returned.items()}
                return RunResult(state=WorkerState.SUCCEEDED, return_values=by_global_rank)
        return result

    def _restart_workers(self, worker_group: WorkerGroup) -> None:
        # torch also restarts a healthy group, without counting it, when nodes wait to join (elastic)
        failed = worker_group.state in (WorkerState.FAILED, WorkerState.UNHEALTHY)
        nodes_before = worker_group.group_world_size or 0
        limit = worker_group.spec.max_restarts
        restart = limit - self._remaining_restarts
        if not failed:
            self.stopping_for_joining_nodes()
        super()._restart_workers(worker_group)  # stop the workers, meet the other nodes, start the workers
        if not failed:
            return
        if (worker_group.group_world_size or 0) < nodes_before:
            # A node left: the round failed for that, not for a fault of the workers here; like a node that
            # joins (which torch does not count), it costs no restart. The workers' resume says it.
            self._remaining_restarts += 1
            return
        self.restarting(restart, limit)

    def _exit_barrier(self) -> None:
        super()._exit_barrier()
        group = self._worker_group
        assert group.group_rank is not None and group.group_world_size is not None  # set by the rendezvous
        self.left_exit_barrier(self._store, group.group_rank, group.group_world_size)

    def _shutdown(self, *args: Any, **kwargs: Any) -> None:
        super()._shutdown(*args, **kwargs)
        # torch calls this inside the ``except SignalException`` that stops its run loop.
        handled = sys.exc_info()[1]
        processes = getattr(getattr(self._pcontext, "_pc", None), "processes", None)  # forkserver workers
        if isinstance(handled, SignalException) and processes is not None:
            ranks = {worker.local_rank: worker.global_rank for worker in self._worker_group.workers}
            self.stopped_by_signal(
                {ranks.get(local_rank, local_rank): process.exitcode for local_rank, process in enumerate(processes)}
            )


def _all_exited_without_returning(context: MultiprocessContext) -> dict[int, Any] | None:
    """The return values by local rank once every worker has exited with status 0, those that sent none as None.

    None while a worker still runs (or torch's own poll will report the
    round). A worker that ends with ``os._exit(0)`` sends no value; torch's
    context would wait for one forever. A non-zero exit stays a failure:
    torch's poll, which ran first, reported it.
    """
    if context._pc is None or context._pc.sentinels:
        return None  # a worker still runs
    for local_rank, queue in context._ret_vals.items():
        if local_rank not in context._return_values:
            context._return_values[local_rank] = None if queue.empty() else queue.get()
    context._worker_finished_event.set()
    context.close()
    return dict(context._return_values)


@contextlib.contextmanager
def agent_for_launch(factory: Callable[..., LocalElasticAgent]) -> Iterator[None]:
    """For the block, have torch's ``launch_agent`` build its agent with ``factory`` (its keyword arguments)."""
    # (launch_agent reads the module's global, which torch imports without re-exporting it)
    torch_agent = launcher_api.LocalElasticAgent  # type: ignore[attr-defined]
    launcher_api.LocalElasticAgent = factory  # type: ignore[attr-defined,assignment]  # a factory in its place
    try:
        yield
    finally:
        launcher_api.LocalElasticAgent = torch_agent  # type: ignore[attr-defined]
