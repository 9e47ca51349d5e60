"""A training loop that runs until it is killed, for the tests of what outlives a killed launcher.

``ddpkit run nproc=2 launcher_forever.py FOLDER``, or ``ddpkit.launch(train, FOLDER, nproc=2)``: each rank
touches FOLDER/ready-<rank> after its first step, then trains on (at most 10 minutes, so that a process the
launcher failed to take with it still ends).
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

LIMIT_S = 600.0


def train(folder: str) -> None:
    """Train a tiny model step after step; each rank marks FOLDER/ready-<rank> after its first step."""
    ctx = ddpkit.init()
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    deadline = time.monotonic() + LIMIT_S
    step = 0
    while time.monotonic() < deadline:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 20 == 0:
            print(f"rank {ctx.rank} step {step} loss {loss.item():.4f}", flush=True)
        if step == 0:
            Path(folder, f"ready-{ctx.rank}").touch()
        step += 1
        time.sleep(0.05)


if __name__ == "__main__":
    train(sys.argv[1])
