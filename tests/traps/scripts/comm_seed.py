"""DCGAN's seed habit: without --manualSeed each process draws its own seed and passes it to the loader."""

import random
import sys

import torch
from torch.utils.data import TensorDataset

import ddpkit

ctx = ddpkit.init()
manual_seed = int(sys.argv[1]) if len(sys.argv) > 1 else random.randint(1, 10000)
if len(sys.argv) == 1:
    manual_seed += ctx.rank  # what random.randint does in two processes, made certain
random.seed(manual_seed)
torch.manual_seed(manual_seed)
dataset = TensorDataset(torch.arange(16))
loader = ddpkit.DataLoader(dataset, batch_size=2, shuffle=True, seed=manual_seed)
seen = torch.cat([x for (x,) in loader])
everyone = [torch.empty_like(seen) for _ in range(ctx.world_size)]
torch.distributed.all_gather(everyone, seen)
if ctx.rank == 0:
    print(
        f"epoch saw {len(torch.cat(everyone))} samples, {len(set(torch.cat(everyone).tolist()))} distinct", flush=True
    )
ddpkit.shutdown()
