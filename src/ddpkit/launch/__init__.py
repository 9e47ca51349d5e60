"""Starting workers: on this machine (local, function), in sbatch scripts, under mpirun.

This package is also ``ddpkit.launch(fn, *args, nproc=N)`` itself
(:func:`ddpkit.launch.function.launch`): Python binds ``ddpkit.launch`` to
this package as soon as any of its modules is imported, so the package is
made callable, and a call of it is a call of that function, whichever of
the two ``ddpkit.launch`` names at the time.
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _CallablePackage(types.ModuleType):
    """This package's type: a module that, called, runs :func:`ddpkit.launch.function.launch`."""

    def __call__(self, fn: Any, *args: Any, **options: Any) -> Any:
        __tracebackhide__ = True  # IPython and pytest show the caller's line, not this one
        from ddpkit.launch.function import launch

        return launch(fn, *args, **options)


sys.modules[__name__].__class__ = _CallablePackage
