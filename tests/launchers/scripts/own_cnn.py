"""A user's own training loop on ddpkit's public API, with test hooks for interruptions.

A small CNN with dropout on tiny synthetic 28x28 images (made from a fixed
``torch.Generator`` seed, so every rank and every run has the same data), a
map-style Dataset with a random augmentation in ``__getitem__`` (a shift drawn
with python's ``random`` plus ``torch.rand`` noise), ``ddpkit.DataLoader``,
SGD with momentum + StepLR, ``ddpkit.Checkpointer`` and ``resume("auto")``::

    ddpkit run nproc=2 max_restarts=1 own_cnn.py --out DIR --final final.pt

Arguments:
    --out DIR          the checkpoints folder
    --final PATH       where rank 0 saves the final weights (``torch.save`` of the state_dict)
    --num-workers N    DataLoader worker processes per rank, persistent across epochs (default 2)
    --every-steps N    checkpoint cadence in optimizer steps (default 1; 0: epoch ends and explicit saves only)
    --epochs N         epochs to train (default 2)

Test hooks, read from the environment:
    KILL_AT_STEP=N, KILL_RANK=r, SIGNAL=SIGKILL|SIGTERM (default SIGKILL)
        On the first attempt only (``TORCHELASTIC_RESTART_COUNT`` is "0" and
        nothing was resumed), rank r sends itself SIGNAL right after the
        optimizer step of global step N, before ``ckpt.step()`` counts it.
        SIGKILL: the rank dies; step N was not checkpointed, so a restart
        resumes from step N - 1 (every_steps=1) and computes step N again.
        SIGTERM: the Checkpointer's preemption handler records it; the ranks
        agree on it at a later step, write one checkpoint there and exit 75.
    STOP_AT_STEP=k
        After global step k (counted over all launches), every rank calls
        ``ckpt.save()``, and the program exits 0 without training further.
    RECORD=PREFIX
        Every rank appends one line ``epoch index digest`` per sample it
        trained on to ``PREFIX.<rank>``; digest is the SHA-1 (16 hex digits)
        of the augmented sample tensor's bytes.
"""

import argparse
import hashlib
import os
import random
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

import ddpkit

NUM_TRAIN = 200
"""Training samples: 13 global batches of 16, the last one of 8."""
DATA_SEED = 1234
"""Seed of the synthetic images and labels."""
GLOBAL_BATCH_SIZE = 16
LOADER_SEED = 7
"""The DataLoader's seed: sample order and per-sample augmentation."""


def synthetic_images(num: int = NUM_TRAIN, seed: int = DATA_SEED) -> tuple[torch.Tensor, torch.Tensor]:
    """(images float32 (num, 1, 28, 28) in [0, 1], labels int64 (num,)), a pure function of ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (num,), generator=generator)
    images = torch.rand(num, 1, 28, 28, generator=generator) * 0.5
    # A bright row per class, so that there is something to learn.
    images[torch.arange(num), 0, 2 + 2 * labels] += 0.5
    return images, labels


class Augmented(Dataset):
    """The images shifted by up to 2 pixels and noised, both drawn at random per read."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor):
        self.images, self.labels = images, labels

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        dx, dy = random.randint(-2, 2), random.randint(-2, 2)
        image = torch.roll(self.images[index], shifts=(dy, dx), dims=(1, 2))
        image = image + 0.1 * torch.rand(image.shape)
        return image, self.labels[index], index


def cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 8, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(8 * 13 * 13, 32),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(32, 10),
    )


def digest(sample: torch.Tensor) -> str:
    return hashlib.sha1(sample.contiguous().numpy().tobytes()).hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--every-steps", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    kill_at = int(os.environ.get("KILL_AT_STEP", "0"))
    kill_rank = int(os.environ.get("KILL_RANK", "0"))
    kill_signal = getattr(signal, os.environ.get("SIGNAL", "SIGKILL"))
    stop_at = int(os.environ.get("STOP_AT_STEP", "0"))
    record = os.environ.get("RECORD", "")

    ctx = ddpkit.init()
    torch.manual_seed(0)
    model = ddpkit.prepare_model(cnn())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.8)
    loader = ddpkit.DataLoader(
        Augmented(*synthetic_images()),
        global_batch_size=GLOBAL_BATCH_SIZE,
        shuffle=True,
        seed=LOADER_SEED,
        num_workers=args.num_workers,
        persistent_workers=args.num_workers > 0,
    )
    # sync_seconds: agree on signals every step or two, so that a SIGTERM is acted on within this short run.
    ckpt = ddpkit.Checkpointer(
        args.out,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        every_steps=args.every_steps,
        sync_seconds=0.005,
    )
    start = ckpt.resume("auto")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and not start.resumed
    print(
        f"rank {ctx.rank}: start epoch={start.epoch} step_in_epoch={start.step_in_epoch} "
        f"global_step={start.global_step} resumed={start.resumed}",
        flush=True,
    )
    records = open(f"{record}.{ctx.rank}", "a") if record else None

    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y, indices in loader:
            loss = loader.global_mean(F.cross_entropy(model(x), y, reduction="sum"))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            if records is not None:
                records.writelines(f"{epoch} {int(i)} {digest(sample)}\n" for i, sample in zip(indices, x))
                records.flush()
            if first_attempt and ckpt.global_step + 1 == kill_at and ctx.rank == kill_rank:
                print(f"rank {ctx.rank}: sending myself {kill_signal.name} after step {kill_at}", flush=True)
                os.kill(os.getpid(), kill_signal)
            ckpt.step()
            if stop_at and ckpt.global_step == stop_at:
                path = ckpt.save()
                print(f"rank {ctx.rank}: stopped after global step {stop_at}: {path}", flush=True)
                ckpt.close()
                if records is not None:
                    records.close()
                return

    ckpt.close()
    if records is not None:
        records.close()
    if ctx.is_main_process:
        torch.save(ddpkit.unwrap_model(model).state_dict(), args.final)
        print(f"done after global step {ckpt.global_step}: {args.final}", flush=True)


if __name__ == "__main__":
    main()
