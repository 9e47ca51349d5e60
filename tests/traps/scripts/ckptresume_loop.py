"""Loops ported from public scripts with a ddpkit.Checkpointer, for the resume traps of tests/traps/test_ckptresume.py.

    ddpkit run nproc=2 ckptresume_loop.py --shape SHAPE --out DIR --final final.pt

Shapes:
    torch_loader  pytorch/examples' DCGAN: torch's DataLoader over a DistributedSampler given as loader=,
                  no epoch_end(), noise drawn per batch, an `if i % 3 == 0` block on the batch counter
                  (ckpt.enumerate), a StepLR stepped after each epoch's batch loop; every_steps=1
    no_epochs     a loop that draws its own batches, no loader, no epoch_end(), every_steps=EVERY (default 5),
                  STEPS steps, then ckpt.close()
    best          torch_loader's loop with best_metric="accuracy" and no epoch_end()
    plain_enumerate  torch_loader's loop counting with the builtin enumerate(loader), not ckpt.enumerate
    before_init   the Checkpointer made before ddpkit.init()

Test hook: KILL_AT_STEP=n: on the first attempt (TORCHELASTIC_RESTART_COUNT=0), rank 1 sends itself SIGKILL
after the optimizer step of global step n, before ckpt.step() counts it.
At the end rank 0 saves the model's state_dict to --final.
"""

import argparse
import os
import signal

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import ddpkit

NUM_TRAIN, BATCH, EPOCHS = 40, 4, 3
"""5 batches of 4 per rank and epoch at 2 ranks."""


def network() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 2))


def maybe_kill(step: int, rank: int) -> None:
    if os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0" and step == int(os.environ.get("KILL_AT_STEP", "0")):
        if rank == 1:
            print(f"rank {rank}: sending myself SIGKILL after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


def epochs_loop(args, ctx, best_metric: str = "") -> tuple[nn.Module, ddpkit.Checkpointer]:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(NUM_TRAIN, 8, generator=generator)
    dataset = TensorDataset(x, (x[:, :3].sum(1) > 0).long())
    sampler = DistributedSampler(dataset, shuffle=True, seed=3)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    torch.manual_seed(0)
    model = ddpkit.prepare_model(network())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    ckpt = ddpkit.Checkpointer(
        args.out,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        loader=loader,
        every_steps=1,
        best_metric=best_metric,
    )
    start = ckpt.resume("auto")
    print(f"rank {ctx.rank}: start epoch={start.epoch} step_in_epoch={start.step_in_epoch}", flush=True)
    for epoch in range(start.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for i, (xb, yb) in (enumerate if args.shape == "plain_enumerate" else ckpt.enumerate)(loader):
            noise = 0.1 * torch.randn_like(xb)  # DCGAN draws its noise per batch
            loss = F.cross_entropy(model(xb + noise), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if i % 3 == 0:  # DCGAN's `if i % 100 == 0` block, which here moves the weights
                with torch.no_grad():
                    for p in model.parameters():
                        p.mul_(0.99)
            maybe_kill(ckpt.global_step + 1, ctx.rank)
            ckpt.step()
        scheduler.step()  # per epoch, after the batch loop
    return model, ckpt


def no_epochs_loop(args, ctx) -> tuple[nn.Module, ddpkit.Checkpointer]:
    torch.manual_seed(0)
    model = ddpkit.prepare_model(network())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ckpt = ddpkit.Checkpointer(args.out, model=model, optimizer=optimizer, every_steps=args.every)
    start = ckpt.resume("auto")
    for _ in range(start.global_step, args.steps):
        xb = torch.randn(BATCH, 8)
        loss = F.cross_entropy(model(xb), (xb[:, 0] > 0).long())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ckpt.step()
    return model, ckpt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--final", required=True)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--steps", type=int, default=22)
    args = parser.parse_args()
    if args.shape == "before_init":
        ddpkit.Checkpointer(args.out, model=network())
    ctx = ddpkit.init()
    if args.shape == "no_epochs":
        model, ckpt = no_epochs_loop(args, ctx)
    else:
        model, ckpt = epochs_loop(args, ctx, "accuracy" if args.shape == "best" else "")
    ckpt.close()
    if ctx.is_main_process:
        torch.save(ddpkit.unwrap_model(model).state_dict(), args.final)
        print(f"done after global step {ckpt.global_step}", flush=True)


if __name__ == "__main__":
    main()
