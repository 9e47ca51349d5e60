"""Old names kept for one release after a rename: using one works, with a DeprecationWarning.

A module that renamed a public class lists ``{old: new}`` and serves the old names from its
``__getattr__`` (PEP 562), which Python calls only for names the module does not have::

    _RENAMED = {"ClusterEnvironment": "JobEnvironment"}

    def __getattr__(name: str) -> Any:
        return renamed(__name__, name, _RENAMED)

``from module import ClusterEnvironment`` and ``module.ClusterEnvironment`` then give the new
class and warn once per place of use (Python's default filter shows DeprecationWarning in
``__main__`` and under pytest).
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Mapping
from typing import Any


def renamed(module: str, name: str, renames: Mapping[str, str]) -> Any:
    """What ``module.name`` is now called, if ``name`` is an old name in ``renames``, with a DeprecationWarning.

    Raises:
        AttributeError: ``name`` is not an old name either (as for any missing attribute).
    """
    if name not in renames:
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    warnings.warn(
        f"{module}.{name} is now {renames[name]}; the old name will be removed in the next release",
        DeprecationWarning,
        stacklevel=3,  # the code that used the old name: past this function and the module's __getattr__
    )
    return getattr(sys.modules[module], renames[name])
