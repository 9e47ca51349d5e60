"""Global batches and sample order do not depend on the number of workers."""

import pytest
import torch

from ddpkit.data.sampler import GlobalBatchSampler, shard_range


def _global_batches(num_samples, batch, world_size, epoch=0, start=0):
    per_rank = [list(GlobalBatchSampler(num_samples, batch, r, world_size, seed=7).epoch(epoch, start))
                for r in range(world_size)]
    return [torch.cat([per_rank[r][s] for r in range(world_size)]).tolist() for s in range(len(per_rank[0]))]


@pytest.mark.parametrize("num_samples", [100, 101, 67])
def test_same_global_batches_for_any_world_size(num_samples):
    reference = _global_batches(num_samples, 12, 1)
    for world_size in (2, 3, 4):
        assert _global_batches(num_samples, 12, world_size) == reference


def test_epoch_covers_every_sample_once_and_epochs_differ():
    batches = _global_batches(101, 12, 3)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(101))
    assert _global_batches(101, 12, 3, epoch=1) != batches


def test_resume_mid_epoch_with_other_world_size():
    full = _global_batches(101, 12, 2)
    assert _global_batches(101, 12, 3, start=4) == full[4:]


def test_last_batch_length():
    sampler = GlobalBatchSampler(101, 12, 0, 2)
    assert sampler.steps_per_epoch == 9
    assert [sampler.global_batch_length(s) for s in (0, 8)] == [12, 5]


def test_batch_must_divide():
    with pytest.raises(ValueError, match="global batch size 10 does not divide among 4 workers"):
        GlobalBatchSampler(100, 10, 0, 4)


@pytest.mark.parametrize("num_samples,world_size", [(10, 3), (10000, 4), (2, 4), (0, 2)])
def test_shards_cover_once(num_samples, world_size):
    ranges = [shard_range(num_samples, r, world_size) for r in range(world_size)]
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert covered == list(range(num_samples))
