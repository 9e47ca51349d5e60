"""A small CNN with BatchNorm trained on rank-dependent data; each rank saves its buffers and weights.

``python comm_batchnorm.py GRAD_SYNC OUT_PREFIX``: ``grad_sync`` flat or ddp
(allreduce=builtin in both), 20 steps of SGD; rank r writes
``OUT_PREFIX-r.pt`` with its model's state_dict (running statistics included).
"""

import sys

import torch
from torch import nn

import ddpkit

grad_sync, prefix = sys.argv[1], sys.argv[2]
ctx = ddpkit.init()
torch.manual_seed(0)
net = nn.Sequential(
    nn.Conv2d(1, 4, 3),
    nn.BatchNorm2d(4),
    nn.ReLU(),
    nn.Flatten(),
    nn.Linear(4 * 6 * 6, 8),
    nn.BatchNorm1d(8),
    nn.Linear(8, 2),
)
model = ddpkit.prepare_model(net, grad_sync=grad_sync, allreduce="builtin")
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
data = torch.Generator().manual_seed(10 + ctx.rank)
for _ in range(20):
    x = torch.randn(16, 1, 8, 8, generator=data) * (1 + ctx.rank) + 3 * ctx.rank  # each rank's own statistics
    y = torch.randint(0, 2, (16,), generator=data)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()
torch.save(ddpkit.unwrap_model(model).state_dict(), f"{prefix}-{ctx.rank}.pt")
ddpkit.shutdown()
