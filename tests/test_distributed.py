"""How a worker process ends: output flushed and the exit code kept, with or without a job joined."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
