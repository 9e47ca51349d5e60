"""The multi-process helper itself: results, tracebacks and timeouts."""

import time

import pytest
import torch
import torch.distributed as dist

from tests.helpers.workers import RankFailed, run_on_ranks


def _all_reduce_rank(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank, world_size):
    if rank == 1:
        raise ValueError("boom on purpose")
    dist.barrier()  # rank 0 waits for a peer that never comes


def _sleep(rank, world_size):
    time.sleep(60)


def test_returns_results_by_rank():
    assert run_on_ranks(_all_reduce_rank, 3) == [3.0, 3.0, 3.0]


def test_surfaces_failing_rank_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*boom on purpose"):
        run_on_ranks(_fail_on_rank_one, 2, timeout=60)


def test_times_out_instead_of_hanging():
    with pytest.raises(RankFailed, match=r"did not finish within 3s"):
        run_on_ranks(_sleep, 2, timeout=3, init_process_group=False)
