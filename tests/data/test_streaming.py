"""Streams through ddpkit.DataLoader: sharding, resume, uneven ends; Hugging Face datasets, map-style and streaming.

The first tests simulate ranks (one loader per rank with explicit rank= and
world_size=, no process group). The launched ones run tests/data/scripts/
own_data.py, a user's loop with a Checkpointer, under ``ddpkit run`` with 2
real gloo ranks, all launches of the module forked from one worker server (in
one module fixture): an HF streaming dataset (4 shards, 2 loader workers per
rank) uninterrupted, stopped mid-epoch and resumed at 2 and at 1 rank, and a
stream whose ranks run out at different steps.
"""

from __future__ import annotations

import collections
import os
import random
import shutil

import datasets
import pytest
import torch
from torch.utils.data import IterableDataset

from ddpkit.data.arrow import arrow_batch_reader
from ddpkit.data.loader import DataLoader
from ddpkit.errors import UserError
from tests.data.helpers import OWN_DATA_SCRIPT, read_records
from tests.helpers.launch_in_process import Commands


class Numbers(IterableDataset):
    """0, 1, ..., n - 1; with ``stateful``, the torchdata Stateful protocol (state_dict/load_state_dict)."""

    def __init__(self, n: int):
        self.n, self.next = n, 0

    def __iter__(self):
        start, self.next = self.next, 0  # a loaded position serves one pass
        for i in range(start, self.n):
            self.next = i + 1
            yield i


class StatefulNumbers(Numbers):
    def state_dict(self):
        return {"next": self.next}

    def load_state_dict(self, state):
        self.next = state["next"]


def _samples(loader):
    return [i for batch in loader for i in batch.tolist()]


@pytest.mark.parametrize("world_size,num_workers", [(1, 0), (2, 0), (2, 2), (3, 2)])
def test_a_plain_stream_is_dealt_round_robin_every_sample_to_one_rank(world_size, num_workers):
    per_rank = [
        _samples(DataLoader(Numbers(50), batch_size=3, rank=r, world_size=world_size, num_workers=num_workers))
        for r in range(world_size)
    ]
    assert sorted(i for samples in per_rank for i in samples) == list(range(50))
    stride = world_size * max(num_workers, 1)
    for rank, samples in enumerate(per_rank):  # each of the rank's workers keeps its own residues
        assert {i % stride for i in samples} <= set(range(rank * max(num_workers, 1), (rank + 1) * max(num_workers, 1)))


def test_drop_last_drops_each_workers_incomplete_batch():
    batches = list(DataLoader(Numbers(10), batch_size=4, drop_last=True, num_workers=2))
    assert [len(b) for b in batches] == [4, 4]  # each worker reads 5 of 10: one full batch each


def test_a_stateless_stream_refuses_a_mid_epoch_resume_in_one_line():
    loader = DataLoader(Numbers(20), batch_size=4)
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    with pytest.raises(UserError) as error:
        DataLoader(Numbers(20), batch_size=4).load_state_dict(state)
    message = str(error.value)
    assert "\n" not in message
    assert "saved mid-epoch (epoch 0, step 1) and Numbers has no state_dict()/load_state_dict()" in message
    assert "resume from a checkpoint taken at an epoch's end" in message
    list(batches)  # at an epoch's end the same stream resumes: the next epoch starts over
    resumed = DataLoader(Numbers(20), batch_size=4)
    resumed.load_state_dict(loader.state_dict())
    assert (resumed.epoch, resumed.step_in_epoch) == (1, 0) and _samples(resumed) == list(range(20))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_stateful_stream_resumes_where_the_loop_stopped(num_workers):
    loader = DataLoader(StatefulNumbers(40), batch_size=3, num_workers=num_workers)
    batches = iter(loader)
    taken = [i for _ in range(5) for i in next(batches).tolist()]
    state = loader.state_dict()
    batches.close()  # shuts the workers down now
    resumed = DataLoader(StatefulNumbers(40), batch_size=3, num_workers=num_workers)
    resumed.load_state_dict(state)
    rest = _samples(resumed)
    assert sorted(taken + rest) == list(range(40))
    assert resumed.step_in_epoch == resumed.steps_per_epoch == len(_batches_of(40, 3, num_workers))


def _batches_of(n, batch_size, num_workers):
    """The batches torch's loader makes of a stream of n dealt to num_workers workers (one list each)."""
    shares = [list(range(w, n, max(num_workers, 1))) for w in range(max(num_workers, 1))]
    return [share[k : k + batch_size] for share in shares for k in range(0, len(share), batch_size)]


def test_steps_per_epoch_of_a_stream_is_known_at_its_last_batch():
    loader = DataLoader(Numbers(10), batch_size=4)
    seen = [(loader.step_in_epoch, loader.steps_per_epoch) for _ in loader]
    assert seen == [(1, 2), (2, 3), (3, 3)]  # one batch read ahead: the last one is known as such


def test_hf_map_style_dataset_in_torch_format_on_two_ranks_with_workers():
    rows = datasets.Dataset.from_dict({"x": [[float(i), -float(i)] for i in range(37)], "id": list(range(37))})
    dataset = rows.with_format("torch")
    loaders = [
        DataLoader(dataset, batch_size=4, shuffle=True, seed=5, rank=r, world_size=2, num_workers=2) for r in range(2)
    ]
    steps = list(zip(*loaders, strict=True))
    assert len(steps) == 5  # global batches of 8: 4 full, then 5 rows split 3 + 2
    batch = steps[0][0]
    assert batch["x"].dtype == torch.float32 and batch["x"].shape == (4, 2) and batch["id"].dtype == torch.int64
    ids = [i for step in steps for b in step for i in b["id"].tolist()]
    assert sorted(ids) == list(range(37))
    assert all(torch.equal(b["x"][:, 0], b["id"].float()) for step in steps for b in step)


def test_an_hf_dataset_in_torch_format_is_read_collated_as_default_collate_would_make_it():
    rows = {"x": [[float(i), -float(i)] for i in range(26)], "id": list(range(26)), "name": [str(i) for i in range(26)]}
    dataset = datasets.Dataset.from_dict(rows).with_format("torch")
    for world_size in (2, 4):  # 4: the last global batch of 2 leaves two ranks an empty share
        collated = [
            DataLoader(dataset, global_batch_size=12, shuffle=True, rank=r, world_size=world_size)
            for r in range(world_size)
        ]
        by_rows = [
            DataLoader(
                dataset,
                global_batch_size=12,
                shuffle=True,
                rank=r,
                world_size=world_size,
                collate_fn=torch.utils.data.default_collate,
            )
            for r in range(world_size)
        ]
        assert type(collated[0].dataset).__name__ == "ArrowBatchDataset"
        assert type(by_rows[0].dataset).__name__ == "BatchReadDataset"
        for fast, slow in zip(zip(*collated, strict=True), zip(*by_rows, strict=True), strict=True):
            for a, b in zip(fast, slow, strict=True):
                assert a.keys() == b.keys() and a["name"] == b["name"]
                assert torch.equal(a["x"], b["x"]) and torch.equal(a["id"], b["id"]) and a["x"].shape[1:] == (2,)
    last = list(zip(*[DataLoader(dataset, global_batch_size=12, rank=r, world_size=4) for r in range(4)]))[-1]
    assert [len(b["id"]) for b in last] == [1, 1, 0, 0] and last[3]["x"].shape == (0, 2) and last[3]["name"] == []


def test_columns_of_numbers_are_read_from_arrow_as_hfs_own_formatter_reads_them():
    rows = {
        "pixels": [[i % 256] * 6 for i in range(40)],
        "label": [i % 10 for i in range(40)],
        "weight": [i / 7 for i in range(40)],
        "flag": [i % 2 == 0 for i in range(40)],
    }
    features = datasets.Features(
        {
            "pixels": datasets.Sequence(datasets.Value("uint8"), length=6),
            "label": datasets.ClassLabel(num_classes=10),
            "weight": datasets.Value("float32"),
            "flag": datasets.Value("bool"),
        }
    )
    base = datasets.Dataset.from_dict(rows, features=features)
    indices = [29, 2, 17, 17, 5]
    for dataset in (
        base.with_format("torch"),
        base.shuffle(seed=1).select(range(30)).with_format("torch"),
        base.with_format("torch", columns=["pixels", "label"]),
    ):
        read = arrow_batch_reader(dataset)
        assert read is not None
        fast, hf = read(indices), dataset[indices]
        assert fast.keys() == hf.keys()
        assert all(fast[k].dtype == hf[k].dtype and torch.equal(fast[k], hf[k]) for k in hf)
    strings = datasets.Dataset.from_dict({"text": ["a", "b"]}).with_format("torch")
    assert arrow_batch_reader(strings) is None and arrow_batch_reader(base.with_format("numpy")) is None


def _noisy(batch):
    """An HF transform drawing from torch's global generator, run on the batch HF reads."""
    return {"id": batch["id"], "noise": torch.rand(len(batch["id"])).tolist()}


def test_an_hf_dataset_is_read_a_batch_per_call_with_reproducible_transforms():
    dataset = datasets.Dataset.from_dict({"id": list(range(20))})
    dataset.set_transform(_noisy)
    torch.manual_seed(1)
    expected = torch.rand(3)
    torch.manual_seed(1)
    runs = []
    for _ in range(2):
        loader = DataLoader(dataset, batch_size=4, shuffle=True, seed=3, rank=0, world_size=2)
        runs.append({i: n for batch in loader for i, n in zip(batch["id"].tolist(), batch["noise"].tolist())})
    assert type(loader.dataset).__name__ == "BatchReadDataset"
    assert runs[0] == runs[1] and len(runs[0]) == 10 and len(set(runs[0].values())) == 10
    assert torch.equal(torch.rand(3), expected)  # the loop's own draws are as if no loader ran


# -- two real ranks -----------------------------------------------------------------------------------------


def test_an_hf_streams_epoch_is_told_once_by_the_training_process_not_by_each_worker(monkeypatch) -> None:
    """HF keeps an IterableDataset's epoch in shared memory and its set_epoch adds the difference to it: two
    loader workers calling it at once for epoch 1 made it 2 for one of them, whose shards then differed from the
    other's (one shard read twice in the epoch, another not at all; 1 launch in about 13)."""
    calls = []
    set_epoch = datasets.IterableDataset.set_epoch

    def recorded(self, epoch):
        calls.append((os.getpid(), epoch))  # a worker's append stays in the worker: only this process's are seen
        set_epoch(self, epoch)

    monkeypatch.setattr(datasets.IterableDataset, "set_epoch", recorded)
    rows = {"x": [[float(i)] for i in range(32)], "id": list(range(32))}
    stream = datasets.Dataset.from_dict(rows).to_iterable_dataset(num_shards=4).with_format("torch")
    loader = DataLoader(stream, batch_size=4, num_workers=2, rank=0, world_size=1)
    seen = []
    for epoch in range(2):
        loader.set_epoch(epoch)
        seen.append(sorted(int(i) for batch in loader for i in batch["id"]))
    assert seen == [list(range(32))] * 2  # every sample once per epoch
    assert calls == [(os.getpid(), 0), (os.getpid(), 1)]  # told by this process, once per epoch


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Every launch of this module, on one warm worker server: {name: (completed process, records)}."""
    seed = int(os.environ.get("DDPKIT_TEST_SEED", "0"))
    stop = random.Random(seed).randint(1, 11)  # an HF epoch is 12 global steps (96 rows, 8 per step)
    print(f"DDPKIT_TEST_SEED={seed}: the HF stream stops after global step {stop}")
    folder = tmp_path_factory.mktemp("streaming")
    runs = [
        ("uninterrupted", "nproc=2", "hf-stream", "a", 0),
        ("stopped", "nproc=2", "hf-stream", "b", stop),
        ("resumed", "nproc=2", "hf-stream", "b", 0),
        ("resumed_on_1", "nproc=1", "hf-stream", "c", 0),
        ("uneven", "nproc=2", "uneven", "d", 0),
    ]
    results = {}
    with Commands() as commands:
        for name, nproc, data, run, stop_at in runs:
            if name == "resumed_on_1":  # from the checkpoint the stopped launch wrote
                shutil.copytree(folder / "ckpt-b-at-stop", folder / "ckpt-c")
            env = {"RECORD": str(folder / f"{name}"), "STOP_AT_STEP": str(stop_at)}
            out = commands.run(
                "run",
                nproc,
                "show_ranks=all",  # what every rank says is read
                str(OWN_DATA_SCRIPT),
                "--data",
                data,
                "--out",
                str(folder / f"ckpt-{run}"),
                cwd=folder,
                env=env,
            )
            assert out.returncode == 0, f"{name}:\n{out.stdout}\n{out.stderr}"
            if name == "stopped":
                shutil.copytree(folder / "ckpt-b", folder / "ckpt-b-at-stop")
            results[name] = (out, read_records(folder / name))
    return results, stop


@pytest.mark.slow  # five launches on 2 ranks, in the module's fixture
def test_hf_stream_on_two_ranks_with_two_workers_reads_each_sample_once_per_epoch(launched):
    results, _ = launched
    out, records = results["uninterrupted"]
    counts = collections.Counter(records)
    assert counts == {(epoch, i): 1 for epoch in (0, 1) for i in range(96)}
    assert "batch_size=4 is per rank (as in torch), so 2 rank(s) make global batches of 8" in out.stderr
    assert "done at global step 24" in out.stdout


@pytest.mark.slow  # five launches on 2 ranks, in the module's fixture
def test_hf_stream_stopped_mid_epoch_resumes_at_the_same_world_size_to_the_same_samples(launched):
    results, stop = launched
    stopped, resumed = results["stopped"][1], results["resumed"][1]
    assert len(stopped) == stop * 8
    assert collections.Counter(stopped + resumed) == collections.Counter(results["uninterrupted"][1])
    # The resume line counts (a stream's length is unknown until its end).
    assert f"0 epoch(s) complete and {stop} step(s) of the next" in results["resumed"][0].stderr


@pytest.mark.slow  # five launches on 2 ranks, in the module's fixture
def test_hf_stream_resumed_at_another_world_size_loses_no_sample_and_says_so(launched):
    results, stop = launched
    out, resumed = results["resumed_on_1"]
    assert "saved by 2 rank(s) x 2 worker(s) and this run has 1 x 2" in out.stderr
    assert f"epoch 0 starts over: no sample is lost, the {stop} batch(es) per rank trained before" in out.stderr
    assert collections.Counter(resumed) == {(epoch, i): 1 for epoch in (0, 1) for i in range(96)}


@pytest.mark.slow  # five launches on 2 ranks, in the module's fixture
def test_ranks_whose_streams_end_unevenly_end_the_epoch_together(launched):
    results, _ = launched
    out, records = results["uneven"]
    # Rank 0 has 11 numbers (6 batches of 2), rank 1 has 10 (5 batches): both stop after 5 batches.
    assert "done at global step 10" in out.stdout and out.stdout.count("done at global step 10") == 2
    assert "1 of 2 ranks ran out of stream data after 5 batch(es)" in out.stderr
    for epoch in (0, 1):
        assert sorted(i for e, i in records if e == epoch) == list(range(20))  # not 20: rank 0 had it alone
