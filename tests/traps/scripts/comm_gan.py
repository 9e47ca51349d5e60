"""DCGAN's loop (pytorch/examples) in miniature: two models on DDP, ddpkit's all_reduce as their hook.

``python comm_gan.py STEPS ALLREDUCE OUT``: netG and netD are each prepared
with ``grad_sync="ddp"``; the generator's step backpropagates through both,
so the buckets of the two models become ready in one backward. Rank 0 saves
both models' weights to OUT; every rank checks that its weights are rank 0's.
"""

import sys

import torch
from torch import nn

import ddpkit

steps, allreduce, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
ctx = ddpkit.init()
torch.manual_seed(0)
# Layers of 1.2 MiB and more: several DDP buckets per model (DDP's first bucket is 1 MiB, then 25 MiB).
netG = nn.Sequential(nn.Linear(16, 600), nn.ReLU(), nn.Linear(600, 600), nn.ReLU(), nn.Linear(600, 32))
netD = nn.Sequential(nn.Linear(32, 520), nn.ReLU(), nn.Linear(520, 600), nn.ReLU(), nn.Linear(600, 1))
netG = ddpkit.prepare_model(netG, grad_sync="ddp", allreduce=allreduce)
netD = ddpkit.prepare_model(netD, grad_sync="ddp", allreduce=allreduce)
optG = torch.optim.Adam(netG.parameters(), lr=1e-4)
optD = torch.optim.Adam(netD.parameters(), lr=1e-4)
criterion = nn.BCEWithLogitsLoss()
data = torch.Generator().manual_seed(1 + ctx.rank)
for _ in range(steps):
    real = torch.randn(8, 32, generator=data)
    noise = torch.randn(8, 16, generator=data)
    netD.zero_grad()
    fake = netG(noise)
    errD = criterion(netD(real), torch.ones(8, 1)) + criterion(netD(fake.detach()), torch.zeros(8, 1))
    errD.backward()
    optD.step()
    netG.zero_grad()
    errG = criterion(netD(fake), torch.ones(8, 1))  # through netD into netG: both models' buckets in one backward
    errG.backward()
    optG.step()
weights = torch.cat([p.detach().reshape(-1) for net in (netG, netD) for p in net.parameters()])
mine = weights.clone()
torch.distributed.broadcast(weights, 0)
assert torch.equal(mine, weights), f"rank {ctx.rank}: weights differ from rank 0's"
if ctx.rank == 0:
    torch.save({"G": ddpkit.unwrap_model(netG).state_dict(), "D": ddpkit.unwrap_model(netD).state_dict()}, out)
    print(f"trained {steps} steps, weights equal on every rank", flush=True)
ddpkit.shutdown()
