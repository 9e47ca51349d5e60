"""Two ranks stuck in mismatched collectives, for the test of a second Ctrl-C.

``ddpkit run nproc=2 launcher_stuck.py FOLDER``: each rank touches FOLDER/ready-<rank>, then rank 0 waits in a
barrier that rank 1 never joins, while rank 1 waits to receive a tensor rank 0 never sends. Neither returns to
Python, so neither acts on a SIGINT.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

import ddpkit

if __name__ == "__main__":
    ctx = ddpkit.init()
    dist.barrier()  # both started
    Path(sys.argv[1], f"ready-{ctx.rank}").touch()
    if ctx.rank == 0:
        dist.barrier()
    else:
        dist.recv(torch.zeros(1), src=0)
