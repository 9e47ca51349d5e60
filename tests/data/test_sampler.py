"""Global batches and sample order do not depend on the number of workers."""

import pytest
import torch
from torch.utils.data import DataLoader

from ddpkit.data import sampler as sampler_module
from ddpkit.data.sampler import GlobalBatchSampler, epoch_permutation, shard_range


def _global_batches(num_samples, batch, world_size, epoch=0, start=0):
    per_rank = [
        list(GlobalBatchSampler(num_samples, batch, r, world_size, seed=7).tensor_shares(epoch, start))
        for r in range(world_size)
    ]
    return [torch.cat([per_rank[r][s] for r in range(world_size)]).tolist() for s in range(len(per_rank[0]))]


def _iterated_global_batches(samplers):
    """One pass over each rank's sampler, the ranks' shares of each step joined."""
    return [[i for share in shares for i in share] for shares in zip(*samplers, strict=True)]


def _ranks(num_samples, batch, world_size, **kwargs):
    return [GlobalBatchSampler(num_samples, batch, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


@pytest.mark.parametrize("num_samples", [100, 101, 67])
def test_same_global_batches_for_any_world_size(num_samples):
    reference = _global_batches(num_samples, 12, 1)
    for world_size in (2, 3, 4):
        assert _global_batches(num_samples, 12, world_size) == reference


def test_order_is_the_original_one():
    # The order before GlobalBatchSampler became a torch Sampler: results computed with it stay valid.
    num_samples, batch, seed = 101, 12, 7
    for world_size in (1, 2, 3, 4):
        for rank in range(world_size):
            order = torch.randperm(num_samples, generator=torch.Generator().manual_seed(seed * 1_000_003 + 3))
            expected = [
                torch.tensor_split(order[s * batch : (s + 1) * batch], world_size)[rank].tolist() for s in range(9)
            ]
            sampler = GlobalBatchSampler(num_samples, batch, rank, world_size, seed)
            assert [t.tolist() for t in sampler.tensor_shares(3)] == expected
            sampler.set_epoch(3)
            assert list(sampler) == expected
            sampler.set_epoch(3)
            assert [t.tolist() for t in sampler.iter_tensors()] == expected


@pytest.mark.parametrize("num_samples", [100, 101, 67, 26, 2])
def test_iteration_gives_the_same_global_batches_for_any_world_size(num_samples):
    reference = _iterated_global_batches(_ranks(num_samples, 12, 1, seed=3))
    assert len(reference) == -(-num_samples // 12)
    for world_size in (2, 3, 4):
        assert _iterated_global_batches(_ranks(num_samples, 12, world_size, seed=3)) == reference


def test_share_is_empty_when_the_last_global_batch_is_smaller_than_world_size():
    shares = [list(s)[-1] for s in _ranks(26, 12, 4)]
    assert [len(share) for share in shares] == [1, 1, 0, 0]


def test_epoch_covers_every_sample_once_and_epochs_differ():
    batches = _global_batches(101, 12, 3)
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(101))
    assert _global_batches(101, 12, 3, epoch=1) != batches


def test_without_shuffle_the_order_is_every_sample_once():
    batches = _iterated_global_batches(_ranks(10, 4, 2, shuffle=False))
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert list(GlobalBatchSampler(10, 4, 1, 2, shuffle=False)) == [[2, 3], [6, 7], [9]]


def test_resume_mid_epoch_with_other_world_size():
    full = _global_batches(101, 12, 2)
    assert _global_batches(101, 12, 3, start=4) == full[4:]


def test_last_batch_length():
    sampler = GlobalBatchSampler(101, 12, 0, 2)
    assert sampler.steps_per_epoch == len(sampler) == 9
    assert [sampler.global_batch_length(s) for s in (0, 8)] == [12, 5]


def test_batch_must_divide():
    with pytest.raises(ValueError, match="global batch size 10 does not divide among 4 workers; use a global_batch"):
        GlobalBatchSampler(100, 10, 0, 4)
    with pytest.raises(ValueError, match="global batch size 2 does not divide among 4 workers"):
        GlobalBatchSampler(100, 2, 0, 4)


def test_rank_must_be_below_world_size():
    with pytest.raises(ValueError, match="rank 2 is not in"):
        GlobalBatchSampler(100, 4, 2, 2)


def test_rank_and_world_size_default_to_torch_distributed(monkeypatch):
    assert (GlobalBatchSampler(10, 4).rank, GlobalBatchSampler(10, 4).world_size) == (0, 1)
    monkeypatch.setattr(sampler_module.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(sampler_module.dist, "get_rank", lambda: 1)
    monkeypatch.setattr(sampler_module.dist, "get_world_size", lambda: 2)
    sampler = GlobalBatchSampler(10, 4)
    assert (sampler.rank, sampler.world_size) == (1, 2)
    assert GlobalBatchSampler(10, 4, rank=0, world_size=4).world_size == 4


def test_in_a_plain_torch_dataloader():
    dataset = list(range(50))
    sampler = GlobalBatchSampler(50, 8, rank=1, world_size=2, seed=5)
    loader = DataLoader(dataset, batch_sampler=sampler)
    assert len(loader) == 7
    sampler.set_epoch(0)
    first = [batch.tolist() for batch in loader]
    assert first == [t.tolist() for t in sampler.tensor_shares(0)]
    sampler.set_epoch(1)
    second = [batch.tolist() for batch in loader]
    assert second == [t.tolist() for t in sampler.tensor_shares(1)] and second != first


def test_set_epoch_and_passes():
    sampler = GlobalBatchSampler(20, 4, 0, 1, seed=1)
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "step_in_epoch": 3})
    sampler.set_epoch(2)  # the epoch just restored keeps its step
    assert list(sampler) == [t.tolist() for t in sampler.tensor_shares(2, 3)]
    assert sampler.state_dict()["step_in_epoch"] == 5
    assert len(list(sampler)) == 5  # a second pass over the same epoch starts at 0
    sampler.load_state_dict({**sampler.state_dict(), "epoch": 2, "step_in_epoch": 3})
    sampler.set_epoch(4)  # another epoch starts at 0
    assert sampler.state_dict()["step_in_epoch"] == 0
    assert list(sampler) == [t.tolist() for t in sampler.tensor_shares(4)]


def test_state_counts_yielded_batches_and_resumes_at_another_world_size():
    samplers = _ranks(101, 12, 2, seed=4)
    for s in samplers:
        s.set_epoch(1)
    iterators = [iter(s) for s in samplers]
    seen = [[i for it in iterators for i in next(it)] for _ in range(4)]
    state = samplers[0].state_dict()
    assert state == samplers[1].state_dict()
    assert state == {
        "epoch": 1,
        "step_in_epoch": 4,
        "num_samples": 101,
        "global_batch_size": 12,
        "seed": 4,
        "shuffle": True,
        "drop_last": False,
    }
    resumed = _ranks(101, 12, 3, seed=4)
    for s in resumed:
        s.load_state_dict(state)
    seen += _iterated_global_batches(resumed)
    assert [i for batch in seen for i in batch] == epoch_permutation(101, 4, 1).tolist()


def test_state_of_a_complete_epoch_resumes_at_the_next():
    sampler = GlobalBatchSampler(30, 8, 0, 1, seed=2)
    list(sampler)
    state = sampler.state_dict()
    assert (state["epoch"], state["step_in_epoch"]) == (0, 4)
    resumed = GlobalBatchSampler(30, 8, 1, 2, seed=2)
    resumed.load_state_dict(state)
    assert (resumed.current_epoch, resumed.start_step) == (1, 0)
    assert resumed.state_dict()["step_in_epoch"] == 0
    assert list(resumed) == [t.tolist() for t in resumed.tensor_shares(1)]


@pytest.mark.parametrize(
    "name,value", [("num_samples", 31), ("global_batch_size", 16), ("seed", 3), ("shuffle", False)]
)
def test_load_refuses_another_setup(name, value):
    state = {**GlobalBatchSampler(30, 8, 0, 1, seed=2).state_dict(), name: value}
    with pytest.raises(ValueError, match=f"saved with {name}={value} but this sampler has {name}="):
        GlobalBatchSampler(30, 8, 0, 1, seed=2).load_state_dict(state)


@pytest.mark.parametrize("num_samples,world_size", [(10, 3), (10000, 4), (2, 4), (0, 2)])
def test_shards_cover_once(num_samples, world_size):
    ranges = [shard_range(num_samples, r, world_size) for r in range(world_size)]
    covered = [i for start, stop in ranges for i in range(start, stop)]
    assert covered == list(range(num_samples))


def test_the_old_name_epoch_still_yields_the_shares_with_a_deprecation_warning():
    sampler = GlobalBatchSampler(101, 12, rank=1, world_size=3, seed=7)
    with pytest.warns(DeprecationWarning, match=r"epoch\(epoch, start_step\) is now tensor_shares"):
        old = [t.tolist() for t in sampler.epoch(2, 3)]
    assert old == [t.tolist() for t in sampler.tensor_shares(2, 3)]
