"""GPU steps of a known length, for the benchmarks and tests that time what overlaps them.

``torch.cuda._sleep(cycles)`` spins a kernel for a number of GPU clock
cycles; :func:`cycles_per_ms` measures the clock once, so that
``torch.cuda._sleep(int(ms * rate))`` lasts ``ms`` milliseconds.
"""

from __future__ import annotations

import torch

__all__ = ["cycles_per_ms"]


def cycles_per_ms() -> float:
    """GPU clock cycles per millisecond of the current device, measured with ``torch.cuda._sleep``."""
    torch.cuda._sleep(100_000_000)  # an idle GPU clocks down: raise its clock before measuring it
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    elapsed_ms: float = start.elapsed_time(end)
    return 10_000_000 / elapsed_ms
