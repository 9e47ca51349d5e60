"""A module run with ``ddpkit run -m with_ddpkit`` that joins the job through ddpkit.init()."""

import sys

import torch
import torch.distributed as dist

import ddpkit

if __name__ == "__main__":
    ctx = ddpkit.init()
    value = torch.tensor([float(ctx.env.rank)])
    dist.all_reduce(value)
    print(f"ddpkit rank {ctx.env.rank}/{ctx.env.world_size} sum={value.item():g} argv={sys.argv[1:]}", flush=True)
    ddpkit.shutdown()
