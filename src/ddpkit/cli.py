"""Old home of the ``ddpkit`` command's entry point, kept for one release: ``import ddpkit.cli; ddpkit.cli.run()``
(a SageMaker entry script) still works, with a DeprecationWarning; the command is :mod:`ddpkit.commands.dispatch`."""

from __future__ import annotations

import warnings
from typing import Any

_MOVED = ("run", "main")
"""The names a script took from here, now in ddpkit.commands.dispatch."""


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"ddpkit.cli.{name} is now ddpkit.commands.dispatch.{name}; the old name will be removed in the next release",
        DeprecationWarning,
        stacklevel=2,  # the script that used the old name
    )
    from ddpkit.commands import dispatch  # deferred: only a script of the old form reaches it

    return getattr(dispatch, name)
