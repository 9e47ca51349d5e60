"""A torch Sampler as ddpkit.DataLoader's order: drawn from (seed, epoch), sharded, resumed at any world size.

The first tests simulate ranks (one loader per rank with explicit rank= and
world_size=). The launched ones run tests/data/scripts/own_data.py with a
WeightedRandomSampler, drop_last=True and a BatchNorm model under ``ddpkit
run`` with 2 real gloo ranks: stopped mid-epoch, then resumed at 2 and at 1
rank, from one worker server (one module fixture).
"""

from __future__ import annotations

import collections
import importlib.util
import os
import random
import shutil

import numpy as np
import pytest
import torch
from torch.utils.data import Sampler, WeightedRandomSampler

from ddpkit.data.loader import DataLoader
from ddpkit.data.order import epoch_seed
from ddpkit.errors import UserError
from tests.data.helpers import OWN_DATA_SCRIPT, IndexDataset, read_records
from tests.helpers.launch_in_process import Commands


def _draw(sampler, seed, epoch):
    """The sampler's draw for ``epoch`` as the loader documents it: its generator seeded from (seed, epoch)."""
    sampler.generator.manual_seed(epoch_seed(seed, epoch))
    return list(sampler)


def _weighted(num_draws=45):
    return WeightedRandomSampler(1.0 + torch.arange(30) % 4, num_draws, replacement=True, generator=torch.Generator())


def _ranks(world_size, **kwargs):
    return [DataLoader(IndexDataset(30), rank=r, world_size=world_size, **kwargs) for r in range(world_size)]


def _global_order(steps):
    return [i for step in steps for batch in step for i in batch.tolist()]


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_ranks_together_take_the_samplers_draw_of_each_epoch(world_size):
    loaders = _ranks(world_size, global_batch_size=6, sampler=_weighted(), seed=8)
    for epoch in (0, 1, 4):
        for loader in loaders:
            loader.set_epoch(epoch)
        assert _global_order(zip(*loaders, strict=True)) == _draw(_weighted(), 8, epoch)
    assert _draw(_weighted(), 8, 0) != _draw(_weighted(), 8, 1)


@pytest.mark.parametrize("after", [2, 3, 1])
def test_stopped_mid_epoch_every_remaining_draw_is_trained_once_at_any_world_size(after):
    loaders = _ranks(2, global_batch_size=6, sampler=_weighted(), seed=8)
    for loader in loaders:
        loader.set_epoch(1)
    iterators = [iter(loader) for loader in loaders]
    taken = [[next(it) for it in iterators] for _ in range(3)]
    state = loaders[0].state_dict()
    resumed = _ranks(after, global_batch_size=6, sampler=_weighted(), seed=8)
    for loader in resumed:
        loader.load_state_dict(state)
        loader.set_epoch(1)
    assert _global_order(taken) + _global_order(zip(*resumed, strict=True)) == _draw(_weighted(), 8, 1)


def test_the_loops_random_draws_are_as_if_no_sampler_ran():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    expected = torch.rand(3).tolist(), random.random(), np.random.rand()
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    loader = DataLoader(IndexDataset(30), batch_size=4, sampler=_weighted(), seed=8)
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        list(loader)
    assert (torch.rand(3).tolist(), random.random(), np.random.rand()) == expected


class Unseeded(Sampler[int]):
    """Draws from a generator of its own that nobody seeds: no resume could repeat its order."""

    def __init__(self):
        self.rng = np.random.default_rng()

    def __len__(self):
        return 30

    def __iter__(self):
        return iter(self.rng.permutation(30).tolist())


class LengthGrouped(Sampler[int]):
    """A user's own sampler with set_epoch and torch's global generator: long samples together, shuffled groups."""

    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return 30

    def __iter__(self):
        groups = torch.arange(30).view(5, 6)[torch.randperm(5)]
        return iter(groups.flatten().tolist())


def test_a_sampler_whose_order_cannot_be_repeated_is_refused_in_one_line():
    with pytest.raises(UserError) as error:
        DataLoader(IndexDataset(30), batch_size=4, sampler=Unseeded())
    message = str(error.value)
    assert "\n" not in message
    assert "sampler=Unseeded draws a different order twice from the same seeds" in message


def test_a_users_sampler_on_torchs_generator_is_reproducible():
    orders = [
        [i for b in DataLoader(IndexDataset(30), batch_size=6, sampler=LengthGrouped(), seed=1) for i in b.tolist()]
        for _ in range(2)
    ]
    assert orders[0] == orders[1] and sorted(orders[0]) == list(range(30))


# -- two real ranks -----------------------------------------------------------------------------------------


def _own_data():
    spec = importlib.util.spec_from_file_location("own_data_for_sampler_test", OWN_DATA_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """A weighted run on 2 ranks stopped mid-epoch, then resumed on 2 and on 1 rank: {name: (process, records)}."""
    seed = int(os.environ.get("DDPKIT_TEST_SEED", "0"))
    stop = random.Random(seed).randint(1, 6)  # an epoch is 7 global steps (58 draws, 8 a step, drop_last)
    print(f"DDPKIT_TEST_SEED={seed}: the weighted run stops after global step {stop}")
    folder = tmp_path_factory.mktemp("weighted")
    results = {}
    with Commands() as commands:
        for name, nproc, checkpoints, stop_at in (
            ("stopped", "nproc=2", "a", stop),
            ("resumed", "nproc=2", "a", 0),
            ("resumed_on_1", "nproc=1", "b", 0),
        ):
            env = {"RECORD": str(folder / name), "STOP_AT_STEP": str(stop_at)}
            out = commands.run(
                "run",
                nproc,
                "show_ranks=all",  # what every rank says is read
                str(OWN_DATA_SCRIPT),
                "--data",
                "weighted",
                "--out",
                str(folder / f"ckpt-{checkpoints}"),
                cwd=folder,
                env=env,
            )
            assert out.returncode == 0, f"{name}:\n{out.stdout}\n{out.stderr}"
            if name == "stopped":
                shutil.copytree(folder / "ckpt-a", folder / "ckpt-b")
            results[name] = (out, read_records(folder / name))
    return results, stop


def _expected_draws() -> collections.Counter:
    """Every (epoch, index) the weighted sampler draws in 2 epochs, the incomplete last global batch left out."""
    own_data = _own_data()
    draws = collections.Counter()
    for epoch in (0, 1):
        drawn = _draw(own_data.weighted_sampler(), own_data.WEIGHTED_SEED, epoch)
        draws.update((epoch, index) for index in drawn[: len(drawn) // 8 * 8])
    return draws


def test_weighted_sampler_on_two_ranks_is_trained_as_drawn_after_a_stop_at_the_same_world_size(launched):
    results, stop = launched
    stopped, resumed = results["stopped"][1], results["resumed"][1]
    assert len(stopped) == stop * 8
    assert collections.Counter(stopped + resumed) == _expected_draws()
    assert "done at global step 14" in results["resumed"][0].stdout  # BatchNorm trained through both epochs


def test_weighted_sampler_resumed_on_one_rank_trains_every_remaining_draw_once(launched):
    results, stop = launched
    out, resumed = results["resumed_on_1"]
    assert "was written by 2 worker(s) and this run has 1" in out.stderr
    assert len(resumed) == (14 - stop) * 8
    assert collections.Counter(results["stopped"][1] + resumed) == _expected_draws()
