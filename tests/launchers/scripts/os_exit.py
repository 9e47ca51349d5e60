"""Each rank prints a line and ends with os._exit(0), so it never returns to the launcher's wrapper.

Rank 0 ends first; rank 1 a moment later, while the launcher is already polling.
"""

import os
import time

rank = int(os.environ["RANK"])
time.sleep(0.3 * rank)
print(f"rank {rank} ends with os._exit", flush=True)
os._exit(0)
