"""A plain torch.distributed program (no ddpkit import): each rank adds rank + 1 and prints the sum.

Run as ``ddpkit run nproc=N all_reduce.py ARGS``; it also prints what ddpkit run
promises a worker: its arguments, __name__, the torchrun variables, sys.path[0].
"""

import os
import sys

import torch
import torch.distributed as dist

dist.init_process_group("gloo")  # env://: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the launcher
rank, world_size = dist.get_rank(), dist.get_world_size()
value = torch.tensor([rank + 1.0])
dist.all_reduce(value)
variables = ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")
print(
    f"rank {rank}/{world_size} sum={value.item():g} argv={sys.argv[1:]} name={__name__} "
    f"path0={sys.path[0]} env={','.join(v for v in variables if v in os.environ)}",
    flush=True,
)
dist.destroy_process_group()
raise SystemExit  # code None: success, as for python
