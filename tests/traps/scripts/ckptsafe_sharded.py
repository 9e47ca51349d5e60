"""A sharded (FSDP2) training script as a user writes it: resume, train, save every 2 steps, write the weights.

    ddpkit run nproc=2 ckptsafe_sharded.py CKPT_DIR FINAL_PT STEPS [WIDTH]

WIDTH (default 16) is the hidden layer's: a wider one makes bigger checkpoints.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import ddpkit

folder, final, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
width = int(sys.argv[4]) if len(sys.argv) > 4 else 16
ctx = ddpkit.init()
torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 4)), shard=True)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
ckpt = ddpkit.Checkpointer(folder, model=model, optimizer=optimizer, every_steps=2)
start = ckpt.resume("auto")
rank, world_size = ctx.env.rank, ctx.env.world_size
while ckpt.global_step < steps:
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(ckpt.global_step))
    mine = x[rank * 8 // world_size : (rank + 1) * 8 // world_size]
    F.mse_loss(model(mine), mine[:, :4]).backward()
    optimizer.step()
    optimizer.zero_grad()
    ckpt.step()
ckpt.close()
weights = [p.full_tensor().detach().clone() for p in model.parameters()]
if rank == 0:
    torch.save(weights, final)
ddpkit.shutdown()
