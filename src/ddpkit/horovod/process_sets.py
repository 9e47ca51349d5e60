"""Process sets: the global one only (every rank), as ``hvd.global_process_set``."""

from __future__ import annotations

from ddpkit.horovod import ranks
from ddpkit.horovod.unsupported import PROCESS_SETS, HorovodUnsupportedError


class ProcessSet:
    """A set of ranks that runs collectives together; ddpkit.horovod has only the global one.

    Args:
        ranks: the ranks of the set; only None (every rank) is supported.

    Raises:
        HorovodUnsupportedError: ``ranks`` names a subset.
    """

    def __init__(self, ranks: list[int] | None = None) -> None:
        if ranks is not None:
            raise HorovodUnsupportedError(PROCESS_SETS)
        self.process_set_id = 0
        self.ranks = None

    def size(self) -> int:
        """Number of ranks in the set: every rank."""
        return ranks.size()

    def rank(self) -> int:
        """This process's rank in the set: its global rank."""
        return ranks.rank()

    def included(self) -> bool:
        """Whether this process belongs to the set: always."""
        return True

    def __repr__(self) -> str:
        return "ProcessSet(global)"


global_process_set = ProcessSet()
"""Every rank of the job: the only process set ddpkit.horovod supports."""


def check(process_set: object) -> None:
    """Raise unless ``process_set`` is the global process set.

    Raises:
        HorovodUnsupportedError: any other process set.
    """
    if process_set is not global_process_set:
        raise HorovodUnsupportedError(PROCESS_SETS)


def add_process_set(process_set: object) -> None:
    """Horovod's dynamic process sets: not supported.

    Raises:
        HorovodUnsupportedError: always.
    """
    raise HorovodUnsupportedError(PROCESS_SETS)


def remove_process_set(process_set: object) -> None:
    """Horovod's dynamic process sets: not supported.

    Raises:
        HorovodUnsupportedError: always.
    """
    raise HorovodUnsupportedError(PROCESS_SETS)
