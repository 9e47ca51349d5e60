"""DDP communication hooks, flat gradients and the manual gradient loop, on real gloo ranks."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ddpkit.comm import broadcast_parameters, manual_gradient_sync, register_allreduce_hook, resolve_allreduce
from ddpkit.comm.flat_grads import FlatGradients
from tests.helpers.workers import DYNAMO, run_on_ranks, warm_workers

ALGORITHMS = ["builtin", "naive", "ring", "butterfly", "tree"]


def _model() -> nn.Module:
    torch.manual_seed(0)  # identical initial weights on every rank
    return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))


def _grads_after_steps(model: nn.Module, rank: int, num_steps: int = 2) -> list[list[torch.Tensor]]:
    """Gradients after each of ``num_steps`` backward passes on rank-specific data."""
    grads = []
    for step in range(num_steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        model.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(x), y).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    return grads


def _hooks_match_stock_ddp(rank: int, world_size: int) -> list[str]:
    base = _model()
    # Stock DDP: gloo's all_reduce, averaged by DDP itself.
    expected = _grads_after_steps(DDP(copy.deepcopy(base)), rank)
    failures = []
    for name in ALGORITHMS:
        # A tiny bucket cap gives one bucket per parameter after the first step:
        # several hook calls in flight on the hook's thread, in DDP's order.
        model = DDP(copy.deepcopy(base), bucket_cap_mb=1e-5)
        register_allreduce_hook(model, resolve_allreduce(name))
        got = _grads_after_steps(model, rank)
        for step, (g_step, e_step) in enumerate(zip(got, expected)):
            for i, (g, e) in enumerate(zip(g_step, e_step)):
                if not torch.allclose(g, e, rtol=1e-5, atol=1e-6):
                    failures.append(f"hook {name}: step {step} parameter {i} differs by {(g - e).abs().max():.3g}")
        # The textbook loop on the plain model must give the same gradients,
        # starting from rank 0's weights like DDP.
        plain = copy.deepcopy(base)
        if rank != 0:
            with torch.no_grad():
                for p in plain.parameters():
                    p.add_(1.0)
        broadcast_parameters(plain)
        for step in range(2):
            g = torch.Generator().manual_seed(100 * step + rank)
            x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
            plain.zero_grad(set_to_none=True)
            nn.functional.mse_loss(plain(x), y).backward()
            manual_gradient_sync(plain, resolve_allreduce(name), world_size)
            for i, (p, e) in enumerate(zip(plain.parameters(), expected[step])):
                if not torch.allclose(p.grad, e, rtol=1e-5, atol=1e-6):
                    diff = (p.grad - e).abs().max()
                    failures.append(f"manual {name}: step {step} parameter {i} differs by {diff:.3g}")
    for name in [*ALGORITHMS, "shm"]:
        failures += _flat_gradient_failures(base, rank, name, expected)
    return failures


def _flat_gradient_failures(base: nn.Module, rank: int, name: str, expected) -> list[str]:
    """FlatGradients on the plain model gives stock DDP's gradients, and keeps them as views of its buffer."""
    plain = copy.deepcopy(base)
    sync = FlatGradients(plain, resolve_allreduce(name))
    failures = []
    for step in range(2):
        g = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
        sync.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        sync.all_reduce()
        for i, (p, e) in enumerate(zip(plain.parameters(), expected[step])):
            if not torch.allclose(p.grad, e, rtol=1e-5, atol=1e-6):
                failures.append(f"flat {name}: step {step} parameter {i} differs by {(p.grad - e).abs().max():.3g}")
            if p.grad.untyped_storage().data_ptr() != sync.buffers[0].untyped_storage().data_ptr():
                failures.append(f"flat {name}: parameter {i}'s gradient left the flat buffer")
    return failures


def _failing_all_reduce(tensor, op=dist.ReduceOp.SUM, group=None):
    raise ValueError("all_reduce exploded on purpose")


def _hook_error_reaches_backward(rank: int, world_size: int) -> str:
    model = DDP(_model())
    register_allreduce_hook(model, _failing_all_reduce)
    try:
        model(torch.randn(2, 6)).sum().backward()
    except Exception as e:  # DDP wraps the hook's exception in a RuntimeError
        return str(e)
    return "no error"


def _dropped_flat_gradient_is_refused(rank: int, world_size: int) -> str:
    model = _model()
    sync = FlatGradients(model, resolve_allreduce("builtin"))
    model.zero_grad(set_to_none=True)  # drops the views: this step's gradients would not be averaged
    model(torch.randn(2, 6)).sum().backward()
    try:
        sync.all_reduce()
    except RuntimeError as e:
        return str(e)
    return "no error"


def _hooks_worker(rank: int, world_size: int) -> tuple[list[str], str, str]:
    # One spawn for all checks: building the first DDP model costs seconds.
    return (
        _hooks_match_stock_ddp(rank, world_size),
        _hook_error_reaches_backward(rank, world_size),
        _dropped_flat_gradient_is_refused(rank, world_size),
    )


def test_hooks_flat_and_manual_sync_give_stock_ddp_gradients_and_surface_errors():
    with warm_workers(DYNAMO):  # both ranks build DDP models: torch._dynamo imported once, in the server
        results = run_on_ranks(_hooks_worker, 2, timeout=180)
    failures = [f for fs, _, _ in results for f in fs]
    assert not failures, "\n".join(failures)
    # A failing all_reduce on the hook's thread reaches backward() on the training thread.
    messages = [message for _, message, _ in results]
    assert all("all_reduce exploded on purpose" in m for m in messages), messages
    # Gradients that left the flat buffer are refused, not silently left unaveraged.
    refusals = [refusal for _, _, refusal in results]
    assert all("FlatGradients.zero_grad()" in r for r in refusals), refusals


def _two_models_one_backward(rank: int, world_size: int) -> list[str]:
    # A GAN's generator step: one backward through two DDP models, each with its own hook and one
    # bucket per parameter; the ring's send/recv of one model's bucket must never meet the other's.
    torch.manual_seed(0)
    first = DDP(nn.Sequential(nn.Linear(6, 300), nn.ReLU(), nn.Linear(300, 5)), bucket_cap_mb=1e-5)
    second = DDP(nn.Sequential(nn.Linear(5, 200), nn.ReLU(), nn.Linear(200, 1)), bucket_cap_mb=1e-5)
    for model in (first, second):
        register_allreduce_hook(model, resolve_allreduce("ring"))
    return _steps_with_equal_gradients(first, second, rank)


def test_two_ddp_models_with_hooks_reduce_in_one_order_on_every_rank():
    with warm_workers(DYNAMO):
        results = run_on_ranks(_two_models_one_backward, 2, timeout=120)
    assert results == [[], []]


def _ddp_and_flat_in_one_backward(rank: int, world_size: int) -> list[str]:
    # grad_sync=auto may put a large model on DDP (a hook thread) and a small one on flat (the end of
    # backward, on the training thread): the flat reduction must wait for the hook's buckets, not cross them.
    from ddpkit.comm.grad_sync import GradientSync
    from ddpkit.distributed import Context
    from ddpkit.env.base import JobEnvironment

    env = JobEnvironment("test", rank, rank, world_size, world_size, 0, 1, "127.0.0.1", 1)
    ctx = Context(env, torch.device("cpu"), "gloo")
    torch.manual_seed(0)
    big = DDP(nn.Sequential(nn.Linear(6, 400), nn.ReLU(), nn.Linear(400, 5)), bucket_cap_mb=1e-5)
    register_allreduce_hook(big, resolve_allreduce("ring"))
    small = nn.Sequential(nn.Linear(5, 300), nn.ReLU(), nn.Linear(300, 1))
    GradientSync(small, ctx, "ring", "flat")
    return _steps_with_equal_gradients(big, small, rank)


def test_a_flat_model_and_a_ddp_model_with_a_hook_reduce_in_one_order_on_every_rank():
    with warm_workers(DYNAMO):
        results = run_on_ranks(_ddp_and_flat_in_one_backward, 2, timeout=120)
    assert results == [[], []]


def _steps_with_equal_gradients(first: nn.Module, second: nn.Module, rank: int) -> list[str]:
    """30 backwards through ``second(first(x))`` on rank-own inputs; the steps whose averaged gradients differ
    from rank 0's."""
    failures = []
    for step in range(30):
        g = torch.Generator().manual_seed(100 * step + rank)
        first.zero_grad()
        second.zero_grad()
        second(first(torch.randn(4, 6, generator=g))).sum().backward()
        grads = torch.cat([p.grad.reshape(-1) for m in (first, second) for p in m.parameters()])
        mine = grads.clone()
        dist.broadcast(grads, 0)
        if not torch.equal(mine, grads):
            failures.append(f"step {step}: rank {rank}'s averaged gradients differ from rank 0's")
    return failures
