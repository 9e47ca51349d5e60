"""Every collective ddpkit issues gets a tensor on a device its process group takes.

Small control messages (metric sums, the checkpoint agreement, the all_reduce
choice, the doctor's and the benchmarks' bookkeeping) go on
``ddpkit.distributed.control_device()``: the CPU for gloo, the current GPU for
nccl, which takes CUDA tensors only. Data stays on the data's device. A CPU
machine has gloo alone, where both are the CPU, so:

- with ``control_device`` patched to answer ``meta`` (a device no real
  collective takes), each control path must hand its collective a meta
  tensor; a path that builds its tensor anywhere else (the regression: a CPU
  tensor whatever the backend, which nccl refuses) shows up with the device it used;
- on real gloo ranks, with torch.distributed's collectives wrapped, every
  control message is on ``control_device()``, every data message on the
  worker's device, and the reduction paths go through the group also with one
  worker, as a single-GPU nccl run needs them to.

tests/gpu runs the same paths on nccl for real.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.helpers.workers import run_on_ranks

TENSOR_COLLECTIVES = (
    "all_reduce",
    "broadcast",
    "reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "reduce_scatter_single",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "isend",
    "irecv",
)
"""torch.distributed's functions that take tensors (those a torch version lacks are skipped)."""


class Handed(Exception):
    """Raised by a stopping wrapper instead of running the collective: what it was handed."""

    def __init__(self, name: str, devices: list[str]):
        super().__init__(f"{name} on {devices}")
        self.name, self.devices = name, devices


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


@contextlib.contextmanager
def record_collectives(
    call_through: bool = True, check: Callable[[str, list[str]], None] | None = None
) -> Iterator[list[tuple[str, list[str]]]]:
    """Wrap torch.distributed's tensor collectives; yield the list of ``(name, [device, ...])`` of each call.

    Args:
        call_through: run the real collective after recording it; False raises
            :class:`Handed` instead, before anything is sent.
        check: called with each call's name and devices before the real
            collective runs (to fail with a message rather than inside the backend).
    """
    calls: list[tuple[str, list[str]]] = []
    originals = {name: getattr(dist, name) for name in TENSOR_COLLECTIVES if hasattr(dist, name)}

    def wrap(name: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def recording(*args: Any, **kwargs: Any) -> Any:
            devices = [str(t.device) for t in _tensors([*args, *kwargs.values()])]
            calls.append((name, devices))
            if check is not None:
                check(name, devices)
            if not call_through:
                raise Handed(name, devices)
            return real(*args, **kwargs)

        return recording

    for name, real in originals.items():
        setattr(dist, name, wrap(name, real))
    try:
        yield calls
    finally:
        for name, real in originals.items():
            setattr(dist, name, real)


# -- control_device patched to "meta": each control path follows it ----------------------------


def _patch_control_device(monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    """Make ``control_device`` answer ``device`` everywhere ddpkit imported it."""
    import ddpkit.bench.comm  # noqa: F401  (imported so that their names are patched too)
    import ddpkit.checkpoint.manager.checkpointer  # noqa: F401
    import ddpkit.comm.grad_sync  # noqa: F401
    import ddpkit.distributed
    import ddpkit.doctor.checks  # noqa: F401
    import ddpkit.reduce  # noqa: F401

    real = ddpkit.distributed.control_device
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "ddpkit" and vars(module).get("control_device") is real:
            monkeypatch.setattr(module, "control_device", lambda group=None: torch.device(device))


def _gloo_context() -> Any:
    """A worker's context on the CPU over gloo: rank 0 of 2 on one node."""
    from ddpkit.distributed import Context
    from ddpkit.env.base import JobEnvironment

    env = JobEnvironment("local", 0, 0, 2, 2, 0, 1, "127.0.0.1", 29500)
    return Context(env, torch.device("cpu"), "gloo")


def _reduce_sums(tmp_path, monkeypatch) -> None:
    from ddpkit.reduce import reduce_sums

    reduce_sums({"loss": 1.5, "count": torch.tensor(3)})


def _checkpoint_agreement(tmp_path, monkeypatch) -> None:
    from ddpkit.checkpoint.manager.checkpointer import Checkpointer

    # Two ranks as far as the Checkpointer knows, so that its agreement (skipped for one) runs.
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    checkpointer = Checkpointer(tmp_path, model=nn.Linear(2, 2), sync_seconds=1e-6)
    try:
        checkpointer.step()  # the first step is always agreed on
    finally:
        checkpointer.close()


def _allreduce_choice(tmp_path, monkeypatch) -> None:
    from ddpkit.comm.grad_sync import choose_allreduce

    choose_allreduce("auto", _gloo_context())  # CPU, one node, 2 ranks: the ranks agree on shm


def _doctor_sanity(tmp_path, monkeypatch) -> None:
    from ddpkit.doctor.checks import sanity_all_reduce

    sanity_all_reduce(_gloo_context(), 1.0)


def _doctor_latency(tmp_path, monkeypatch) -> None:
    from ddpkit.doctor.measure import allreduce_latency

    allreduce_latency(_gloo_context(), 1)


def _bench_comm_batch_size(tmp_path, monkeypatch) -> None:
    from ddpkit.bench.comm import _max_over_ranks

    _max_over_ranks(1.0)


def _bench_comm_samples(tmp_path, monkeypatch) -> None:
    from ddpkit.bench.comm import _slowest_rank

    _slowest_rank([1.0, 2.0])


CONTROL_PATHS = [
    _reduce_sums,
    _checkpoint_agreement,
    _allreduce_choice,
    _doctor_sanity,
    _doctor_latency,
    _bench_comm_batch_size,
    _bench_comm_samples,
]


@pytest.fixture
def gloo_world_of_one():
    """A real one-rank gloo group in this process, destroyed afterwards."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("path", CONTROL_PATHS, ids=lambda path: path.__name__.lstrip("_"))
def test_control_messages_follow_control_device(path, tmp_path, monkeypatch, gloo_world_of_one):
    _patch_control_device(monkeypatch, "meta")
    with record_collectives(call_through=False), pytest.raises(Handed) as handed:
        path(tmp_path, monkeypatch)
    devices = handed.value.devices
    assert devices and set(devices) == {"meta"}, f"{handed.value.name} was handed tensors on {devices}, not meta"


def test_a_path_that_ignores_control_device_shows_up(monkeypatch, gloo_world_of_one):
    """The check above is not vacuous: a tensor built without control_device is seen on its own device."""
    _patch_control_device(monkeypatch, "meta")
    with record_collectives(call_through=False), pytest.raises(Handed) as handed:
        dist.all_reduce(torch.zeros(1))
    assert handed.value.devices == ["cpu"]


def test_shared_memory_all_reduces_refuse_other_devices_in_one_line():
    """Checked before any setup (no process group here): the message names the fix."""
    from ddpkit.comm import hierarchical, shm

    meta = torch.zeros(4, device="meta")
    with pytest.raises(
        ValueError,
        match=r"^ddpkit.comm.shm.all_reduce takes CPU tensors, got one on meta; "
        r"use allreduce=builtin .* for CUDA tensors$",
    ):
        shm.all_reduce(meta)
    with pytest.raises(
        ValueError,
        match=r"^ddpkit.comm.hierarchical.all_reduce takes CPU tensors, got one on meta; "
        r"use allreduce=builtin .* for CUDA tensors$",
    ):
        hierarchical.all_reduce(meta)


def test_allreduce_auto_picks_the_builtin_for_cuda_tensors():
    """No agreement needed: the shared-memory all_reduces take CPU tensors only."""
    from ddpkit.comm.grad_sync import choose_allreduce
    from ddpkit.distributed import Context

    on_gpu = Context(_gloo_context().env, torch.device("cuda", 0), "nccl")  # one node, 2 ranks: shm on the CPU
    with record_collectives(call_through=False):
        assert choose_allreduce("auto", on_gpu) == "builtin"


def test_bench_comm_on_cuda_leaves_the_shared_memory_algorithms_out():
    from ddpkit.bench.comm import CommBenchConfig, plan_algorithms
    from ddpkit.keyvalue import ConfigError

    plan, skipped = plan_algorithms(CommBenchConfig(ops=["all_reduce", "broadcast"], device="cuda"), num_nodes=1)
    assert "shm" not in plan["all_reduce"] and "hierarchical" not in plan["all_reduce"]
    assert plan["all_reduce"][0] == "builtin" and "ring" in plan["all_reduce"]
    assert skipped["all_reduce/shm"] == skipped["all_reduce/hierarchical"] == "takes CPU tensors (device=cuda)"
    with pytest.raises(ValueError, match="algorithms: shm takes CPU tensors but device=cuda; leave shm out"):
        plan_algorithms(CommBenchConfig(ops=["all_reduce"], algorithms=["builtin", "shm"], device="cuda"), 1)
    with pytest.raises(ConfigError, match="device='tpu' is not valid; choose one of: cpu, cuda"):
        CommBenchConfig(device="tpu")


# -- real gloo ranks: every message on the device its group takes ------------------------------


def _control_paths(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    """Run the reduction paths with the collectives recorded; return what each handed over."""
    from ddpkit import distributed
    from ddpkit.checkpoint.manager.checkpointer import Checkpointer
    from ddpkit.prepare import prepare_model
    from ddpkit.reduce import reduce_sums

    ctx = distributed.init()  # adopts the gloo group of the test helper
    try:
        seen: dict[str, Any] = {"control": str(distributed.control_device()), "data": str(ctx.device)}
        with record_collectives() as calls:
            total = reduce_sums({"loss": torch.tensor(1.5), "count": 2})
        seen["reduce_sums"], seen["total"] = calls, total
        torch.manual_seed(rank)  # different weights on every rank: prepare_model broadcasts rank 0's
        with record_collectives() as calls:
            model = prepare_model(nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2)), grad_sync="flat")
        seen["prepare_model"] = calls
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        checkpointer = Checkpointer(folder, model=model, optimizer=optimizer, sync_seconds=1e-6)
        inputs = torch.Generator().manual_seed(0)
        try:
            with record_collectives() as calls:
                for _ in range(3):
                    model(torch.randn(2, 4, generator=inputs)).sum().backward()
                    optimizer.step()
                    optimizer.zero_grad()
                    checkpointer.step()
                checkpointer.save()
        finally:
            checkpointer.close()
        seen["checkpointer"] = calls
        return seen
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """``recorded(world_size)``: rank 0's record of :func:`_control_paths` on that many gloo ranks (run once)."""
    runs: dict[int, dict[str, Any]] = {}

    def run(world_size: int) -> dict[str, Any]:
        if world_size not in runs:
            folder = tmp_path_factory.mktemp(f"control-{world_size}")
            runs[world_size] = run_on_ranks(_control_paths, world_size, str(folder), timeout=180)[0]
        return runs[world_size]

    return run


CONTROL_COLLECTIVES = ("all_reduce",)
"""What ddpkit's control messages use; the rest of prepare_model's messages are its weights (data)."""


@pytest.mark.parametrize("world_size", [1, 2])
def test_every_message_is_on_a_device_its_group_takes(recorded, world_size):
    seen = recorded(world_size)
    assert seen["control"] == seen["data"] == "cpu"  # gloo on a CPU machine
    assert seen["total"] == {"loss": 1.5 * world_size, "count": 2.0 * world_size}
    for path in ("reduce_sums", "prepare_model", "checkpointer"):
        for name, devices in seen[path]:
            expected = seen["control"] if name in CONTROL_COLLECTIVES else seen["data"]
            assert devices and set(devices) == {expected}, f"{path}: {name} was handed tensors on {devices}"


@pytest.mark.parametrize("world_size", [1, 2])
def test_reduce_sums_goes_through_the_group_at_every_world_size(recorded, world_size):
    assert [name for name, _ in recorded(world_size)["reduce_sums"]] == ["all_reduce"]


def test_the_checkpoint_agreement_goes_through_the_group_with_two_workers(recorded):
    assert ("all_reduce", ["cpu"]) in recorded(2)["checkpointer"]


def test_the_checkpoint_agreement_goes_through_the_group_with_one_worker(recorded):
    assert ("all_reduce", ["cpu"]) in recorded(1)["checkpointer"]
