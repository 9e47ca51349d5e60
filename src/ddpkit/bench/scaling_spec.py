"""The parts a step of ``ddpkit bench scaling`` is split into.

Read by the benchmark (:mod:`ddpkit.bench.scaling`) and by its report
(:mod:`ddpkit.bench.scaling_report`), which import this module and not each
other.
"""

PARTS = ("data", "forward", "backward", "optimizer", "exposed_comm")
"""The parts a step is split into, in order."""
