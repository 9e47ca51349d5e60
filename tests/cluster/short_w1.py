"""A short run of W1 for the tests that train it under a cluster launcher.

The launcher is what those tests exercise (its variables, the rendezvous,
the run folder), not the workload's final quality, which
tests/launchers/test_local.py holds W1 to after its 5 epochs. A short run still
trains on the real Fashion-MNIST files, on every worker of the job, long
enough to show that it learns: W1's first 150 steps (global batches of 64,
seed 0) end at 77.1% test accuracy, the same for any number of workers, as
the global batches do not depend on it.
"""

W1_SHORT = ("max_steps=150",)
"""Words of ``ddpkit train`` that stop W1 after its first 150 optimizer steps (with a checkpoint)."""

W1_SHORT_STEPS = 150

W1_SHORT_ACCURACY_FLOOR = 0.70
"""Lowest test accuracy (fraction) a test accepts after W1_SHORT: far above chance (10%), below the 77.1% measured."""
