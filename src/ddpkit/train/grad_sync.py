"""Kept until the trainer moves to ddpkit.prepare_model: the old name of :mod:`ddpkit.comm.grad_sync`."""

from ddpkit.comm.grad_sync import GradientSync, choose_allreduce, choose_grad_sync  # noqa: F401
