"""Prints this worker's rank, the world size and its arguments: what a torchrun user's first script checks."""

import os
import sys

print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}: {' '.join(sys.argv[1:])}", flush=True)
