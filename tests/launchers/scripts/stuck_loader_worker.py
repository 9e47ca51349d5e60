"""A rank dies while its DataLoader worker is busy in ``__getitem__``; the restarted round succeeds.

In the first round (``TORCHELASTIC_RESTART_COUNT`` 0), rank 1's DataLoader
worker writes its pid to ``PIDS/1-<pid>`` and then reads slowly (a 300 s
sleep, as a read from a stalled file system would), and a thread of rank 1
SIGKILLs it once that file exists. The restarted round reads at once and ends. Every
DataLoader worker of either round records its pid, so a test can check that
none outlives the launcher::

    ddpkit run nproc=2 max_restarts=1 stuck_loader_worker.py PIDS
"""

import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import Dataset

import ddpkit


class Slow(Dataset):
    def __init__(self, pids: Path, rank: int, stuck: bool):
        self.pids, self.rank, self.stuck = pids, rank, stuck

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> torch.Tensor:
        (self.pids / f"{self.rank}-{os.getpid()}").touch()
        if self.stuck:
            for name in ("SIGTERM", "SIGINT", "SIGHUP"):  # a read in C code that no signal interrupts
                signal.signal(getattr(signal, name), signal.SIG_IGN)
            time.sleep(300)
        return torch.full((4,), float(index))


def kill_once_reading(pids: Path) -> None:
    """Rank 1: SIGKILL this process once its DataLoader worker has started reading."""
    while not list(pids.glob("1-*")):
        time.sleep(0.05)
    print("rank 1: my DataLoader worker is reading; sending myself SIGKILL", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    pids = Path(sys.argv[1])
    ctx = ddpkit.init()
    stuck = os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and ctx.rank == 1
    if stuck:
        threading.Thread(target=kill_once_reading, args=(pids,), daemon=True).start()
    loader = ddpkit.DataLoader(Slow(pids, ctx.rank, stuck), global_batch_size=8, num_workers=1)
    total = sum(batch.sum() for batch in loader)
    print(f"rank {ctx.rank}: done, sum {float(total):g}", flush=True)


if __name__ == "__main__":
    main()
