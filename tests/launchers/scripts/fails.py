"""The last rank fails as argv[1] says (raise, or exit N); the others wait for it in a barrier."""

import os
import sys

import torch.distributed as dist

dist.init_process_group("gloo")
if dist.get_rank() == dist.get_world_size() - 1:
    if sys.argv[1] == "raise":
        raise RuntimeError(f"rank {dist.get_rank()} fails on purpose")
    sys.exit(int(sys.argv[2]))
dist.barrier()
print(f"rank {os.environ['RANK']} should not get here", flush=True)
