"""ddpkit.horovod against Horovod's documented semantics, on 3 real gloo ranks.

One job per all_reduce runs every check in turn (starting processes costs
more than the checks); both jobs, and the one-worker job, run side by side
in one fixture, forked from one warm worker server. Each test below reports
one check's result from every rank. ``auto`` is what ``hvd.init()`` picks on
one node (shared memory); ``builtin`` is gloo's own, what a job with one rank
per node gets.
"""

from __future__ import annotations

import contextlib
import copy
import time
import traceback
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from tests.helpers.module_runs import run_side_by_side, selected_params, selected_tests
from tests.helpers.workers import DYNAMO

pytestmark = pytest.mark.slow  # two jobs of 3 ranks and one of 1, side by side

WORLD_SIZE = 3
NUM_STEPS = 3


# -- collectives -------------------------------------------------------------------------------


def check_basics(hvd, rank: int, world_size: int) -> None:
    assert hvd.is_initialized()
    assert (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size()) == (rank, world_size, rank, world_size)
    assert (hvd.cross_rank(), hvd.cross_size(), hvd.is_homogeneous()) == (0, 1, True)
    assert hvd.gloo_built() and hvd.gloo_enabled()
    assert not hvd.mpi_built() and not hvd.mpi_enabled() and not hvd.mpi_threads_supported()
    assert hvd.nccl_built() == 0  # no CUDA here


def check_allreduce(hvd, rank: int, world_size: int) -> None:
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3) + rank
    original = x.clone()
    values = [torch.arange(6, dtype=torch.float32).reshape(2, 3) + r for r in range(world_size)]
    total = sum(values)
    assert torch.allclose(hvd.allreduce(x, name="x"), total / world_size)  # Average by default
    assert torch.equal(x, original)  # out of place
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum), total)
    assert torch.allclose(hvd.allreduce(x, average=False), total)  # the deprecated spelling
    assert torch.equal(hvd.allreduce(x, op=hvd.Min), torch.stack(values).amin(0))
    assert torch.equal(hvd.allreduce(x, op=hvd.Max), torch.stack(values).amax(0))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Product), torch.stack(values).prod(0))
    assert torch.allclose(hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25), total / 2)
    assert torch.allclose(hvd.allreduce(x, postscale_factor=3.0), total / world_size * 3)
    # Integers average by truncating division, as C and NCCL do: (0 + 5 + 10) // 3.
    assert torch.equal(
        hvd.allreduce(torch.tensor([5 * rank + 1]), name="int"),
        torch.tensor([sum(5 * r + 1 for r in range(world_size)) // world_size]),
    )
    y = x.clone()
    assert hvd.allreduce_(y, op=hvd.Sum) is y and torch.allclose(y, total)
    transposed = x.clone().t()  # not contiguous: reduced through a copy, written back
    hvd.allreduce_(transposed)
    assert torch.allclose(transposed, (total / world_size).t())
    with pytest.raises(ValueError, match="both op= and the deprecated average="):
        hvd.allreduce(x, average=True, op=hvd.Sum)


def check_async_handles(hvd, rank: int, world_size: int) -> None:
    x = torch.full((4,), float(rank))
    handles = [hvd.allreduce_async(x, name="a"), hvd.allreduce_async_(x.clone(), op=hvd.Sum, name="b")]
    deadline = time.monotonic() + 30
    while not all(hvd.poll(h) for h in handles):
        assert time.monotonic() < deadline, "allreduce handles never completed"
        time.sleep(0.001)
    mean, total = sum(range(world_size)) / world_size, float(sum(range(world_size)))
    assert torch.allclose(hvd.synchronize(handles[0]), torch.full((4,), mean))
    assert torch.allclose(hvd.synchronize(handles[1]), torch.full((4,), total))
    with pytest.raises(ValueError, match="already synchronized"):
        hvd.synchronize(handles[0])
    # Back to back, as gradients are queued: they may travel fused, and each still gets its own op and scaling.
    queued = [
        hvd.allreduce_async_(torch.full((3,), float(rank)), op=hvd.Sum),
        hvd.allreduce_async(torch.full((2, 2), float(rank)), prescale_factor=2.0),
        hvd.allreduce_async_(torch.tensor([rank, 1])),  # int64: another buffer
        hvd.allreduce_async_(torch.full((5,), float(rank)), postscale_factor=10.0),
        hvd.allreduce_async_(torch.full((1,), float(rank)), op=hvd.Max),  # another op: another buffer
    ]
    got = [hvd.synchronize(h) for h in queued]
    assert torch.equal(got[0], torch.full((3,), total))
    assert torch.allclose(got[1], torch.full((2, 2), 2 * mean))
    assert got[2].tolist() == [int(total) // world_size, 1]
    assert torch.allclose(got[3], torch.full((5,), 10 * mean))
    assert got[4].tolist() == [world_size - 1.0]


def check_allreduce_gradient(hvd, rank: int, world_size: int) -> None:
    w = torch.full((3,), float(rank + 1), requires_grad=True)
    hvd.allreduce(w * 2.0).sum().backward()  # d/dw of mean_r(2 w_r) summed on every rank: 2
    assert torch.allclose(w.grad, torch.full((3,), 2.0))


def check_fp16_compression(hvd, rank: int, world_size: int) -> None:
    x = torch.randn(100, generator=torch.Generator().manual_seed(rank))
    expected = sum(torch.randn(100, generator=torch.Generator().manual_seed(r)) for r in range(world_size)) / world_size
    got = hvd.allreduce(x, compression=hvd.Compression.fp16)
    assert got.dtype == torch.float32
    assert torch.allclose(got, expected, rtol=1e-3, atol=2e-3), (got - expected).abs().max()
    assert not torch.equal(got, hvd.allreduce(x))  # it did travel as float16


def check_allgather(hvd, rank: int, world_size: int) -> None:
    t = torch.full((rank + 1, 2), float(rank))  # first dimensions differ: rank r has r + 1 rows
    expected = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(world_size)])
    assert torch.equal(hvd.allgather(t, name="rows"), expected)
    assert torch.equal(hvd.synchronize(hvd.allgather_async(t)), expected)
    none_on_rank_0 = torch.full((rank, 1), rank, dtype=torch.int64)
    assert hvd.allgather(none_on_rank_0).view(-1).tolist() == [r for r in range(world_size) for _ in range(r)]
    w = torch.ones(rank + 1, 2, requires_grad=True)
    hvd.allgather(w * (rank + 1)).sum().backward()  # this rank's rows of the averaged gradient, times rank + 1
    assert torch.allclose(w.grad, torch.full((rank + 1, 2), float(rank + 1)))


def check_broadcast(hvd, rank: int, world_size: int) -> None:
    t = torch.full((2, 3), float(rank))
    assert torch.equal(hvd.broadcast(t, root_rank=1), torch.full((2, 3), 1.0))
    assert torch.equal(t, torch.full((2, 3), float(rank)))  # out of place
    assert hvd.broadcast_(t, root_rank=world_size - 1) is t and torch.equal(t, torch.full((2, 3), world_size - 1.0))
    strided = torch.full((3, 2), float(rank)).t()
    hvd.broadcast_(strided, root_rank=0)
    assert torch.equal(strided, torch.zeros(2, 3))
    handle = hvd.broadcast_async(torch.tensor([rank]), root_rank=2)
    assert hvd.synchronize(handle).tolist() == [2]
    with pytest.raises(ValueError, match="root_rank=7 is not a rank"):
        hvd.broadcast(t, root_rank=7)


def check_alltoall(hvd, rank: int, world_size: int) -> None:
    # Rank r sends d + 1 rows valued 100 r + d to each rank d.
    t = torch.cat([torch.full((d + 1, 2), float(100 * rank + d)) for d in range(world_size)])
    out, received = hvd.alltoall(t, splits=[d + 1 for d in range(world_size)])
    assert torch.equal(out, torch.cat([torch.full((rank + 1, 2), float(100 * s + rank)) for s in range(world_size)]))
    assert received.tolist() == [rank + 1] * world_size
    even = hvd.alltoall(torch.tensor([10 * rank + d for d in range(world_size)]))
    assert even.tolist() == [10 * s + rank for s in range(world_size)]
    with pytest.raises(ValueError, match="divides the first dimension"):
        hvd.alltoall(torch.zeros(world_size + 1))


def check_barrier_and_grouped(hvd, rank: int, world_size: int) -> None:
    hvd.barrier()
    a, b = torch.full((2,), float(rank)), torch.full((3, 1), float(rank))
    total = float(sum(range(world_size)))
    outs = hvd.grouped_allreduce([a, b], op=hvd.Sum)
    assert torch.equal(outs[0], torch.full((2,), total)) and torch.equal(outs[1], torch.full((3, 1), total))
    assert torch.equal(a, torch.full((2,), float(rank)))
    hvd.grouped_allreduce_([a, b])
    assert torch.allclose(b, torch.full((3, 1), total / world_size))


def check_objects(hvd, rank: int, world_size: int) -> None:
    assert hvd.broadcast_object({"rank": rank, "items": [rank] * 3}, root_rank=1) == {"rank": 1, "items": [1] * 3}
    assert hvd.allgather_object(("r",) * (rank + 1)) == [("r",) * (r + 1) for r in range(world_size)]


def check_mismatched_calls_fail_on_every_rank(hvd, rank: int, world_size: int) -> None:
    mismatch = "rank 0 called allreduce SUM of 3 .* while rank 1 called allreduce SUM of 4"
    with pytest.raises(RuntimeError, match=mismatch):
        hvd.allreduce(torch.zeros(3 if rank == 0 else 4))
    hvd.barrier()  # the failure left every rank in step


def check_broadcast_parameters(hvd, rank: int, world_size: int) -> None:
    torch.manual_seed(rank)
    model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))
    model[1].running_mean.fill_(rank)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    flat = torch.cat([t.reshape(-1).float() for t in model.state_dict().values()])
    gathered = hvd.allgather(flat[None])
    assert all(torch.equal(row, gathered[0]) for row in gathered)
    assert torch.equal(model[1].running_mean, torch.zeros(3))
    torch.manual_seed(10 + rank)
    model[0].reset_parameters()
    hvd.broadcast_parameters(model.named_parameters(), root_rank=2)
    torch.manual_seed(12)
    assert torch.equal(model[0].weight, nn.Linear(4, 3).weight)


def check_broadcast_optimizer_state(hvd, rank: int, world_size: int) -> None:
    makers: dict[str, Callable] = {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1 * (rank + 1), momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01 * (rank + 1)),
    }
    for name, make in makers.items():
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        optimizer = make(model.parameters())
        for step in range(rank + 1):  # states differ: each rank took a different number of steps
            g = torch.Generator().manual_seed(10 * rank + step)
            model(torch.randn(5, 4, generator=g)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        hvd.broadcast_optimizer_state(optimizer, root_rank=1)
        states = hvd.allgather_object(optimizer.state_dict())
        root = states[1]
        assert root["param_groups"][0]["lr"] == pytest.approx({"sgd": 0.2, "adam": 0.02}[name]), name
        for r, state in enumerate(states):
            assert state["param_groups"] == root["param_groups"], (name, r)
            for index, values in root["state"].items():
                for key, value in values.items():
                    assert torch.equal(torch.as_tensor(state["state"][index][key]), torch.as_tensor(value)), (
                        name,
                        r,
                        key,
                    )


# -- DistributedOptimizer --------------------------------------------------------------------


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 5, generator=g), torch.randn(6, 3, generator=g)


def _train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    rank: int,
    *,
    micro: int = 1,
    clip: float = 0.0,
    no_sync: Callable | None = None,
    synchronize: Callable | None = None,
) -> list[torch.Tensor]:
    """NUM_STEPS steps on this rank's batches, ``micro`` micro-batches each; the final parameters."""
    for step in range(NUM_STEPS):
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        for i, (xs, ys) in enumerate(zip(x.chunk(micro), y.chunk(micro))):
            last = i == micro - 1
            with no_sync() if no_sync is not None and not last else contextlib.nullcontext():
                (F.mse_loss(model(xs), ys) / micro).backward()
        if clip:
            if synchronize is not None:
                synchronize()  # Horovod's recipe: reduce first, clip, then step without synchronizing again
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


def _compare(got: list[torch.Tensor], want: list[torch.Tensor], label: str, atol: float = 1e-6) -> None:
    for i, (g, w) in enumerate(zip(got, want)):
        assert torch.allclose(g, w, rtol=1e-5, atol=atol), f"{label}: parameter {i} differs by {(g - w).abs().max()}"


def _ddp_reference(rank: int, make: Callable, **train_options) -> list[torch.Tensor]:
    torch.manual_seed(0)
    ddp = DDP(_Net())
    return _train(ddp, make(ddp.parameters()), rank, no_sync=ddp.no_sync, **train_options)


def check_distributed_optimizer_matches_ddp(hvd, rank: int, world_size: int) -> None:
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    adam = lambda ps: torch.optim.Adam(ps, lr=0.01)  # noqa: E731
    cases = {
        "sgd": (sgd, {}, {}),
        "adam": (adam, {}, {}),
        "predivide": (sgd, {"gradient_predivide_factor": 4.0}, {}),
        "groups=2": (sgd, {"groups": 2}, {}),
        "backward_passes_per_step=2": (sgd, {"backward_passes_per_step": 2}, {"micro": 2}),
    }
    for label, (make, options, train_options) in cases.items():
        want = _ddp_reference(rank, make, **train_options)
        torch.manual_seed(0)
        model = _Net()
        optimizer = hvd.DistributedOptimizer(
            make(model.parameters()), named_parameters=model.named_parameters(), **options
        )
        assert isinstance(optimizer, type(make([torch.zeros(1)]))), label
        _compare(_train(model, optimizer, rank, **train_options), want, label)
    assert set(optimizer.state_dict()) == {"state", "param_groups"}


def check_distributed_optimizer_sum_fp16_and_skip_synchronize(hvd, rank: int, world_size: int) -> None:
    # op=Sum with lr is op=Average with lr * size for plain SGD.
    want = _ddp_reference(rank, lambda ps: torch.optim.SGD(ps, lr=0.05 * world_size))
    torch.manual_seed(0)
    model = _Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), op=hvd.Sum)
    _compare(_train(model, optimizer, rank), want, "op=Sum")

    want = _ddp_reference(rank, lambda ps: torch.optim.SGD(ps, lr=0.1))
    torch.manual_seed(0)
    model = _Net()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
    )
    _compare(_train(model, optimizer, rank), want, "fp16", atol=1e-3)  # float16 carries ~3 digits

    want = _ddp_reference(rank, lambda ps: torch.optim.SGD(ps, lr=0.5), clip=0.05)
    torch.manual_seed(0)
    model = _Net()
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5))

    class SkipStep:
        def __getattr__(self, name: str):
            return getattr(optimizer, name)

        def step(self) -> None:
            with optimizer.skip_synchronize():
                optimizer.step()

    _compare(_train(model, SkipStep(), rank, clip=0.05, synchronize=optimizer.synchronize), want, "skip_synchronize")

    F.mse_loss(model(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
    with pytest.raises(ValueError, match=r"zero_grad\(\) was called after loss.backward\(\)"):
        optimizer.zero_grad()
    with pytest.raises(ValueError, match="more than backward_passes_per_step times"):
        F.mse_loss(model(_batch(rank, 0)[0]), _batch(rank, 0)[1]).backward()
    optimizer.step()


# -- join with uneven inputs -------------------------------------------------------------------


def _linear_grad(w: torch.Tensor, rank: int, step: int) -> torch.Tensor:
    w = w.clone().requires_grad_(True)
    x, y = _batch(rank, step)
    F.mse_loss(x @ w, y).backward()
    return w.grad


def check_join_with_uneven_inputs(hvd, rank: int, world_size: int) -> None:
    num_batches = [2 + r for r in range(world_size)]  # rank r has 2 + r batches
    torch.manual_seed(0)
    start = torch.randn(5, 3)
    w = nn.Parameter(start.clone())
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD([w], lr=0.1))
    for step in range(num_batches[rank]):
        optimizer.zero_grad()
        x, y = _batch(rank, step)
        F.mse_loss(x @ w, y).backward()
        optimizer.step()
        first, second = hvd.allreduce_async(torch.ones(2), op=hvd.Sum), hvd.allreduce_async(torch.ones(3))
        active = [r for r in range(world_size) if step < num_batches[r]]
        assert hvd.synchronize(first).tolist() == [float(len(active))] * 2  # a joined rank adds zeros
        assert torch.allclose(hvd.synchronize(second), torch.full((3,), len(active) / world_size))
        assert hvd.allgather(torch.tensor([rank])).tolist() == active, step  # joined ranks send no rows
    last = hvd.join()
    assert last == world_size - 1

    # The same steps by hand: a joined rank adds zeros, and Average still divides by every rank.
    expected = start.clone()
    for step in range(num_batches[rank]):
        grads = [_linear_grad(expected, r, step) for r in range(world_size) if step < num_batches[r]]
        expected -= 0.1 * sum(grads) / world_size
    assert torch.allclose(w.detach(), expected, rtol=1e-5, atol=1e-6), (w - expected).abs().max()
    assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == world_size  # after join, everyone is back
    assert hvd.join() == world_size - 1  # joined in the same round: the highest rank counts as last


CHECKS = {name: fn for name, fn in globals().items() if name.startswith("check_")}


def _run_checks(rank: int, world_size: int, allreduce: str) -> dict[str, str | None]:
    import ddpkit.horovod as hvd
    from ddpkit import distributed
    from ddpkit.comm.registry import builtin_all_reduce
    from ddpkit.horovod import engine

    hvd.init()  # on one node: the shared-memory all_reduce
    if allreduce == "builtin":  # what a job with one rank per node, or on CUDA, gets
        ctx = distributed.context()
        engine.stop()
        engine.start(
            engine.Engine(ctx.rank, ctx.world_size, ctx.device, distributed.control_device(), builtin_all_reduce)
        )
    results: dict[str, str | None] = {}
    try:
        for name, check in CHECKS.items():
            try:
                check(hvd, rank, world_size)
                results[name] = None
            except Exception:
                results[name] = traceback.format_exc()
    finally:
        hvd.shutdown()
    return results


@pytest.fixture(scope="module")
def jobs(request) -> dict:
    """Each selected job's outcome: the checks' results by rank for "auto" and "builtin", and "one worker"."""
    jobs = {
        allreduce: (_run_checks, WORLD_SIZE, (allreduce,), {})
        for allreduce in selected_params(request, "allreduce", "test_horovod_api")
    }
    if "test_one_worker_trains_as_plain_torch" in selected_tests(request):
        jobs["one worker"] = (_one_worker, 1, (), {"init_process_group": False})
    return run_side_by_side(jobs, DYNAMO, timeout=240)  # every rank builds optimizers and DDP models


@pytest.mark.parametrize("name", sorted(CHECKS))
@pytest.mark.parametrize("allreduce", ["auto", "builtin"])
def test_horovod_api(jobs, allreduce, name):
    results = jobs[allreduce].get()
    failures = [f"rank {r}:\n{result[name]}" for r, result in enumerate(results) if result[name]]
    assert not failures, "\n".join(failures)


def _one_worker(rank: int, world_size: int) -> dict:
    import ddpkit.horovod as hvd

    hvd.init()  # no launcher, no group: ddpkit.init forms a one-process group
    try:
        torch.manual_seed(0)
        model = _Net()
        plain = copy.deepcopy(model)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.Adam(model.parameters()), named_parameters=model.named_parameters()
        )
        got = _train(model, optimizer, 0)
        want = _train(plain, torch.optim.Adam(plain.parameters()), 0)
        return {
            "same": all(torch.equal(g, w) for g, w in zip(got, want)),
            "size": hvd.size(),
            "sum": hvd.allreduce(torch.ones(2), op=hvd.Sum).tolist(),
            "join": hvd.join(),
        }
    finally:
        hvd.shutdown()


def test_one_worker_trains_as_plain_torch(jobs):
    assert jobs["one worker"].get() == [{"same": True, "size": 1, "sum": [1.0, 1.0], "join": 0}]
