"""ddpkit's collectives on CUDA: nccl with one worker, two workers sharing a GPU over gloo, clear refusals, bench comm.

- nccl at world size 1 (a single-GPU run): every reduction path goes through
  the process group with its control tensor on the GPU, since nccl takes
  nothing else (reduce_sums, the Checkpointer's save and step agreement, the
  allreduce=auto agreement), and a checkpoint round-trips.
- Two processes on GPU 0 over gloo (nccl refuses two ranks on one GPU): CUDA
  data, CPU control messages, the same weights on both ranks after training.
- The shared-memory all_reduces refuse CUDA tensors in one line (allreduce=auto
  picks the built-in for them: tests/test_control_device.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

from tests.gpu.runs import TIMEOUT, environ
from tests.helpers.workers import run_on_ranks
from tests.test_control_device import record_collectives


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10))


def _cuda_batches(rank: int, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)  # different data on every rank
    batches = [
        (torch.rand(8, 1, 28, 28, generator=generator), torch.randint(0, 10, (8,), generator=generator))
        for _ in range(steps)
    ]
    return [(x.cuda(), y.cuda()) for x, y in batches]


def _train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, batches, checkpointer=None) -> None:
    for x, y in batches:
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
        if checkpointer is not None:
            checkpointer.step()


# -- nccl, one worker ------------------------------------------------------------------------------


def _nccl_world_of_one(rank: int, world_size: int, folder: str) -> dict:
    import ddpkit
    from ddpkit import distributed
    from ddpkit.checkpoint.manager.checkpointer import Checkpointer
    from ddpkit.comm.grad_sync import _on_every_rank, choose_allreduce

    ctx = distributed.init(backend="nccl", device="cuda")
    try:
        seen = {"backend": ctx.backend, "device": str(ctx.device), "control": str(distributed.control_device())}
        with record_collectives() as calls:
            seen["sums"] = ddpkit.reduce_sums({"loss": torch.tensor(2.5, device="cuda"), "count": 4})
        seen["reduce_sums"] = calls
        with record_collectives() as calls:
            seen["agreed"] = _on_every_rank(True)  # the agreement allreduce=auto uses where it has a choice
            seen["allreduce"] = choose_allreduce("auto", ctx)
        seen["allreduce_agreement"] = calls
        torch.manual_seed(0)
        model = ddpkit.prepare_model(_mlp())
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        checkpointer = Checkpointer(folder, model=model, optimizer=optimizer, every_steps=2, sync_seconds=1e-6)
        try:
            with record_collectives() as calls:
                _train_steps(model, optimizer, _cuda_batches(rank, 3), checkpointer)
                path = checkpointer.save()
            seen["checkpointer"] = calls
        finally:
            checkpointer.close()
        seen["saved"] = {k: v.cpu() for k, v in ddpkit.unwrap_model(model).state_dict().items()}
        fresh = _mlp().cuda()
        again = Checkpointer(folder, model=fresh, optimizer=torch.optim.Adam(fresh.parameters(), lr=1e-3))
        try:
            start = again.resume("auto")
            seen["resumed"] = (start.global_step, str(start.path) == str(path))
        finally:
            again.close()
        return seen
    finally:
        distributed.shutdown()


@pytest.fixture(scope="module")
def nccl_one(tmp_path_factory):
    return run_on_ranks(
        _nccl_world_of_one, 1, str(tmp_path_factory.mktemp("nccl-one")), timeout=300, init_process_group=False
    )[0]


def test_nccl_world_of_one_puts_control_messages_on_the_gpu(nccl_one):
    assert (nccl_one["backend"], nccl_one["device"], nccl_one["control"]) == ("nccl", "cuda:0", "cuda:0")
    assert nccl_one["sums"] == {"loss": 2.5, "count": 4.0}
    assert nccl_one["agreed"] is True and nccl_one["allreduce"] == "builtin"
    assert nccl_one["resumed"] == (3, True)
    for path in ("reduce_sums", "allreduce_agreement", "checkpointer"):
        for name, devices in nccl_one[path]:
            assert set(devices) == {"cuda:0"}, f"{path}: {name} was handed tensors on {devices}; nccl takes CUDA only"


def test_nccl_world_of_one_runs_reduce_sums_and_the_allreduce_agreement_through_the_group(nccl_one):
    assert [name for name, _ in nccl_one["reduce_sums"]] == ["all_reduce"]
    assert ("all_reduce", ["cuda:0"]) in nccl_one["allreduce_agreement"]


def test_nccl_world_of_one_runs_the_checkpoint_agreement_through_the_group(nccl_one):
    assert ("all_reduce", ["cuda:0"]) in nccl_one["checkpointer"]


# -- two processes sharing GPU 0 over gloo ---------------------------------------------------------


def _sharing_gpu_0(rank: int, world_size: int, folder: str, grad_sync: str) -> dict:
    import ddpkit
    from ddpkit import distributed
    from ddpkit.checkpoint.manager.checkpointer import Checkpointer

    # A job of two one-GPU nodes as torch's env:// variables describe it: both workers bind GPU 0.
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
        GROUP_RANK=str(rank),
        GROUP_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT="29500",
    )
    ctx = distributed.init(device="cuda")  # adopts the helper's gloo group
    try:
        seen = {"backend": ctx.backend, "device": str(ctx.device), "control": str(distributed.control_device())}
        data = torch.full((3,), float(rank + 1), device="cuda")
        torch.distributed.all_reduce(data)  # gloo's own all_reduce of CUDA tensors
        seen["data"] = data.tolist()
        with record_collectives(check=_gloo_takes) as calls:
            seen["sums"] = ddpkit.reduce_sums({"loss": torch.tensor(1.5, device="cuda"), "count": 1})
        seen["reduce_sums"] = calls
        with record_collectives(check=_gloo_takes) as calls:
            torch.manual_seed(rank)  # different initial weights: prepare_model starts every rank from rank 0's
            model = ddpkit.prepare_model(_mlp(), grad_sync=grad_sync)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            checkpointer = Checkpointer(folder, model=model, optimizer=optimizer, sync_seconds=1e-6)
            try:
                _train_steps(model, optimizer, _cuda_batches(rank, 3), checkpointer)
                checkpointer.save()
            finally:
                checkpointer.close()
        seen["calls"] = calls
        seen["mode"] = ddpkit.gradient_sync(model).mode
        seen["params"] = [p.detach().cpu() for p in model.parameters()]
        return seen
    finally:
        distributed.shutdown()


GLOO_POINT_TO_POINT = ("send", "recv", "isend", "irecv")
"""gloo's point-to-point ops hand the tensor's memory to its TCP transport as host memory: CPU tensors only."""


def _gloo_takes(name: str, devices: list[str]) -> None:
    if name in GLOO_POINT_TO_POINT and any(device != "cpu" for device in devices):
        raise AssertionError(f"{name} was handed tensors on {devices}; gloo's send/recv take CPU tensors only")


@pytest.mark.parametrize("grad_sync", ["flat", "ddp"])
def test_two_processes_share_one_gpu_over_gloo(tmp_path, grad_sync):
    results = run_on_ranks(_sharing_gpu_0, 2, str(tmp_path), grad_sync, timeout=300)
    for seen in results:
        assert (seen["backend"], seen["device"], seen["control"]) == ("gloo", "cuda:0", "cpu")
        assert seen["data"] == [3.0, 3.0, 3.0]
        assert seen["sums"] == {"loss": 3.0, "count": 2.0}
        assert seen["mode"] == grad_sync
        assert seen["reduce_sums"] == [("all_reduce", ["cpu"])]  # control: on the CPU for gloo
        assert ("all_reduce", ["cpu"]) in seen["calls"]  # the checkpoint agreement, likewise
    for p, q in zip(results[0]["params"], results[1]["params"]):
        assert torch.equal(p, q)


# -- refusals --------------------------------------------------------------------------------------


def test_shared_memory_all_reduces_refuse_cuda_tensors_in_one_line():
    from ddpkit.comm import hierarchical, shm

    tensor = torch.zeros(4, device="cuda")
    for module in (shm, hierarchical):
        with pytest.raises(
            ValueError,
            match=rf"^ddpkit.comm.{module.__name__.split('.')[-1]}.all_reduce takes CPU "
            r"tensors, got one on cuda:0; use allreduce=builtin .* for CUDA tensors$",
        ):
            module.all_reduce(tensor)


# -- ddpkit bench comm on CUDA tensors -------------------------------------------------------------


def test_bench_comm_on_cuda_tensors(tmp_path):
    nproc = min(2, torch.cuda.device_count())
    command = [
        sys.executable,
        "-m",
        "ddpkit",
        "bench",
        "comm",
        "device=cuda",
        "smoke=true",
        f"nproc={nproc}",
        "ops=[all_reduce,broadcast,all_gather,pingpong]",
        f"output_dir={tmp_path}",
    ]
    out = subprocess.run(command, cwd=tmp_path, env=environ(), capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    (result,) = tmp_path.glob("comm-*.json")
    report = json.loads(result.read_text())
    assert report["config"]["device"] == "cuda" and report["world_size"] == nproc
    assert {row["op"] for row in report["collectives"]} == {"all_reduce", "broadcast", "all_gather"}
    assert {row["algorithm"] for row in report["collectives"] if row["op"] == "all_reduce"} >= {"builtin", "ring"}
    assert report["skipped"]["all_reduce/shm"] == "takes CPU tensors (device=cuda)"
    assert all(row["time_us"]["median"] > 0 for row in report["collectives"])
    assert bool(report["pingpong"]) == (nproc > 1)
