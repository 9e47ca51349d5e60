"""``hvd.elastic``: not supported; every name in it raises with the alternative.

ddpkit's way to survive failures and preemption: save with
``ddpkit.Checkpointer`` (``ckpt.resume("auto")`` at start) and let
``ddpkit run max_restarts=N`` (or ``torchrun --max-restarts``) restart the
workers.
"""

from __future__ import annotations

from typing import NoReturn

from ddpkit.horovod.unsupported import ELASTIC, HorovodUnsupportedError


def __getattr__(name: str) -> NoReturn:
    if name.startswith("__"):  # the import machinery's probes (__path__, __file__...) stay ordinary misses
        raise AttributeError(name)
    raise HorovodUnsupportedError(ELASTIC)
