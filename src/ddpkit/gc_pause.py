"""Importing torch without Python's garbage collector walking it again and again.

torch and ``torch._dynamo`` (which torch's optimizers import on first use)
leave about 300,000 Python objects that live as long as the process. While
they are being created, CPython runs a full collection each time the
objects that survived earlier collections have grown by a quarter, and each
full collection walks all of them: importing ``torch._dynamo`` on top of
torch spends about a quarter of its time there (0.5 s on a 2-core VM), and
frees nothing that matters, since modules live until the process exits.
:func:`collection_paused` keeps automatic collection off for such a block;
the garbage it would have found is collected by the first run after it.

A process that forks workers follows the standard library's recipe (see
``gc.freeze``): collection off in the parent from the start, and in each
child, first thing, the inherited objects frozen (no collection ever walks
them, so none of their pages is copied) and collection on again. ddpkit's
worker server does the first half (:mod:`ddpkit.launchers.server`), its workers
the second (:func:`enable_in_forked_worker`).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
from collections.abc import Iterator


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Keep automatic garbage collection off in the block; restore it after, if it was on."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def import_paused(*names: str) -> None:
    """Import the modules ``names`` (dotted) with automatic collection paused: a no-op for those imported already."""
    with collection_paused():
        for name in names:
            importlib.import_module(name)


def enable_in_forked_worker() -> None:
    """In a process forked from one that never collects: freeze what it inherited, then collect as usual."""
    gc.freeze()
    gc.enable()
