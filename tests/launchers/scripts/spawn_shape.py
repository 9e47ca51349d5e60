"""A script in the shape of pytorch/examples' ``ddp-tutorial-series/multigpu.py`` (mp.spawn), ported to ddpkit.launch.

The tutorial's shape::

    def main(rank, world_size, save_every, total_epochs, batch_size):
        ddp_setup(rank, world_size)             # MASTER_ADDR, MASTER_PORT, init_process_group
        ...
        destroy_process_group()

    if __name__ == "__main__":
        mp.spawn(main, args=(world_size, args.save_every, args.total_epochs, args.batch_size), nprocs=world_size)

ported as the README says ("From Python and notebooks"): ``main`` loses its
``rank`` and ``world_size`` (``ddpkit.init()`` gives them) and its set-up,
and ``mp.spawn(main, args=(...), nprocs=N)`` becomes
``ddpkit.launch(main, ..., nproc=N)``. W1 (MLP 784-50-ReLU-10, Adam 1e-3,
global batch 64) on synthetic Fashion-MNIST-shaped data, resumable with a
Checkpointer and ddpkit.DataLoader.

Kill hook, from the environment, in a run that did not resume: after global
step ``STOP_AT_STEP``, rank 0 sends ``STOP_SIGNAL`` (SIGINT: Ctrl-C;
SIGKILL) to the launcher, the process that forked it.

At the end rank 0 saves the model's weights to ``--final``.
"""

import argparse
import os
import signal
import sys

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit
from ddpkit.datasets import DataOptions, load_images


def main(save_every: int, total_epochs: int, out: str, final: str, samples: int) -> int:
    ctx = ddpkit.init()  # was: ddp_setup(rank, world_size); rank is ctx.rank
    torch.manual_seed(0)
    train_set, _ = load_images("synthetic", DataOptions(synthetic_samples=samples)).datasets()
    model = ddpkit.prepare_model(nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10)))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loader = ddpkit.DataLoader(train_set, global_batch_size=64, shuffle=True, seed=0)
    ckpt = ddpkit.Checkpointer(out, model=model, optimizer=optimizer, loader=loader, every_steps=save_every)
    start = ckpt.resume("auto")
    stop_at = int(os.environ.get("STOP_AT_STEP", "0")) if start.global_step == 0 else 0
    step = start.global_step
    for epoch in range(start.epoch, total_epochs):
        loader.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()
            step += 1
            if ctx.rank == 0 and step == stop_at:
                print(f"stopping the launcher at step {step} (epoch {epoch})", flush=True)
                os.kill(os.getppid(), getattr(signal, os.environ.get("STOP_SIGNAL", "SIGINT")))
        if ctx.rank == 0:
            print(f"epoch {epoch} done: loss {loss.item():.4f}", flush=True)
    ckpt.close()
    if ctx.rank == 0:
        torch.save(ddpkit.unwrap_model(model).state_dict(), final)
    return step


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--save-every", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=2048)
    parser.add_argument("--out", default="runs/spawn-shape")
    parser.add_argument("--final", default="final.pt")
    args = parser.parse_args()
    try:
        # was: mp.spawn(main, args=(world_size, args.save_every, ...), nprocs=world_size)
        steps = ddpkit.launch(main, args.save_every, args.epochs, args.out, args.final, args.samples, nproc=args.nproc)
    except KeyboardInterrupt:
        print("interrupted: run the same command again to continue", file=sys.stderr)
        sys.exit(130)
    print(f"done: {steps[0]} steps on each of {args.nproc} ranks")
