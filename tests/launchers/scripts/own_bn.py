"""A user's own loop written from the README, as it runs under any launcher, with a kill hook.

DataLoader workers, a CNN with BatchNorm, AdamW with OneCycleLR stepped per
optimizer step, gradient accumulation over two micro-batches (the first
inside ``ddpkit.no_sync``), a Checkpointer with ``resume("auto")``::

    torchrun --nproc-per-node 2 --max-restarts 1 own_bn.py --out DIR --final final.pt
    ddpkit run nproc=2 max_restarts=1 own_bn.py --out DIR --final final.pt

Arguments:
    --out DIR          the checkpoints folder
    --final PATH       where rank 0 saves the final weights (``torch.save`` of the state_dict)
    --num-workers N    DataLoader worker processes per rank (default 2)
    --epochs N         epochs to train (default 2)

Test hook, from the environment:
    KILL_AT_STEP=N, KILL_RANK=r
        In the first round of workers (``TORCHELASTIC_RESTART_COUNT`` is
        "0" and nothing was resumed), rank r sends itself SIGKILL right after
        the optimizer step of global step N, before ``ckpt.step()`` counts
        it: a restart resumes from the checkpoint of step N - 1.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit

NUM_TRAIN = 192
"""Training samples: 12 global batches of 16 an epoch, 6 optimizer steps of 2 micro-batches."""
GLOBAL_BATCH_SIZE = 16
MICRO_BATCHES = 2
"""Micro-batches per optimizer step."""


class Noisy(Dataset):
    """Fixed synthetic 12x12 images with noise drawn at random per read (seeded per sample by ddpkit)."""

    def __init__(self, num: int, seed: int = 1234):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (num,), generator=generator)
        self.images = torch.rand(num, 1, 12, 12, generator=generator) * 0.5
        self.images[torch.arange(num), 0, 2 + 2 * self.labels] += 0.5  # a bright row per class

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index] + 0.1 * torch.rand(1, 12, 12), self.labels[index]


def network() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(8 * 5 * 5, 32),
        nn.BatchNorm1d(32),
        nn.ReLU(),
        nn.Linear(32, 4),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    kill_rank = int(os.environ.get("KILL_RANK", "1"))

    ctx = ddpkit.init()
    torch.manual_seed(0)
    model = ddpkit.prepare_model(network())
    steps_per_epoch = NUM_TRAIN // GLOBAL_BATCH_SIZE // MICRO_BATCHES
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.01, total_steps=args.epochs * steps_per_epoch)
    loader = ddpkit.DataLoader(
        Noisy(NUM_TRAIN), global_batch_size=GLOBAL_BATCH_SIZE, shuffle=True, seed=5, num_workers=args.num_workers
    )
    ckpt = ddpkit.Checkpointer(
        args.out, model=model, optimizer=optimizer, scheduler=scheduler, loader=loader, every_steps=1
    )
    start = ckpt.resume("auto")
    first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and not start.resumed
    print(
        f"rank {ctx.rank}: start epoch={start.epoch} global_step={start.global_step} resumed={start.resumed}",
        flush=True,
    )

    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)
        batches = iter(loader)
        for first in batches:
            optimizer.zero_grad()
            with ddpkit.no_sync(model):
                loader.global_mean(F.cross_entropy(model(first[0]), first[1], reduction="sum")).backward()
            x, y = next(batches)
            loader.global_mean(F.cross_entropy(model(x), y, reduction="sum")).backward()
            optimizer.step()
            scheduler.step()
            if first_round and ckpt.global_step + 1 == kill_at and ctx.rank == kill_rank:
                print(f"rank {ctx.rank}: sending myself SIGKILL after step {kill_at}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            ckpt.step()

    ckpt.close()
    if ctx.is_main_process:
        torch.save(ddpkit.unwrap_model(model).state_dict(), args.final)
        print(f"done after global step {ckpt.global_step}: {args.final}", flush=True)


if __name__ == "__main__":
    main()
