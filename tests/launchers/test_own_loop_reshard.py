"""A user's own loop (scripts/own_cnn.py) resumed at another world size and number of DataLoader workers.

One training run in three launches on one checkpoints folder:

    launch 1: nproc=2, num_workers=2, stops after global step k1 (epoch 1)
    launch 2: nproc=1, num_workers=0, resumes at k1, stops after k2 (epoch 2)
    launch 3: nproc=2, num_workers=2, resumes at k2, trains to the end

so it is resumed 2 -> 1 and 1 -> 2 ranks, and 2 -> 0 and 0 -> 2 DataLoader
workers, mid-epoch and across an epoch boundary. Every rank records each
sample it trained on (epoch, index, SHA-1 of the augmented tensor). Over the
three launches, every training sample of every epoch must be trained on
exactly once, with the augmentation an uninterrupted single-process loader
draws for it (computed here, in the test process, with the same
``ddpkit.DataLoader``). k1 and k2 are drawn from ``random.Random(SEED)``.
"""

from __future__ import annotations

import collections
import importlib.util
import random
import re
from pathlib import Path

import ddpkit
from ddpkit.checkpoint.disk.format import read_manifest
from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parent / "scripts" / "own_cnn.py"
SEED = 777
"""Seed of the stopping points."""
EPOCHS = 2


def _own_cnn():
    spec = importlib.util.spec_from_file_location("own_cnn_for_reshard_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _uninterrupted_digests() -> dict[tuple[int, int], str]:
    """(epoch, index) -> digest of the sample an uninterrupted loader hands out, read in this process."""
    own_cnn = _own_cnn()
    loader = ddpkit.DataLoader(
        own_cnn.Augmented(*own_cnn.synthetic_images()),
        global_batch_size=own_cnn.GLOBAL_BATCH_SIZE,
        shuffle=True,
        seed=own_cnn.LOADER_SEED,
        rank=0,
        world_size=1,
    )
    digests = {}
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        for x, _, indices in loader:
            digests.update({(epoch, int(i)): own_cnn.digest(sample) for i, sample in zip(indices, x)})
    assert len(digests) == EPOCHS * own_cnn.NUM_TRAIN
    return digests


def _records(prefix: Path) -> list[tuple[int, int, str]]:
    paths = sorted(prefix.parent.glob(prefix.name + ".*"))  # one file per rank
    lines = [line.split() for path in paths for line in path.read_text().splitlines()]
    return [(int(epoch), int(index), digest) for epoch, index, digest in lines]


def _start(stdout: str, rank: int) -> tuple[int, int, int, bool]:
    found = re.search(rf"rank {rank}: start epoch=(\d+) step_in_epoch=(\d+) global_step=(\d+) resumed=(\w+)", stdout)
    assert found is not None, stdout
    return int(found[1]), int(found[2]), int(found[3]), found[4] == "True"


def test_resume_at_another_world_size_and_num_workers_trains_every_sample_once_with_its_augmentation(tmp_path):
    own_cnn = _own_cnn()
    steps_per_epoch = -(-own_cnn.NUM_TRAIN // own_cnn.GLOBAL_BATCH_SIZE)
    rng = random.Random(SEED)
    k1 = rng.randint(1, steps_per_epoch - 1)
    k2 = rng.randint(steps_per_epoch + 1, 2 * steps_per_epoch - 1)
    print(f"seed {SEED}: stop after global steps {k1} and {k2} of {EPOCHS * steps_per_epoch}")
    launches = [("nproc=2", 2, k1), ("nproc=1", 0, k2), ("nproc=2", 2, 0)]

    outputs = []
    with Commands() as commands:  # in this process, the three launches' workers forked from one worker server
        for n, (nproc, num_workers, stop) in enumerate(launches, 1):
            env = {"RECORD": str(tmp_path / f"launch{n}"), "STOP_AT_STEP": str(stop)}
            out = commands.run(
                "run",
                nproc,
                "show_ranks=all",  # the start lines of every rank are read
                str(SCRIPT),
                "--out",
                str(tmp_path / "ckpt"),
                "--final",
                str(tmp_path / "final.pt"),
                "--num-workers",
                str(num_workers),
                "--every-steps",
                "0",
                cwd=tmp_path,
                env=env,
            )
            assert out.returncode == 0, f"launch {n}:\n{out.stdout}\n{out.stderr}"
            outputs.append(out)

    # Where each launch started, and the warning that the world size changed.
    assert _start(outputs[0].stdout, 0) == (0, 0, 0, False)
    assert _start(outputs[1].stdout, 0) == (0, k1, k1, True)
    assert _start(outputs[2].stdout, 0) == _start(outputs[2].stdout, 1) == (1, k2 - steps_per_epoch, k2, True)
    assert "was written by 2 worker(s) and this run has 1" in outputs[1].stderr
    assert "was written by 1 worker(s) and this run has 2" in outputs[2].stderr
    assert read_manifest(tmp_path / "ckpt" / f"step-{k2:09d}")["world_size"] == 1
    assert (tmp_path / "final.pt").is_file()

    # Every sample of every epoch trained on exactly once, with the uninterrupted run's augmentation.
    records = {n: _records(tmp_path / f"launch{n}") for n in (1, 2, 3)}
    assert len(records[1]) == k1 * own_cnn.GLOBAL_BATCH_SIZE
    assert len(records[2]) == own_cnn.NUM_TRAIN * EPOCHS - len(records[1]) - len(records[3])
    seen = collections.Counter((epoch, index) for launch in records.values() for epoch, index, _ in launch)
    expected = _uninterrupted_digests()
    assert seen.keys() == expected.keys(), sorted(set(expected) ^ set(seen))[:10]
    assert [key for key, count in seen.items() if count != 1] == []
    wrong = [
        (n, epoch, index)
        for n, launch in records.items()
        for epoch, index, digest in launch
        if digest != expected[epoch, index]
    ]
    assert wrong == [], f"{len(wrong)} samples augmented differently from an uninterrupted run, e.g. {wrong[:5]}"
