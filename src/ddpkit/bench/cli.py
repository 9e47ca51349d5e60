"""``ddpkit bench KIND``: dispatch to the benchmark of that kind."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

# Each kind's module has ``main(words) -> int``.
KINDS = {"train": "ddpkit.bench.train", "comm": "ddpkit.bench.comm", "scaling": "ddpkit.bench.scaling",
         "startup": "ddpkit.bench.startup"}


def bench_command(args: Sequence[str]) -> int:
    """Run ``ddpkit bench KIND [key=value ...]``."""
    if not args or args[0] not in KINDS:
        given = repr(args[0]) if args else "nothing"
        raise ValueError(f"ddpkit bench needs a kind, got {given}; choose one of: {', '.join(KINDS)}")
    try:
        module = importlib.import_module(KINDS[args[0]])
    except ModuleNotFoundError:
        raise ValueError(f"benchmark {args[0]!r} is not available in this version; choose one of: train") from None
    return module.main(list(args[1:]))
