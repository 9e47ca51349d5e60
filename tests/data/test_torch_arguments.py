"""ddpkit.DataLoader takes torch's DataLoader arguments with torch's meaning, or refuses them in one line.

Ranks are simulated: one loader per rank with explicit rank= and world_size=,
iterated in lockstep (the loader's logic needs no process group).
"""

from __future__ import annotations

import inspect
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    SequentialSampler,
    SubsetRandomSampler,
    default_collate,
)

from ddpkit.data.loader import DataLoader
from ddpkit.data.sampler import epoch_permutation
from ddpkit.errors import UserError
from tests.data.helpers import IndexDataset

WORKER_MARK = 0
"""Set by worker_init_fn in a loader worker (forked), read by MarkedDataset there."""


class MarkedDataset(IndexDataset):
    def __getitem__(self, index):
        return torch.tensor([index, WORKER_MARK])


def _mark_worker(worker_id):
    global WORKER_MARK
    WORKER_MARK = 100 + worker_id


def _one_line(error) -> str:
    message = str(error.value)
    assert message and "\n" not in message, message
    return message


WITH_WORKER = {"num_workers": 1}

# Every argument of torch.utils.data.DataLoader.__init__: (value, extra arguments it needs, None when accepted
# or a part of the one line that refuses it). A torch release with a new argument fails the test until it is here.
TORCH_ARGUMENTS = {
    "dataset": (IndexDataset(40), {}, None),
    "batch_size": (4, {}, None),
    "shuffle": (True, {}, None),
    "sampler": (SubsetRandomSampler(range(0, 40, 2)), {}, None),
    "batch_sampler": (
        BatchSampler(SequentialSampler(range(40)), 4, False),
        {},
        "batch_sampler=BatchSampler is not taken: ddpkit.DataLoader cuts one global order",
    ),
    "num_workers": (2, {}, None),
    "collate_fn": (default_collate, {}, None),
    "pin_memory": (True, {}, None),
    "drop_last": (True, {"batch_size": 3}, None),
    "timeout": (30.0, WITH_WORKER, None),
    "worker_init_fn": (_mark_worker, WITH_WORKER, None),
    "multiprocessing_context": ("fork", WITH_WORKER, None),
    "generator": (torch.Generator().manual_seed(3), {"shuffle": True}, None),
    "prefetch_factor": (3, WITH_WORKER, None),
    "persistent_workers": (True, WITH_WORKER, None),
    "pin_memory_device": ("cpu", {}, None),
    "in_order": (False, {"num_workers": 2}, None),
}


def test_the_signature_is_torchs_with_ddpkits_additions_keyword_only():
    torch_parameters = list(inspect.signature(torch.utils.data.DataLoader.__init__).parameters.values())[1:]
    ours = list(inspect.signature(DataLoader.__init__).parameters.values())[1:]
    assert [p.name for p in torch_parameters] == list(TORCH_ARGUMENTS), "a torch argument ddpkit does not handle yet"
    assert [(p.name, p.kind) for p in ours[: len(torch_parameters)]] == [(p.name, p.kind) for p in torch_parameters]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in ours[len(torch_parameters) :])


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true but no accelerator")
@pytest.mark.parametrize("name", [name for name in TORCH_ARGUMENTS if name != "dataset"])
def test_every_torch_argument_is_accepted_or_refused_in_one_line(name):
    value, extra, refused = TORCH_ARGUMENTS[name]
    dataset = MarkedDataset(40) if name == "worker_init_fn" else IndexDataset(40)
    arguments = {"batch_size": 4, **extra, name: value}
    if refused is not None:
        arguments.pop("batch_size")
        with pytest.raises(UserError) as error:
            DataLoader(dataset, **arguments)
        assert refused in _one_line(error)
        return
    loader = DataLoader(dataset, **arguments)
    batches = list(loader)
    if name == "worker_init_fn":
        assert {mark for batch in batches for mark in batch[:, 1].tolist()} == {100}
        return
    samples = sorted(i for batch in batches for i in batch.tolist())
    if name == "sampler":
        assert samples == list(range(0, 40, 2))
    elif name == "drop_last":
        assert [len(batch) for batch in batches] == [3] * 13  # 40 = 13 x 3 + 1: the incomplete one dropped
    else:
        assert samples == list(range(40))
    if name == "persistent_workers":
        loader._iterator._shutdown_workers()  # persistent workers live as long as the loader's iterator


def test_torch_refusals_keep_torchs_words_and_name_the_ddpkit_form():
    dataset = IndexDataset(10)
    cases = [
        ({"sampler": SequentialSampler(dataset), "shuffle": True}, "sampler option is mutually exclusive with shuffle"),
        ({"batch_size": None}, "batch_size=None (torch's unbatched mode) has no global batches"),
        ({"batch_size": 4, "global_batch_size": 8}, "pass one of them"),
        ({"seed": 1, "generator": torch.Generator()}, "seed=1 and generator= were both given"),
        ({"sampler": BatchSampler(SequentialSampler(dataset), 2, False)}, "yields lists, not dataset indices"),
        ({"sampler": SequentialSampler(range(12))}, "yields index 11, but the dataset has 10 samples"),
        ({"sampler": DistributedSampler(dataset, num_replicas=4, rank=1)}, "ddpkit.DataLoader shards by itself"),
    ]
    for arguments, expected in cases:
        with pytest.raises(UserError) as error:
            DataLoader(dataset, **arguments)
        assert expected in _one_line(error)
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):  # torch's own
        DataLoader(dataset, persistent_workers=True)


def _ranks(dataset, world_size, **kwargs):
    return [DataLoader(dataset, rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


@pytest.mark.parametrize("num_samples", [100, 64, 98, 6])
def test_batch_size_per_rank_gives_distributed_samplers_batches_in_count_and_size(num_samples):
    dataset = IndexDataset(num_samples)
    ours = [[len(b) for b in loader] for loader in _ranks(dataset, 2, batch_size=16, shuffle=True)]
    torchs = [
        [
            len(b)
            for b in torch.utils.data.DataLoader(
                dataset, batch_size=16, sampler=DistributedSampler(dataset, num_replicas=2, rank=r, drop_last=True)
            )
        ]
        for r in range(2)
    ]
    assert ours == torchs


def test_batch_size_says_once_that_the_batches_depend_on_the_world_size(caplog):
    with caplog.at_level(logging.INFO, logger="ddpkit"):
        loaders = [DataLoader(IndexDataset(30), batch_size=7, rank=0, world_size=3) for _ in range(2)]
        DataLoader(IndexDataset(30), global_batch_size=21, rank=0, world_size=3)
    lines = [record.getMessage() for record in caplog.records]
    assert lines == [
        "ddpkit.DataLoader: batch_size=7 is per rank (as in torch), so 3 rank(s) make global batches "
        "of 21 and the batches change with the world size; global_batch_size=21 keeps them the same "
        "at any world size"
    ]
    assert loaders[0].global_batch_size == 21 and loaders[0].batch_size == 7


def test_drop_last_leaves_no_incomplete_global_batch():
    for world_size in (1, 2, 3):
        loaders = _ranks(IndexDataset(100), world_size, global_batch_size=24, drop_last=True, shuffle=True)
        steps = list(zip(*loaders, strict=True))
        assert len(steps) == loaders[0].steps_per_epoch == 4
        assert all(sum(len(b) for b in step) == 24 for step in steps)
        assert [i for step in steps for b in step for i in b.tolist()] == epoch_permutation(100, 0, 0)[:96].tolist()


def _train_an_epoch_with_batchnorm(drop_last):
    """2 simulated ranks; 98 samples in global batches of 32: the last global batch has 2, one row a rank."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    features = TensorPairs(98)
    loaders = _ranks(features, 2, batch_size=16, shuffle=True, drop_last=drop_last)
    steps = 0
    for batches in zip(*loaders, strict=True):
        optimizer.zero_grad()
        for loader, (x, y) in zip(loaders, batches, strict=True):
            loader.global_mean(F.mse_loss(model(x), y, reduction="sum")).backward()
        optimizer.step()
        steps += 1
    return steps


class TensorPairs(IndexDataset):
    def __getitem__(self, index):
        return torch.tensor([index / 100.0]), torch.tensor([(index % 3) - 1.0])


def test_a_batchnorm_model_trains_through_an_epoch_with_drop_last():
    assert _train_an_epoch_with_batchnorm(drop_last=True) == 3
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        _train_an_epoch_with_batchnorm(drop_last=False)  # the one row a rank that drop_last avoids


def test_generator_seeds_what_seed_does():
    dataset = IndexDataset(30)
    by_generator = DataLoader(dataset, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(11))
    by_seed = DataLoader(dataset, batch_size=4, shuffle=True, seed=11)
    for epoch in (0, 1):
        by_generator.set_epoch(epoch), by_seed.set_epoch(epoch)
        assert [b.tolist() for b in by_generator] == [b.tolist() for b in by_seed]


def test_loader_sampler_set_epoch_is_the_loaders():
    loader = DataLoader(IndexDataset(30), batch_size=4, shuffle=True, seed=2)
    loader.sampler.set_epoch(3)
    assert loader.epoch == 3
    assert [i for b in loader for i in b.tolist()] == epoch_permutation(30, 2, 3).tolist()
    assert list(loader.sampler) == epoch_permutation(30, 2, 3).tolist() and len(loader.sampler) == 30


def test_a_distributed_sampler_passed_gives_its_shuffle_and_seed_and_its_set_epoch_is_followed():
    dataset = IndexDataset(30)
    samplers = [DistributedSampler(dataset, num_replicas=2, rank=r, shuffle=True, seed=4) for r in range(2)]
    loaders = [DataLoader(dataset, batch_size=3, sampler=samplers[r], rank=r, world_size=2) for r in range(2)]
    for sampler in samplers:
        sampler.set_epoch(2)  # on the user's own reference, as pytorch/examples' imagenet does
    steps = list(zip(*loaders, strict=True))
    assert loaders[0].epoch == 2
    assert [i for step in steps for b in step for i in b.tolist()] == epoch_permutation(30, 4, 2).tolist()
