"""W1 written as a user's own loop with ddpkit's public API: the T6 and T7 rows of ``ddpkit bench train``.

Run as one worker (``python -m ddpkit.bench.own_loop key=value ...``) or under
any launcher (``ddpkit run nproc=2 -m ddpkit.bench.own_loop ...``); rank 0
prints one JSON line with the train time, the samples per second and the
test accuracy. The data path is chosen by ``loader=``:

- ``tensors``: ``ddpkit.DataLoader`` over a TensorDataset in memory (its
  batched fast path), with ``prepare_model`` and a ``Checkpointer`` (T6:
  against the bare loop);
- ``samples``: ``ddpkit.DataLoader`` over a per-sample map-style Dataset with
  ``num_workers`` DataLoader workers (T7);
- ``torch``: the same Dataset through torch's DataLoader with a
  DistributedSampler and the per-rank batch, the usual recipe (T7's baseline).

Everything else (model, optimizer, gradient sync, batches per step) is the same.
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, DistributedSampler, TensorDataset

import ddpkit
from ddpkit.data.datasets import DataOptions, load_images
from ddpkit.keyvalue import check_choice, parse
from ddpkit.models.registry import get_model_spec

LOADERS = ("tensors", "samples", "torch")


@dataclasses.dataclass
class OwnLoopConfig:
    """Options of the own-loop benchmark (key=value)."""

    loader: str = "tensors"
    """tensors, samples or torch (see the module docstring)."""
    dataset: str = "fashion-mnist"
    """Built-in image dataset."""
    synthetic_samples: int = 60000
    """Training samples of dataset=synthetic."""
    epochs: int = 5
    """Epochs to train."""
    batch_size: int = 64
    """Global batch."""
    lr: float = 1e-3
    """Adam's learning rate."""
    num_workers: int = 2
    """DataLoader workers for loader=samples and loader=torch."""
    threads: int = 0
    """Torch threads per worker (0: the cores shared among local workers)."""
    seed: int = 0
    """Seed of the model and the sample order."""

    def __post_init__(self) -> None:
        check_choice("loader", self.loader, LOADERS)


class PerSampleImages(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """One image at a time, pixels scaled to [0, 1], as a textbook Dataset does it."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.images[i].float().div_(255.0), self.labels[i]


def _loaders(cfg: OwnLoopConfig, ctx: Any, data: Any) -> tuple[Any, Any]:
    train_x, train_y = data.train_images, data.train_labels
    test = TensorDataset(data.test_images.float().div_(255.0), data.test_labels)
    test_loader = ddpkit.DataLoader(test, global_batch_size=2000 * ctx.world_size, shuffle=False)
    if cfg.loader == "tensors":
        train = TensorDataset(train_x.float().div_(255.0), train_y)
        return ddpkit.DataLoader(train, global_batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed), test_loader
    dataset = PerSampleImages(train_x, train_y)
    if cfg.loader == "samples":
        return ddpkit.DataLoader(
            dataset,
            global_batch_size=cfg.batch_size,
            shuffle=True,
            seed=cfg.seed,
            num_workers=cfg.num_workers,
            persistent_workers=cfg.num_workers > 0,
        ), test_loader
    sampler: DistributedSampler[Any] = DistributedSampler(
        dataset, num_replicas=ctx.world_size, rank=ctx.rank, shuffle=True, seed=cfg.seed
    )
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_size=cfg.batch_size // ctx.world_size,
        sampler=sampler,
        num_workers=cfg.num_workers,
        persistent_workers=cfg.num_workers > 0,
    )
    return loader, test_loader


@torch.no_grad()
def _accuracy(model: torch.nn.Module, loader: Any) -> float:
    model.eval()
    sums = {"correct": 0, "count": 0}
    for x, y in loader:
        sums["correct"] += (model(x).argmax(1) == y).sum()
        sums["count"] += len(y)
    totals = ddpkit.reduce_sums(sums)
    model.train()
    accuracy: float = totals["correct"] / totals["count"]
    return accuracy


def own_loop(cfg: OwnLoopConfig) -> dict[str, Any] | None:
    """Train W1 with the public API; return the result on rank 0 (None elsewhere)."""
    ctx = ddpkit.init(threads=cfg.threads)
    with ddpkit.main_process_first():
        data = load_images(cfg.dataset, DataOptions(synthetic_samples=cfg.synthetic_samples, seed=cfg.seed))
    torch.manual_seed(cfg.seed)
    model = ddpkit.prepare_model(get_model_spec("mlp").build())
    optimizer = torch.optim.Adam(model.parameters(), lr=cfg.lr, fused=True)
    loader, test_loader = _loaders(cfg, ctx, data)
    samples = 0
    with tempfile.TemporaryDirectory(prefix="ddpkit-own-loop-") as folder:
        ckpt = ddpkit.Checkpointer(
            folder,
            model=model,
            optimizer=optimizer,
            preempt_signals=(),
            loader=loader if cfg.loader != "torch" else None,
        )
        start = time.perf_counter()
        for epoch in range(cfg.epochs):
            loader.sampler.set_epoch(epoch) if cfg.loader == "torch" else loader.set_epoch(epoch)
            for x, y in loader:
                loss = F.cross_entropy(model(x), y)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                ckpt.step()
                samples += len(y)
            ckpt.epoch_end()
        train_time = time.perf_counter() - start - ckpt.save_seconds
        ckpt.close()
    accuracy = _accuracy(model, test_loader)
    total = ddpkit.reduce_sums({"samples": samples})["samples"]
    if ctx.rank != 0:
        return None
    return {
        "loader": cfg.loader,
        "world_size": ctx.world_size,
        "train_time_s": round(train_time, 4),
        "samples_per_s": round(total / train_time, 1),
        "test_accuracy": accuracy,
    }


if __name__ == "__main__":
    import sys

    result = own_loop(parse(OwnLoopConfig, sys.argv[1:]))
    if result is not None:
        print(json.dumps(result), flush=True)
