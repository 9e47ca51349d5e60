"""A Lightning Fabric script as a user writes it for ``ddpkit run nproc=N lightning_fabric.py OUT``.

``plugins=[DdpkitEnvironment()]`` gives Fabric ddpkit's ranks, master and
network interface; ``setup_dataloaders(..., use_distributed_sampler=False)``
keeps the sampler of ddpkit's DataLoader. Each rank saves what it saw and its
final weights to OUT/rank-R.pt.
"""

import sys

import lightning as L
import torch
from torch import nn

import ddpkit
from ddpkit.integrations.lightning import DdpkitEnvironment

env = DdpkitEnvironment()
fabric = L.Fabric(accelerator="cpu", strategy="ddp", devices=env.devices, num_nodes=env.num_nodes, plugins=[env])
fabric.launch()
fabric.seed_everything(0, verbose=False)
g = torch.Generator().manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = fabric.setup(model, optimizer)
loader = fabric.setup_dataloaders(
    ddpkit.DataLoader(data, global_batch_size=16, shuffle=True), use_distributed_sampler=False
)
first_batch = None
for _epoch in range(2):
    for x, y in loader:
        if first_batch is None:
            first_batch = x.clone()
        optimizer.zero_grad()
        fabric.backward(nn.functional.mse_loss(model(x), y))
        optimizer.step()
torch.save(
    {
        "rank": fabric.global_rank,
        "world_size": fabric.world_size,
        "source": env.job.source,
        "loader_kept": type(loader.batch_sampler).__name__ if loader.batch_sampler is not None else None,
        "first_batch": first_batch,
        "weights": model.module.state_dict(),
    },
    f"{sys.argv[1]}/rank-{fabric.global_rank}.pt",
)
