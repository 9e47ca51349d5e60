"""One multi-process run shared by several tests of a module, computed for the tests pytest selected.

Starting workers costs more than most checks, so a module runs its
multi-process cases together in a module-scoped fixture (one warm worker
server for all of them, see :func:`tests.helpers.workers.warm_workers`) and
each test asserts its own part. The server is stopped before the fixture
returns: no process outlives the fixture.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest


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
        if (getattr(item, "module", None) is request.module and callspec is not None and argname in callspec.params
                and test in (None, item.originalname)):
            value = callspec.params[argname]
            if value not in values:
                values.append(value)
    return values


def selected_tests(request: pytest.FixtureRequest) -> set[str]:
    """The names (without parameters) of this module's selected test functions."""
    return {item.originalname for item in request.session.items
            if getattr(item, "module", None) is request.module}


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
