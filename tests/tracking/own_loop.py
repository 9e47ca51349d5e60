"""An own training loop that tracks with ddpkit.Tracker, run by the tests under ``ddpkit run nproc=2``.

A linear classifier on seeded synthetic data; each step logs the loss averaged
over the ranks at the global step (after ``ckpt.step()``, which writes the
epoch-end checkpoint), each epoch the test accuracy at the epoch's last step.
On the first attempt only (restart count 0):

- ``--kill-at STEP``: rank 0 SIGKILLs itself after logging that global step
  (``--pause`` seconds later: W&B writes its offline file every ``flush_seconds``);
- ``--read-only-at STEP``: rank 0 makes the MLflow database read-only after
  logging that step (``chattr +i`` as root, whom file modes do not stop).

    ddpkit run nproc=2 max_restarts=1 tests/tracking/own_loop.py --kind csv --out run --kill-at 15
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

STEPS_PER_EPOCH = 6
GLOBAL_BATCH = 16


def make_read_only(path: Path) -> None:
    """Make ``path`` unwritable, also for root."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(path)], check=True)
    else:
        path.chmod(0o444)


def make_writable(path: Path) -> None:
    """Undo :func:`make_read_only`."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "-i", str(path)], check=True)
    else:
        path.chmod(0o644)


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """Three classes of 8 features around seeded centres: 96 training samples, 48 test samples."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(3, 8, generator=generator) * 2

    def draw(count: int) -> TensorDataset:
        y = torch.randint(0, 3, (count,), generator=generator)
        return TensorDataset(centres[y] + torch.randn(count, 8, generator=generator), y)

    return draw(STEPS_PER_EPOCH * GLOBAL_BATCH), draw(48)


@torch.no_grad()
def accuracy(model: nn.Module, loader: ddpkit.DataLoader) -> float:
    sums = {"correct": torch.zeros(()), "count": torch.zeros(())}
    for x, y in loader:
        sums["correct"] += (model(x).argmax(1) == y).sum()
        sums["count"] += len(y)
    sums = ddpkit.reduce_sums(sums)
    return float(sums["correct"] / sums["count"])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=0)
    parser.add_argument("--pause", type=float, default=0.0)
    parser.add_argument("--read-only-at", type=int, default=0)
    args = parser.parse_args()
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    ctx = ddpkit.init()
    torch.manual_seed(args.seed)
    train_set, test_set = datasets(args.seed)
    model = ddpkit.prepare_model(nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = ddpkit.DataLoader(train_set, global_batch_size=GLOBAL_BATCH, shuffle=True, seed=args.seed)
    test_loader = ddpkit.DataLoader(test_set, global_batch_size=GLOBAL_BATCH, shuffle=False)
    options = {"flush_seconds": 0.2} if args.kind == "wandb" else {}
    tracker = ddpkit.Tracker(
        args.kind,
        args.out / "tracking",
        project="own-loop",
        config={"lr": 0.1, "epochs": args.epochs, "seed": args.seed},
        **options,
    )
    ckpt = ddpkit.Checkpointer(
        args.out / "checkpoints", model=model, optimizer=optimizer, loader=loader, extra={"tracker": tracker}
    )
    start = ckpt.resume("auto")
    if ctx.rank == 0:
        print(
            f"attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}: from global step {start.global_step}",
            flush=True,
        )
    for epoch in range(start.epoch, args.epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()
            tracker.log({"loss": loss}, step=ckpt.global_step, reduce="mean")
            if first_attempt and ctx.rank == 0:
                if ckpt.global_step == args.read_only_at:
                    make_read_only(args.out / "tracking" / "mlflow.db")
                if ckpt.global_step == args.kill_at:
                    time.sleep(args.pause)
                    os.kill(os.getpid(), signal.SIGKILL)
        tracker.log({"test_accuracy": accuracy(model, test_loader)}, step=ckpt.global_step)
    tracker.close({"final_accuracy": accuracy(model, test_loader)})
    ckpt.close()
    ddpkit.shutdown()


if __name__ == "__main__":
    main()
