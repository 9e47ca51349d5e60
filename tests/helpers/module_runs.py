"""One multi-process run shared by several tests of a module, computed for the tests pytest selected.

Starting workers costs more than most checks, so a module runs its
multi-process cases together in a module-scoped fixture (one warm worker
server for all of them, see :func:`tests.helpers.workers.warm_workers`) and
each test asserts its own part. The server is stopped before the fixture
returns: no process outlives the fixture.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pytest

from tests.helpers.workers import run_on_ranks, warm_workers


def selected_params(request: pytest.FixtureRequest, argname: str, test: str | None = None) -> list[Any]:
    """The values of the parameter ``argname`` among this module's selected tests, in their order, once each.

    Lets a module-scoped fixture compute only what the tests that will run need (``-k``, ``-m`` or one
    node id select a subset).

    Args:
        test: only the tests of this function name.
    """
    values: list[Any] = []
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if (
            getattr(item, "module", None) is request.module
            and callspec is not None
            and argname in callspec.params
            and test in (None, item.originalname)
        ):
            value = callspec.params[argname]
            if value not in values:
                values.append(value)
    return values


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The names (without parameters) of this module's selected test functions."""
    return {item.originalname for item in request.session.items if getattr(item, "module", None) is request.module}


@dataclass
class Outcome:
    """What a call returned or raised, so that only the tests that depend on a failed part fail."""

    value: Any = None
    error: BaseException | None = None

    def get(self) -> Any:
        """The value; re-raises the call's exception (in the test that asks for it)."""
        if self.error is not None:
            raise self.error
        return self.value


def attempt(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Outcome:
    """Call ``fn``; keep its value or its exception (an AssertionError, such as RankFailed, or any Exception)."""
    try:
        return Outcome(fn(*args, **kwargs))
    except Exception as e:  # noqa: BLE001  (re-raised by Outcome.get in the test that needs it)
        return Outcome(error=e)


def run_side_by_side(jobs: Mapping[Any, tuple], preload: tuple[str, ...] = (), timeout: float = 280) -> dict:
    """Run several jobs at once, each :func:`run_on_ranks` of its own, forked from one warm worker server.

    Their ranks mostly wait on each other's messages (on 2 cores, 3 or 4
    ranks of one job keep less than one core busy), so one job's waits are
    another's turn.

    Args:
        jobs: for each key, ``(fn, world_size, args, options)``: ``run_on_ranks(fn, world_size, *args, **options)``.
        preload: more modules for the server to import once (``workers.DYNAMO``).
        timeout: each job's ``run_on_ranks`` timeout, unless its options say otherwise.

    Returns:
        Each key's :class:`Outcome`: the ranks' values or the job's failure.
    """
    outcomes: dict = {}

    def run(key: Any, fn: Callable[..., Any], world_size: int, args: tuple, options: dict) -> None:
        outcomes[key] = attempt(run_on_ranks, fn, world_size, *args, **{"timeout": timeout, **options})

    with warm_workers(preload):
        threads = [threading.Thread(target=run, args=(key, *job)) for key, job in jobs.items()]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    return outcomes
