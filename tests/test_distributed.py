"""How a worker process ends: output flushed and the exit code kept, with or without a job joined."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ddpkit import distributed

SCRIPT = """
import sys
from ddpkit import distributed
distributed._joined_multiprocess_job = {joined}
print("written before the exit", end="")   # no newline: only a flush gets it out
print("and to stderr", end="", file=sys.stderr)
distributed.exit_process(3)
"""


@pytest.mark.parametrize("joined", [True, False])
def test_exit_process_flushes_output_and_keeps_the_code(joined):
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(joined=joined)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 3
    assert out.stdout == "written before the exit" and out.stderr.endswith("and to stderr")


def _adopt_existing_group(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from ddpkit import distributed

    torchrun_says_other = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "3",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }
    with pytest.raises(ValueError, match=f"makes this process rank {rank} of 2, but torchrun's variables say rank 3"):
        distributed.init(environ=torchrun_says_other)
    with pytest.raises(ValueError, match="backend='nccl' but the existing process group uses 'gloo'"):
        distributed.init(backend="nccl", environ={})
    ctx = distributed.init(environ={})
    env = ctx.env
    distributed.shutdown()
    return {
        "env": (
            env.source,
            env.rank,
            env.world_size,
            env.local_rank,
            env.local_world_size,
            env.node_rank,
            env.num_nodes,
        ),
        "backend": ctx.backend,
        "group_kept": dist.is_initialized(),
    }


def test_init_adopts_a_process_group_the_script_formed_and_leaves_it_to_the_script():
    from tests.helpers.workers import run_on_ranks

    results = run_on_ranks(_adopt_existing_group, 2)
    assert results == [
        {"env": ("torch.distributed", rank, 2, rank, 2, 0, 1), "backend": "gloo", "group_kept": True}
        for rank in range(2)
    ]


# -- GPUs: one per worker, the group bound to it ---------------------------------------------------


@pytest.mark.parametrize(
    ("local_world_size", "num_gpus", "device"),
    [(1, 1, "auto"), (2, 2, "auto"), (2, 4, "cuda"), (8, 1, "cpu"), (4, 0, "auto"), (1, 0, "cuda")],
)
def test_a_node_whose_workers_each_have_a_gpu_or_train_on_the_cpu_is_not_short(local_world_size, num_gpus, device):
    assert distributed.gpu_shortage(local_world_size, num_gpus, device) is None


@pytest.mark.parametrize(
    ("source", "fewer"),
    [
        ("local", "nproc=2"),
        ("torchrun", "torchrun --nproc-per-node 2"),
        ("slurm", "srun --ntasks-per-node 2"),
        ("openmpi", "mpirun --npernode 2"),
        ("mpich", "2 per node"),
    ],
)
def test_more_workers_than_gpus_is_one_line_naming_the_fixes_in_the_launchers_terms(source, fewer):
    line = distributed.gpu_shortage(4, 2, "auto", source)
    assert line == (
        "4 workers on this node but 2 visible GPUs: device=auto gives each worker a GPU of its own; "
        f"start 2 per node ({fewer}), or train on the CPU (device=cpu), or make more GPUs visible "
        "(CUDA_VISIBLE_DEVICES)"
    )


def test_init_says_the_line_before_set_device_under_another_launcher(monkeypatch):
    """torchrun --nproc-per-node 2 on one GPU: every rank, rank 0 too, stops with the line, none in set_device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)

    def set_device(device):
        raise AssertionError("set_device must not be reached")

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    environ = {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
    }
    with pytest.raises(distributed.UserError, match="2 workers on this node but 1 visible GPU") as error:
        distributed.init(environ=environ)
    assert "torchrun --nproc-per-node 1" in str(error.value)


def test_the_group_is_bound_to_the_workers_gpu_under_nccl_only():
    import torch

    cuda = torch.device("cuda", 1)
    assert distributed.process_group_options("nccl", cuda) == {"device_id": cuda}
    assert distributed.process_group_options("cpu:gloo,cuda:nccl", cuda) == {"device_id": cuda}
    assert distributed.process_group_options("gloo", cuda) == {}  # two workers sharing a GPU over gloo
    assert distributed.process_group_options("gloo", torch.device("cpu")) == {}


def test_init_on_cuda_passes_the_device_id_and_on_the_cpu_nothing_more(monkeypatch):
    """What init_process_group receives for a CUDA context (faked) and for the CPU (real, gloo)."""
    import torch
    import torch.distributed as dist

    calls = []
    real = dist.init_process_group

    def record(backend, **kwargs):
        calls.append((backend, kwargs.get("device_id")))
        real("gloo", **{k: v for k, v in kwargs.items() if k != "device_id"})

    monkeypatch.setattr(dist, "init_process_group", record)
    try:
        distributed.init(environ={})
    finally:
        distributed.shutdown()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    try:
        distributed.init(environ={})
    finally:
        distributed.shutdown()
    assert calls == [("gloo", None), ("nccl", torch.device("cuda", 0))]
