"""Rank 1 dies on the first attempt only; after the agent's restart every rank succeeds."""

import os

import torch
import torch.distributed as dist

restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
if os.environ["RANK"] == "1" and restart == "0":
    os._exit(1)
dist.init_process_group("gloo")
value = torch.ones(1)
dist.all_reduce(value)
print(f"rank {dist.get_rank()} restart={restart} sum={value.item():g}", flush=True)
dist.destroy_process_group()
