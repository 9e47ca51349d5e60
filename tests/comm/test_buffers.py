"""Rank 0's buffers before each forward with grad_sync flat and manual, on real gloo ranks."""

from __future__ import annotations

import functools

import torch
from torch import nn

from ddpkit.comm.buffers import broadcast_buffers
from ddpkit.comm.grad_sync import GradientSync
from ddpkit.distributed import Context
from ddpkit.env.base import JobEnvironment
from tests.helpers.workers import run_on_ranks


class Masked(nn.Module):
    """Buffers of four dtypes, one of them a non-contiguous view's base, and a BatchNorm."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(3)
        self.register_buffer("mask", torch.tensor([True, False, rank == 0]))
        self.register_buffer("scale", torch.full((2, 2), 1.0 + rank, dtype=torch.float64).t())
        self.register_buffer("code", torch.tensor([7 + rank], dtype=torch.int16))
        self.linear = nn.Linear(3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(self.norm(x) * self.mask)


def _broadcast(rank: int, world_size: int) -> list[list[torch.Tensor]]:
    model = Masked(rank)
    model.norm(torch.randn(4, 3) + rank)  # running statistics of this rank's own batch
    broadcast_buffers(model)
    return [b.clone() for b in model.buffers()]


def test_broadcast_buffers_gives_rank_zeros_buffers_of_every_dtype():
    results = run_on_ranks(_broadcast, 2, timeout=120)
    for got, want in zip(results[1], results[0]):
        assert got.dtype == want.dtype and torch.equal(got, want)


def _context(rank: int, world_size: int) -> Context:
    env = JobEnvironment("test", rank, rank, world_size, world_size, 0, 1, "127.0.0.1", 1)
    return Context(env, torch.device("cpu"), "gloo")


def _record_buffers(starts: list, module: nn.Module, args: object) -> None:
    starts.append([b.clone() for b in module.buffers()])


def _flat_training(rank: int, world_size: int) -> dict:
    seen: dict = {}
    for mode in ("flat", "manual"):
        torch.manual_seed(rank)
        bn = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1))
        GradientSync(bn, _context(rank, world_size), "builtin", mode)
        starts: list[list[torch.Tensor]] = []
        # Registered after GradientSync's: sees the buffers each forward starts from.
        bn.register_forward_pre_hook(functools.partial(_record_buffers, starts))
        for _ in range(3):
            bn(torch.randn(8, 3) * (1 + rank) + rank).sum().backward()
        with torch.no_grad():
            bn(torch.randn(8, 3) + rank)  # evaluation: no broadcast, each rank's own statistics (as DDP)
        seen[mode] = starts
        mlp = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        GradientSync(mlp, _context(rank, world_size), "builtin", mode)
        seen[f"{mode} hooks without buffers"] = len(mlp._forward_pre_hooks)
    return seen


def test_flat_and_manual_broadcast_buffers_before_forward_and_a_model_without_buffers_pays_nothing():
    ranks = run_on_ranks(_flat_training, 2, timeout=120)
    for mode in ("flat", "manual"):
        assert ranks[0][f"{mode} hooks without buffers"] == 0
        *training, evaluation = zip(ranks[0][mode], ranks[1][mode])
        for step, (zeros, ones) in enumerate(training):
            assert all(torch.equal(a, b) for a, b in zip(zeros, ones)), (mode, step)
        assert not torch.equal(evaluation[0][0], evaluation[1][0]), mode  # running_mean: each rank's own
