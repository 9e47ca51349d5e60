"""The tutorial's save of a sharded model: ``torch.save(model.state_dict())`` on rank 0, then the full way.

``python comm_shard_save.py naive|full OUT``.
"""

import sys

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

import ddpkit

how, out = sys.argv[1], sys.argv[2]
ctx = ddpkit.init()
torch.manual_seed(0)
model = ddpkit.prepare_model(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), shard=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.tensor([0, 1, 2, 3])).backward()
optimizer.step()
if how == "full":
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if ctx.rank == 0:
        torch.save(full, out)
elif ctx.rank == 0:
    torch.save(model.state_dict(), out)
if ctx.rank == 0:
    loaded = torch.load(out)
    print(f"saved {', '.join(f'{k} {tuple(v.shape)}' for k, v in loaded.items())}", flush=True)
ddpkit.shutdown()
