"""ddpkit.DataLoader: global batches, resume at any world size, per-sample randomness, global_mean.

Ranks are simulated: one loader per rank with explicit rank= and world_size=,
iterated in lockstep; the loader's logic needs no process group.
"""

import random
import time

import numpy as np
import pytest
import torch
import torch.utils.data
from torch.utils.data import TensorDataset, default_collate

from ddpkit.data.loader import DataLoader, SeededDataset
from ddpkit.data.sample_seeds import _mix
from ddpkit.data.sampler import epoch_permutation
from tests.data.helpers import IndexDataset


class NoisyDataset(IndexDataset):
    """An augmentation drawing from the three global generators."""

    def __getitem__(self, index):
        return {"index": index, "torch": torch.rand(()), "py": random.random(), "np": np.random.rand()}


def _ranks(dataset, batch, world_size, **kwargs):
    kwargs.setdefault("shuffle", True)
    return [
        DataLoader(dataset, global_batch_size=batch, rank=r, world_size=world_size, **kwargs) for r in range(world_size)
    ]


def _epoch(loaders, epoch=None):
    """Each step's batches over the ranks, for one pass in lockstep."""
    if epoch is not None:
        for loader in loaders:
            loader.set_epoch(epoch)
    return list(zip(*loaders, strict=True))


def _indices(steps):
    """The global batch of each step: the ranks' sample indices joined in rank order."""
    return [[i for batch in batches for i in batch.tolist()] for batches in steps]


def test_is_a_torch_dataloader():
    loader = DataLoader(IndexDataset(50), global_batch_size=8, shuffle=True, seed=1)
    assert isinstance(loader, torch.utils.data.DataLoader)
    assert len(loader) == loader.steps_per_epoch == 7
    assert (loader.rank, loader.world_size, loader.global_batch_size) == (0, 1, 8)
    assert isinstance(loader.dataset, SeededDataset) and len(loader.dataset) == 50
    assert isinstance(loader.dataset.dataset, IndexDataset)
    batches = [batch.tolist() for batch in loader]
    assert [i for batch in batches for i in batch] == epoch_permutation(50, 1, 0).tolist()
    loader.set_epoch(1)
    assert [batch.tolist() for batch in loader] != batches


@pytest.mark.parametrize("num_samples", [100, 101, 26, 2])
def test_same_global_batches_for_any_world_size(num_samples):
    reference = _indices(_epoch(_ranks(IndexDataset(num_samples), 12, 1, seed=3), epoch=2))
    for world_size in (2, 3, 4):
        steps = _epoch(_ranks(IndexDataset(num_samples), 12, world_size, seed=3), epoch=2)
        assert _indices(steps) == reference


def test_empty_share_is_a_batch_with_zero_rows():
    def collate(samples):
        return {
            "x": torch.stack([torch.full((3,), float(i)) for i in samples]),
            "name": [str(i) for i in samples],
            "pair": (torch.tensor(samples), np.array(samples)),
        }

    for kwargs in ({}, {"collate_fn": collate}, {"collate_fn": collate, "num_workers": 2}):
        last = _epoch(_ranks(IndexDataset(26), 12, 4, **kwargs))[-1]
        if "collate_fn" not in kwargs:
            assert [batch.shape for batch in last] == [(1,), (1,), (0,), (0,)]
            continue
        assert [len(batch["name"]) for batch in last] == [1, 1, 0, 0]
        empty = last[3]
        assert empty["x"].shape == (0, 3) and empty["x"].dtype == torch.float32
        assert empty["pair"][0].shape == (0,) and empty["pair"][1].shape == (0,)


def test_workers_give_the_same_batches():
    reference = _indices(_epoch(_ranks(IndexDataset(61), 8, 2, seed=5), epoch=1))
    assert _indices(_epoch(_ranks(IndexDataset(61), 8, 2, seed=5, num_workers=2), epoch=1)) == reference


def test_persistent_workers_over_epochs():
    loader = DataLoader(
        IndexDataset(30), global_batch_size=8, shuffle=True, seed=2, num_workers=2, persistent_workers=True
    )
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert [i for batch in loader for i in batch.tolist()] == epoch_permutation(30, 2, epoch).tolist()
        assert loader.state_dict()["step_in_epoch"] == 4
    loader._iterator._shutdown_workers()  # persistent workers live as long as the loader's iterator


def test_the_next_epochs_workers_are_forked_once_the_stopped_iterators_queue_threads_ended(monkeypatch):
    """CPython 3.11 deadlocks a child forked while a thread ends (ddpkit.data.workers.settle_stopped_queues):
    the previous epoch's queue feeder threads, and those of an iterator dropped mid-epoch, have ended before the
    next epoch's workers are forked. Each feeder here takes 0.3 s to end after its queue closed (a busy machine's
    scheduling), so that without the wait they would still be running."""
    import gc
    import multiprocessing.queues

    from ddpkit.data import workers

    feed = multiprocessing.queues.Queue._feed

    def slow_to_end(*args, **kwargs):
        feed(*args, **kwargs)
        time.sleep(0.3)

    monkeypatch.setattr(multiprocessing.queues.Queue, "_feed", staticmethod(slow_to_end))

    def feeders_of_a_new_iterator():
        before = set(workers._LIVE_WORKER_ITERATORS)
        batches = iter(loader)
        (started,) = set(workers._LIVE_WORKER_ITERATORS) - before  # torch's iterator, which forked its workers
        threads = [q._thread for q in workers._queues(started) if q is not None and q._thread is not None]
        assert threads  # torch put indices into the workers' queues: their feeder threads started
        return batches, threads

    loader = DataLoader(IndexDataset(30), global_batch_size=8, shuffle=True, seed=2, num_workers=2)
    finished, feeders = feeders_of_a_new_iterator()
    assert len(list(finished)) == 4
    dropped, dropped_feeders = feeders_of_a_new_iterator()
    next(dropped)  # a loop that breaks mid-epoch: its iterator is shut down when collected
    del dropped
    gc.collect()
    following, _ = feeders_of_a_new_iterator()
    assert not [thread for thread in feeders + dropped_feeders if thread.is_alive()]
    assert len(list(following)) == 4


def _take(loaders, num_batches):
    """num_batches steps from each rank's loader, leaving the iteration open (as a preempted loop does)."""
    iterators = [iter(loader) for loader in loaders]
    steps = [tuple(next(it) for it in iterators) for _ in range(num_batches)]
    states = [loader.state_dict() for loader in loaders]
    assert all(state == states[0] for state in states)
    for it in iterators:
        it.close()  # shuts workers down now, not at garbage collection
    return steps, states[0]


@pytest.mark.parametrize("before,after", [((2, 0), (1, 0)), ((1, 0), (2, 2)), ((2, 2), (3, 0)), ((1, 2), (1, 0))])
@pytest.mark.parametrize("num_batches", [3, 8])
def test_resume_covers_every_sample_once(before, after, num_batches):
    (world_size, num_workers), (new_world_size, new_num_workers) = before, after
    loaders = _ranks(IndexDataset(91), 12, world_size, seed=6, num_workers=num_workers)
    for loader in loaders:
        loader.set_epoch(1)
    steps, state = _take(loaders, num_batches)
    assert (state["epoch"], state["step_in_epoch"]) == (1, num_batches)  # batches handed out, not prefetched
    resumed = _ranks(IndexDataset(91), 12, new_world_size, seed=6, num_workers=new_num_workers)
    for loader in resumed:
        loader.load_state_dict(state)
    for epoch in range(resumed[0].epoch, 2):  # the user's loop: set_epoch keeps the restored step
        steps += _epoch(resumed, epoch)
    order = [i for batch in _indices(steps) for i in batch]
    assert order == epoch_permutation(91, 6, 1).tolist()
    # Saved before the loop ran out of the epoch (all 8 batches handed out, not yet exhausted): the
    # resumed loader re-enters epoch 1 with no batch left, so the code after the batch loop runs again.
    assert (resumed[0].epoch, resumed[0].step_in_epoch, resumed[0].epoch_done) == (1, 8, True)


def test_state_of_a_complete_epoch_resumes_at_the_next():
    loader = DataLoader(IndexDataset(20), global_batch_size=8, shuffle=True, seed=1)
    list(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["step_in_epoch"]) == (0, 3)
    resumed = DataLoader(IndexDataset(20), global_batch_size=8, shuffle=True, seed=1, rank=1, world_size=2)
    resumed.load_state_dict(state)
    assert (resumed.epoch, resumed.step_in_epoch) == (1, 0)
    resumed.set_epoch(resumed.epoch)
    assert len(list(resumed)) == 3


def test_a_second_pass_starts_over():
    loader = DataLoader(IndexDataset(20), global_batch_size=8)
    loader.load_state_dict({**loader.state_dict(), "step_in_epoch": 2})
    assert len(list(loader)) == 1
    assert len(list(loader)) == 3


def _values_by_index(steps):
    values = {}
    for batches in steps:
        for batch in batches:
            for k, i in enumerate(batch["index"].tolist()):
                values[i] = (batch["torch"][k].item(), batch["py"][k].item(), batch["np"][k].item())
    return values


def test_per_sample_randomness_depends_only_on_seed_epoch_and_index():
    reference = _values_by_index(_epoch(_ranks(NoisyDataset(23), 6, 1, seed=9), epoch=1))
    assert len(reference) == 23
    assert len({v for values in reference.values() for v in values}) == 3 * 23
    for world_size, num_workers in ((2, 0), (1, 2), (3, 2)):
        loaders = _ranks(NoisyDataset(23), 6, world_size, seed=9, num_workers=num_workers)
        assert _values_by_index(_epoch(loaders, epoch=1)) == reference
    other_epoch = _values_by_index(_epoch(_ranks(NoisyDataset(23), 6, 1, seed=9), epoch=2))
    assert all(other_epoch[i][k] != reference[i][k] for i in reference for k in range(3))


def _global_draws():
    return torch.rand(4).tolist(), random.random(), np.random.rand()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_loop_draws_as_if_no_loader_ran(num_workers):
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = _global_draws()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    loader = DataLoader(NoisyDataset(20), global_batch_size=4, shuffle=True, num_workers=num_workers)
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert len(list(loader)) == 5
    assert _global_draws() == expected


@pytest.mark.parametrize("num_samples", [31, 26, 14])
def test_global_mean_gives_the_gradient_of_the_global_mean(num_samples):
    # Global batch 12: the last one holds 7, 2 (fewer than 3 or 4 ranks) or 2 samples.
    features = torch.linspace(-1.0, 2.0, num_samples, dtype=torch.float64)
    dataset = TensorDataset(features)
    weight = torch.tensor(0.5, dtype=torch.float64, requires_grad=True)

    def loss(x):  # per-sample loss, summed
        return ((weight * x - 1.0) ** 2).sum()

    expected = []
    for (x,) in DataLoader(dataset, global_batch_size=12, shuffle=True, seed=2):
        (grad,) = torch.autograd.grad(loss(x) / len(x), weight)
        expected.append((loss(x).item() / len(x), grad.item()))
    for world_size in (1, 2, 3, 4):
        loaders = _ranks(dataset, 12, world_size, seed=2)
        for step, batches in enumerate(zip(*loaders, strict=True)):
            scaled = [loader.global_mean(loss(x)) for loader, (x,) in zip(loaders, batches, strict=True)]
            grads = [torch.autograd.grad(value, weight)[0] for value in scaled]
            # What DDP does: average the ranks' gradients.
            mean_loss = sum(value.item() for value in scaled) / world_size
            mean_grad = sum(grad.item() for grad in grads) / world_size
            assert mean_loss == pytest.approx(expected[step][0], rel=1e-12)
            assert mean_grad == pytest.approx(expected[step][1], rel=1e-12)


def test_tensor_dataset_fast_path_matches_the_generic_path():
    images = torch.randint(0, 255, (26, 1, 4, 4), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    labels = torch.arange(26)
    dataset = TensorDataset(images, labels)
    for world_size in (1, 3, 4):
        fast = _ranks(dataset, 12, world_size, seed=4)
        generic = _ranks(dataset, 12, world_size, seed=4, collate_fn=default_collate)
        assert fast[0].dataset is dataset and isinstance(generic[0].dataset, SeededDataset)
        for epoch in (0, 1):
            fast_steps, generic_steps = _epoch(fast, epoch), _epoch(generic, epoch)
            assert len(fast_steps) == len(generic_steps) == 3
            for fast_batches, generic_batches in zip(fast_steps, generic_steps, strict=True):
                for a, b in zip(fast_batches, generic_batches, strict=True):
                    assert type(a) is tuple and len(a) == 2
                    assert all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=True))
            assert fast[0].state_dict() == generic[0].state_dict()
            assert fast[-1].global_mean(torch.tensor(1.0)) == generic[-1].global_mean(torch.tensor(1.0))


def test_fast_path_resumes():
    dataset = TensorDataset(torch.arange(40))
    steps, state = _take(_ranks(dataset, 8, 2, seed=1), 2)
    resumed = DataLoader(dataset, global_batch_size=8, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    order = [i for batches in steps for (x,) in batches for i in x.tolist()]
    order += [i for (x,) in resumed for i in x.tolist()]
    assert order == epoch_permutation(40, 1, 0).tolist()


def test_refuses_a_global_batch_smaller_than_world_size():
    with pytest.raises(ValueError, match="global batch size 2 does not divide among 4 workers"):
        DataLoader(IndexDataset(10), global_batch_size=2, rank=0, world_size=4)


def test_refuses_a_state_of_another_dataset():
    state = DataLoader(IndexDataset(10), global_batch_size=4).state_dict()
    with pytest.raises(ValueError, match="saved with num_samples=10 but this sampler has num_samples=11"):
        DataLoader(IndexDataset(11), global_batch_size=4).load_state_dict(state)


def test_global_mean_needs_a_batch():
    with pytest.raises(RuntimeError, match="after taking a batch"):
        DataLoader(IndexDataset(10), global_batch_size=4).global_mean(torch.tensor(1.0))


def test_a_subset_keeps_per_sample_seeding_and_a_batch_reader_is_read_a_batch_per_call():
    class Batched(IndexDataset):
        calls = 0

        def __getitems__(self, indices):
            Batched.calls += 1
            return list(indices)

    subset = torch.utils.data.Subset(NoisyDataset(23), range(23))
    loader = DataLoader(subset, global_batch_size=6, shuffle=True, seed=9)
    assert type(loader.dataset) is SeededDataset  # torch's Subset reads a sample at a time
    assert _values_by_index([[b] for b in loader]) == _values_by_index(_epoch(_ranks(NoisyDataset(23), 6, 1, seed=9)))
    loader = DataLoader(torch.utils.data.Subset(Batched(20), range(20)), global_batch_size=8)
    assert type(loader.dataset).__name__ == "BatchReadDataset"
    assert [b.tolist() for b in loader] == [list(range(8)), list(range(8, 16)), list(range(16, 20))]
    assert Batched.calls == 3


class LateDrawDataset(IndexDataset):
    """Draws for some samples from index 12 on, and from numpy or python depending on a torch draw."""

    def __getitem__(self, index):
        if index < 12 or index % 7 != 5:
            return {"index": index, "torch": torch.tensor(0.0), "py": 0.0, "np": 0.0}
        value = torch.rand(())
        extra = np.random.rand() if value < 0.5 else random.random()
        return {"index": index, "torch": value, "py": float(extra), "np": np.random.randn()}


def _seeded_values(dataset, seed, epoch):
    """Each sample's values with all three generators seeded from (seed, epoch, index), the documented rule."""
    values = {}
    for index in range(len(dataset)):
        sample_seed = _mix(_mix(_mix(seed) + epoch) + index)
        torch.manual_seed(sample_seed), random.seed(sample_seed), np.random.seed(sample_seed >> 32)
        sample = dataset[index]
        values[index] = (float(sample["torch"]), float(sample["py"]), float(sample["np"]))
    return values


@pytest.mark.parametrize(("world_size", "num_workers"), [(1, 0), (2, 0), (4, 2), (1, 2)])
def test_a_late_first_draw_is_the_same_at_any_world_size(world_size, num_workers):
    # In order, the first three global batches draw nothing: the first draw must be noticed where it comes,
    # and every sample still get the draws of its own seed, whichever rank, worker and batch it lands in.
    expected = _seeded_values(LateDrawDataset(40), seed=3, epoch=1)
    assert len({v for i, values in expected.items() if i >= 12 and i % 7 == 5 for v in values}) == 3 * 4
    loaders = _ranks(LateDrawDataset(40), 4, world_size, seed=3, num_workers=num_workers, shuffle=False)
    assert _values_by_index(_epoch(loaders, epoch=1)) == expected


def test_a_dataset_that_draws_nothing_leaves_the_generators_alone():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = _global_draws()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    assert len(list(DataLoader(IndexDataset(20), global_batch_size=4))) == 5
    assert _global_draws() == expected


def test_a_pass_left_early_without_set_epoch_gets_a_new_order_next_pass_as_torch_reshuffles():
    dataset = TensorDataset(torch.arange(40))
    loader = DataLoader(dataset, batch_size=4, shuffle=True, seed=3)
    peeked = next(iter(loader))[0]  # a look at the first batch: the loop's epoch still starts there
    firsts = []
    for _ in range(3):
        for i, (batch,) in enumerate(loader):
            if i == 2:
                break
            firsts.append(batch)
    assert torch.equal(firsts[0], peeked)
    assert loader.epoch == 2 and len({tuple(b.tolist()) for b in firsts}) == 6  # three epochs, three orders
    assert [torch.equal(a, b) for a, b in zip(firsts[::2], _first_of_epochs(dataset, 3))] == [True] * 3


def _first_of_epochs(dataset, epochs):
    """Each epoch's first batch, from a loader of the same arguments that calls set_epoch."""
    fresh = DataLoader(dataset, batch_size=4, shuffle=True, seed=3)
    firsts = []
    for epoch in range(epochs):
        fresh.set_epoch(epoch)
        firsts.append(next(iter(fresh))[0])
    return firsts
