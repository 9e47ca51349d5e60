"""``ddpkit train dataset=mymod:build model=mymod:net`` on data the user has in files.

A user's module (written by the test into the run's folder, which is the
current folder of ``python -m ddpkit train``) reads:

- a folder of 8x8 PNG images of two classes (bright, dark) with Pillow:
  classification trains, writes checkpoints, and ``resume=auto`` on the
  finished run continues fine (nproc=2);
- a CSV of y = 3*x1 - 2*x2 + noise: regression reaches an MSE far below the
  target's variance, and ``resume=auto`` with more epochs continues from the
  checkpoint (nproc=1).

Both datasets hand over raw values (pixels 0..255, a constant feature of
1000.0) and both models record the largest input they see: ddpkit must not
rescale a user's inputs. Every random choice is seeded by SEED.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tests.helpers.launch_in_process import Commands

SEED = 8675309
"""Seed of the images and of the CSV rows."""

MYMOD = '''
"""The user's data and models: PNG classes in folders, and a CSV."""

import csv
import os
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset


class PngFolder(Dataset):
    """folder/<class>/<name>.png, read with Pillow, as raw float pixels (no division by 255)."""

    def __init__(self, folder):
        self.files = sorted(Path(folder).glob("*/*.png"))

    def __len__(self):
        return len(self.files)

    def __getitem__(self, index):
        path = self.files[index]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert("L"), dtype=np.float32)
        return torch.from_numpy(pixels).unsqueeze(0), int(path.parent.name)


class CsvRows(Dataset):
    """Columns x1, x2, x3, y; the input is (x1, x2, x3) as written."""

    def __init__(self, path, rows):
        with open(path, newline="") as f:
            table = [[float(v) for v in row] for row in list(csv.reader(f))[1:]]
        self.rows = torch.tensor(table, dtype=torch.float32)[rows]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, index):
        row = self.rows[index]
        return row[:3], row[3:]


def build_images():
    return PngFolder("data/train"), PngFolder("data/test")


def build_table():
    return CsvRows("data/table.csv", slice(0, 160)), CsvRows("data/table.csv", slice(160, None))


class RecordsInputs(nn.Module):
    """Writes the largest training input value seen so far to input_max.<pid> (one file per worker)."""

    def __init__(self, inner, scale=1.0, features=None):
        super().__init__()
        self.inner, self.scale, self.features = inner, scale, features
        self.largest = float("-inf")

    def forward(self, x):
        if self.training and x.numel() and x.max().item() > self.largest:
            self.largest = x.max().item()
            Path(f"input_max.{os.getpid()}").write_text(repr(self.largest))
        if self.features is not None:
            x = x[:, : self.features]
        return self.inner(x / self.scale)


def image_net():
    return RecordsInputs(nn.Sequential(nn.Flatten(), nn.Linear(64, 2)), scale=255.0)


def table_net():
    return RecordsInputs(nn.Linear(2, 1), features=2)
'''


def _write_images(folder: Path, rng: np.random.Generator, per_class: int) -> None:
    for label, (low, high) in enumerate([(0, 100), (155, 256)]):  # 0: dark, 1: bright
        (folder / str(label)).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(low, high, size=(8, 8), dtype=np.uint8)
            if label == 1:
                pixels[0, 0] = 255  # every bright image holds the largest raw value
            Image.fromarray(pixels).save(folder / str(label) / f"{i:03d}.png")


def _write_table(path: Path, rng: np.random.Generator, rows: int = 200) -> float:
    """The CSV; returns the variance of y over the test rows (160 on)."""
    x = rng.normal(size=(rows, 2))
    y = 3 * x[:, 0] - 2 * x[:, 1] + 0.1 * rng.normal(size=rows)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["x1", "x2", "x3", "y"])
        writer.writerows([a, b, 1000.0, c] for (a, b), c in zip(x, y))
    return float(np.var(y[160:]))


def _train(commands: Commands, folder: Path, *words: str):
    return commands.run("train", *words, "progress=false", "output_dir=out", cwd=folder)


def _summary(folder: Path) -> dict:
    return json.loads((folder / "out" / "summary.json").read_text())


def _input_max(folder: Path) -> list[float]:
    return sorted(float(path.read_text()) for path in folder.glob("input_max.*"))


def _checkpoints(folder: Path, prefix: str = "step-") -> list[str]:
    folders = (folder / "out" / "checkpoints").glob(prefix + "*")
    return sorted(path.name for path in folders if (path / "manifest.json").is_file())


IMAGE_WORDS = (
    "dataset=mymod:build_images",
    "model=mymod:image_net",
    "task=classification",
    "nproc=2",
    "epochs=3",
    "batch_size=8",
    "optimizer=sgd",
    "lr=0.5",
)
TABLE_WORDS = (
    "dataset=mymod:build_table",
    "model=mymod:table_net",
    "task=regression",
    "nproc=1",
    "batch_size=16",
    "optimizer=sgd",
    "lr=0.1",
)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every ``ddpkit train`` of this module, in this process (as ``python -m ddpkit train`` in the data's folder
    runs it, the folder importable), the nproc=2 ones' workers forked from one worker server.

    By name, a dict of: folder, out (the command's result), summary and checkpoints (step-*, best-*) right after
    it; and for the second command on the same folder, again, summary_again, checkpoints_again:

    - images: classification on the PNG folder, nproc=2, 3 epochs; again: the same words with resume=auto;
    - table: regression on the CSV, nproc=1, 2 epochs; again: epochs=4 and resume=auto; and variance,
      the variance of the test targets.
    """
    images = tmp_path_factory.mktemp("images")
    print(f"seed {SEED}: PNG images")
    rng = np.random.default_rng(SEED)
    _write_images(images / "data" / "train", rng, per_class=20)
    _write_images(images / "data" / "test", rng, per_class=8)
    (images / "mymod.py").write_text(MYMOD)

    table = tmp_path_factory.mktemp("table")
    print(f"seed {SEED}: CSV rows")
    (table / "data").mkdir()
    variance = _write_table(table / "data" / "table.csv", np.random.default_rng(SEED))
    (table / "mymod.py").write_text(MYMOD)

    results = {"images": {"folder": images}, "table": {"folder": table, "variance": variance}}
    commands_of = {
        "images": (IMAGE_WORDS, (*IMAGE_WORDS, "resume=auto")),
        "table": ((*TABLE_WORDS, "epochs=2"), (*TABLE_WORDS, "epochs=4", "resume=auto")),
    }
    with Commands() as commands:
        for name, (first, second) in commands_of.items():
            result, folder = results[name], results[name]["folder"]
            for words, suffix in ((first, ""), (second, "_again")):
                result["out" if not suffix else "again"] = out = _train(commands, folder, *words)
                if out.returncode == 0:
                    result["summary" + suffix] = _summary(folder)
                result["checkpoints" + suffix] = (_checkpoints(folder), _checkpoints(folder, "best-"))
    return results


@pytest.fixture(scope="module")
def image_run(runs):
    """The classification run on the PNG folder, nproc=2, and its resume=auto (see ``runs``)."""
    run = runs["images"]
    assert run["out"].returncode == 0, run["out"].stdout + run["out"].stderr
    return run


@pytest.fixture(scope="module")
def table_run(runs):
    """The regression run on the CSV, nproc=1, and its resume=auto with more epochs (see ``runs``)."""
    run = runs["table"]
    assert run["out"].returncode == 0, run["out"].stdout + run["out"].stderr
    return run


def test_png_folder_classification_trains_and_writes_checkpoints(image_run):
    summary = image_run["summary"]
    assert (summary["task"], summary["world_size"], summary["epochs"], summary["global_steps"]) == (
        "classification",
        2,
        3,
        15,
    )
    assert summary["test"]["accuracy"] > 0.75  # chance is 0.5
    steps, best = image_run["checkpoints"]
    assert steps == ["step-000000010", "step-000000015"]  # keep=2, one per epoch
    assert len(best) == 1


def test_resume_auto_on_a_finished_run_continues_fine(image_run):
    again = image_run["again"]
    assert again.returncode == 0, again.stdout + again.stderr
    assert re.search(r"resumed from \S+step-000000015 \(global step 15: 3 epoch\(s\) complete\)", again.stderr), (
        again.stderr
    )
    assert "this run is finished: all 3 epochs are complete; nothing to train" in again.stderr, again.stderr
    summary = image_run["summary_again"]
    assert summary["global_steps"] == 15 and summary["epochs"] == 3
    assert summary["test"] == image_run["summary"]["test"]  # nothing left to train: the same weights, evaluated again
    assert image_run["checkpoints_again"][0] == ["step-000000010", "step-000000015"]


def test_csv_regression_trains_and_resumes_with_more_epochs(table_run):
    summary, variance = table_run["summary"], table_run["variance"]
    assert (summary["task"], summary["world_size"], summary["global_steps"]) == ("regression", 1, 20)
    assert summary["test"]["mse"] < 0.05 * variance, (summary["test"], variance)
    assert table_run["checkpoints"][0] == ["step-000000010", "step-000000020"]

    more = table_run["again"]
    assert more.returncode == 0, more.stdout + more.stderr
    assert re.search(r"resumed from \S+step-000000020 \(global step 20: 2 epoch\(s\) complete\)", more.stderr), (
        more.stderr
    )
    continued = table_run["summary_again"]
    assert (continued["global_steps"], continued["epochs"]) == (40, 4)
    assert continued["test"]["mse"] < 0.05 * variance
    assert table_run["checkpoints_again"][0] == ["step-000000030", "step-000000040"]


def test_inputs_reach_the_model_unscaled(image_run, table_run):
    # Every bright image holds a pixel of 255, every row the feature 1000.0: what the user's Dataset
    # returns is what the model trains on, on every worker (one file each).
    images, table = image_run["folder"], table_run["folder"]
    assert _input_max(images) == [255.0, 255.0]  # nproc=2; the resumed run had nothing left to train
    assert set(_input_max(table)) == {1000.0}
