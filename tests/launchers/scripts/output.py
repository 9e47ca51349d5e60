"""What a worker prints, for the tests of ``ddpkit run``'s output: lines on both streams, a progress bar,
an unfinished last line, the process title; rank ``argv[1]`` (if given) then exits 3 without a traceback."""

import os
import sys
import time

rank = int(os.environ["RANK"])
print(f"hello from rank {rank}")  # no flush: the worker's stdout is line-buffered although it is a file
print(f"a warning from rank {rank}", file=sys.stderr)
with open("/proc/self/cmdline", "rb") as f:
    title = f.read().rstrip(b"\0").decode()
with open("/proc/self/comm") as f:
    print(f"title of rank {rank}: {title} | name: {f.read().strip()}")
for percent in (0, 50, 100):
    print(f"\rrank {rank} progress {percent}%", end="", file=sys.stderr, flush=True)
    time.sleep(0.1)
print(file=sys.stderr)
if len(sys.argv) > 1 and rank == int(sys.argv[1]):
    print(f"rank {rank} stops here", file=sys.stderr, flush=True)
    os._exit(3)
print(f"rank {rank} ends without a newline", end="")
