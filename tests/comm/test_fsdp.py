"""prepare_model(shard=True): FSDP2 follows DDP's loss curve on the same global batches.

Block choice is a pure function of the module tree (tested in this process);
training runs on 2 real gloo ranks: the same model from rank 0's weights,
trained through DDP and through FSDP2 on the same global batches, with
gradient accumulation (``ddpkit.no_sync``) and gradient clipping
(``clip_grad_norm_`` on DTensor parameters).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ddpkit.comm.fsdp import find_blocks, mixed_precision_policy, wants_sharding
from tests.helpers.module_runs import run_side_by_side, selected_tests

NUM_STEPS = 12
FP32_TOLERANCE = 1e-5
"""Largest difference between FSDP's and DDP's loss (about 5) at any step in float32 (observed: 4.8e-7, one
float32 ulp of the loss: the reduce_scatter and the all_reduce sum in different orders)."""
BF16_TOLERANCE = 1e-2
"""Largest relative difference of the loss with bf16 compute (fp32 reduction and optimizer) against fp32 DDP
(observed: 1.1e-3)."""


class Block(nn.Module):
    """A residual MLP block: the repeated unit FSDP shards one by one."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Tower(nn.Module):
    """An embedding-like input layer, three blocks, a head."""

    def __init__(self, width: int = 16, num_blocks: int = 3) -> None:
        super().__init__()
        self.inp = nn.Linear(10, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(num_blocks))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


# -- block choice: pure functions -------------------------------------------------------


def test_the_repeated_blocks_are_found_outermost_first() -> None:
    model = Tower()
    assert find_blocks(model) == list(model.blocks)  # not their Linears, LayerNorms: the outermost repeated class


def test_a_model_without_a_repeated_class_shards_its_repeated_layers() -> None:
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2), nn.LayerNorm(2))
    assert find_blocks(model) == [model[0], model[2]]  # Sequential is a container: walked into


def test_blocks_are_named_by_class_or_class_name() -> None:
    model = Tower()
    assert find_blocks(model, ["Block"]) == list(model.blocks)
    assert find_blocks(model, [nn.LayerNorm]) == [b.norm for b in model.blocks]
    with pytest.raises(ValueError, match="shard_blocks=Bogus matches no module of the model; its classes: Block"):
        find_blocks(model, ["Bogus"])


def test_shard_choices() -> None:
    model = Tower()
    assert wants_sharding(True, model, torch.device("cpu"), 1)
    assert not wants_sharding("false", model, torch.device("cpu"), 1)
    assert not wants_sharding("auto", model, torch.device("cpu"), 1)  # a few KiB: replicas fit
    with pytest.raises(ValueError, match="shard='maybe' is not valid; choose True, False or 'auto'"):
        wants_sharding("maybe", model, torch.device("cpu"), 1)
    assert mixed_precision_policy("bf16").param_dtype == torch.bfloat16
    assert mixed_precision_policy("bf16").reduce_dtype == torch.float32
    with pytest.raises(ValueError, match="mixed_precision='int8' is not valid"):
        mixed_precision_policy("int8")


# -- 2 ranks: FSDP against DDP ----------------------------------------------------------


def _curve(model: nn.Module, rank: int, world_size: int, no_sync, clip: bool) -> list[float]:
    """The global loss of each step: AdamW, global batch 16 of fixed data, two micro-batches, clipping."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for step in range(NUM_STEPS):
        g = torch.Generator().manual_seed(100 + step)
        x = torch.randn(16, 10, generator=g)
        y = x[:, :4] * 2 - x[:, 4:8]  # a function to learn: the loss falls
        mine = slice(rank * 16 // world_size, (rank + 1) * 16 // world_size)
        total = torch.zeros(())
        micro = list(zip(x[mine].chunk(2), y[mine].chunk(2)))
        for i, (xs, ys) in enumerate(micro):
            with no_sync() if i < len(micro) - 1 else contextlib.nullcontext():
                loss = F.mse_loss(model(xs).float(), ys) / len(micro)
                loss.backward()
            total += loss.detach()
        if clip:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            assert float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm) > 0
        optimizer.step()
        optimizer.zero_grad()
        dist.all_reduce(total)
        losses.append(float(total) / world_size)
    return losses


def _fsdp_against_ddp(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import FSDPModule

    import ddpkit.distributed
    from ddpkit.prepare import no_sync, prepare_model, unwrap_model

    ddpkit.distributed.init()
    try:
        curves: dict[str, list[float]] = {}
        finals: dict[str, list[torch.Tensor]] = {}
        for name, options in {
            "ddp": {"grad_sync": "ddp"},
            "fsdp": {"shard": True},
            "fsdp_keep": {"shard": True, "reshard_after_forward": False},
            "fsdp_bf16": {"shard": True, "mixed_precision": "bf16"},
        }.items():
            torch.manual_seed(rank)  # different weights on every rank: rank 0's must win
            net = Tower()
            model = prepare_model(net, **options)
            if name.startswith("fsdp"):
                assert isinstance(model, FSDPModule) and model is net and unwrap_model(model) is net
                assert all(isinstance(b, FSDPModule) for b in net.blocks)
                with pytest.raises(ValueError, match="already prepared"):
                    prepare_model(model, shard=True)
            curves[name] = _curve(model, rank, world_size, lambda m=model: no_sync(m), clip=True)
            finals[name] = [
                (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone() for p in model.parameters()
            ]
        return {"curves": curves, "finals": finals}
    finally:
        ddpkit.distributed.shutdown()


class Scaled(nn.Module):
    """A learned scale: a parameter of its own and no reset_parameters() to initialise it."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def _built_on_meta(rank: int, world_size: int) -> dict:
    """The same Tower prepared sharded three ways: built by every rank; by rank 0 only (the others on the meta
    device); on the meta device everywhere. Then a model with a module that cannot be initialised."""
    import ddpkit.distributed
    from ddpkit.prepare import no_sync, prepare_model

    ddpkit.distributed.init()
    try:
        out: dict = {}
        for name, meta_ranks in {"real": (), "meta_elsewhere": (1,), "all_meta": (0, 1)}.items():
            torch.manual_seed(0)
            with torch.device("meta") if rank in meta_ranks else contextlib.nullcontext():
                net = Tower()
            model = prepare_model(net, shard=True)
            out[name] = {
                "first": [p.full_tensor().detach().clone() for p in model.parameters()],
                "curve": _curve(model, rank, world_size, lambda m=model: no_sync(m), clip=True),
            }
        with torch.device("meta"):
            scaled = nn.Sequential(Tower(), Scaled())
        try:
            prepare_model(scaled, shard=True)
        except ValueError as e:
            out["error"] = str(e)
        return out
    finally:
        ddpkit.distributed.shutdown()


@pytest.fixture(scope="module")
def runs(request):
    jobs = {}
    if selected_tests(request) & {"test_fsdp_follows_ddp", "test_bf16_follows_fp32"}:
        jobs["two"] = (_fsdp_against_ddp, 2, (), {})
    if "test_a_model_built_on_the_meta_device_is_sharded_from_rank_0s_weights" in selected_tests(request):
        jobs["meta"] = (_built_on_meta, 2, (), {})
    return run_side_by_side(jobs, timeout=240)


def test_a_model_built_on_the_meta_device_is_sharded_from_rank_0s_weights(runs) -> None:
    """Rank 0 holds the weights, the others build on the meta device (no memory): the same shards, the same
    training, bit for bit. On the meta device everywhere: each module's reset_parameters(), once, on rank 0."""
    results = runs["meta"].get()
    for result in results:
        real, elsewhere, everywhere = result["real"], result["meta_elsewhere"], result["all_meta"]
        assert all(torch.equal(a, b) for a, b in zip(real["first"], elsewhere["first"]))
        assert real["curve"] == elsewhere["curve"]
        weight = everywhere["first"][4]  # blocks[0].mlp[0].weight, 32 x 16: each rank holds half its rows
        assert weight.shape == (32, 16) and torch.isfinite(weight).all()
        assert not torch.equal(weight[:16], weight[16:])  # one initialisation, sharded: not a copy per shard
        assert everywhere["curve"][-1] < everywhere["curve"][0]  # it trains
        assert result["error"] == (
            "Scaled of the model is on the meta device on rank 0 and has no reset_parameters() to initialise it; "
            "build the model with its weights on rank 0 (the other ranks may use the meta device) or give the "
            "module a reset_parameters()"
        )
    assert torch.equal(results[0]["all_meta"]["first"][4], results[1]["all_meta"]["first"][4])


def test_fsdp_follows_ddp(runs) -> None:
    results = runs["two"].get()
    for rank, result in enumerate(results):
        ddp = result["curves"]["ddp"]
        for name in ("fsdp", "fsdp_keep"):
            got = result["curves"][name]
            assert max(abs(a - b) for a, b in zip(got, ddp)) <= FP32_TOLERANCE, (rank, name, got, ddp)
            for p, q in zip(result["finals"][name], result["finals"]["ddp"]):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
        assert ddp[-1] < ddp[0]  # it trains
    assert results[0]["curves"] == results[1]["curves"]  # every rank sees the same global losses


def test_bf16_follows_fp32(runs) -> None:
    result = runs["two"].get()[0]
    ddp, bf16 = result["curves"]["ddp"], result["curves"]["fsdp_bf16"]
    assert max(abs(a - b) / abs(b) for a, b in zip(bf16, ddp)) <= BF16_TOLERANCE, (bf16, ddp)
    assert all(p.dtype == torch.float32 for p in result["finals"]["fsdp_bf16"])  # fp32 master weights
