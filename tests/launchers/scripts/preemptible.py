"""The README's loop with a ddpkit.Checkpointer, slowed down, for SIGTERM to ``ddpkit run``.

``python preemptible.py OUT``: checkpoints into OUT; rank 0 creates OUT/ready after its first step of a run
that did not resume (the test then signals the launcher), and every rank prints one line per step.
"""

import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import TensorDataset

import ddpkit

if __name__ == "__main__":
    out = Path(sys.argv[1])
    ctx = ddpkit.init()
    torch.manual_seed(0)
    model = ddpkit.prepare_model(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    loader = ddpkit.DataLoader(data, global_batch_size=8, shuffle=True, seed=0)
    ckpt = ddpkit.Checkpointer(out, model=model, optimizer=optimizer, loader=loader)
    start = ckpt.resume("auto")
    print(f"start epoch {start.epoch} resumed={start.resumed}", flush=True)
    for epoch in range(start.epoch, 3):
        loader.set_epoch(epoch)
        for step, (x, y) in enumerate(loader):
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ckpt.step()
            print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if ctx.rank == 0 and not start.resumed:
                (out / "ready").touch()
            time.sleep(0.2 if not start.resumed else 0)
    ckpt.close()
    print("done", flush=True)
