"""From a preemption signal to its checkpoint: how many steps, and how many seconds, for steps of each length.

One process trains a loop of fixed-length steps (busy-waiting, so the step
time is what it is told) with a ddpkit.DataLoader and a Checkpointer; after
``--after`` seconds it sends itself SIGTERM, and the loop runs until the
Checkpointer has written the preemption checkpoint and raised ``Preempted``.
Each (step length, ``sync_seconds``) pair runs in a fresh process, ``--repeats``
times; the table gives the median steps and seconds from the signal to the
checkpoint (min-max in brackets).

Run from the repository root, with the venv's python::

    python benchmarks/signal_delay.py --name signal-delay-2core-epyc-2026-11-28

It writes benchmarks/NAME.json (every run) and benchmarks/NAME.md (the table).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def one_run(step_s: float, sync_s: float, after_s: float) -> dict:
    """In this process: train until the preemption checkpoint; return the steps and seconds it took."""
    sys.path[:0] = [str(REPO / "src")]
    import torch

    import ddpkit
    from ddpkit.checkpoint import Preempted

    data = torch.utils.data.TensorDataset(torch.randn(1_000_000, 4))
    loader = ddpkit.DataLoader(data, global_batch_size=4)
    folder = tempfile.mkdtemp(prefix="ddpkit-signal-delay-")
    ckpt = ddpkit.Checkpointer(
        folder, model=torch.nn.Linear(4, 1), loader=loader, sync_seconds=sync_s, preempt_signals=("SIGTERM",)
    )
    ckpt.resume("never")
    sent: dict[str, float] = {}

    def send() -> None:
        time.sleep(after_s)
        sent["step"], sent["time"] = ckpt.global_step, time.perf_counter()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send, daemon=True).start()
    try:
        for _ in loader:
            end = time.perf_counter() + step_s
            while time.perf_counter() < end:
                pass
            ckpt.step()
    except Preempted:
        return {"steps": ckpt.global_step - sent["step"], "seconds": time.perf_counter() - sent["time"]}
    raise RuntimeError("the loop ran out of data before the preemption checkpoint")


def _span(values: list[float], digits: int) -> str:
    return f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}-{max(values):.{digits}f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps-ms", default="1,50,300", help="step lengths in milliseconds")
    parser.add_argument("--sync-seconds", default="0.25,1.0", help="values of sync_seconds to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--after", type=float, default=2.0, help="seconds of training before the signal")
    parser.add_argument("--name", default="", help="write benchmarks/NAME.json and .md (default: print only)")
    parser.add_argument("--one", nargs=2, type=float, metavar=("STEP_S", "SYNC_S"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(one_run(args.one[0], args.one[1], args.after)))
        return
    rows = []
    for step_ms in [float(v) for v in args.steps_ms.split(",")]:
        for sync_s in [float(v) for v in args.sync_seconds.split(",")]:
            runs = []
            for _ in range(args.repeats):
                out = subprocess.run(
                    [sys.executable, __file__, "--one", str(step_ms / 1000), str(sync_s), "--after", str(args.after)],
                    capture_output=True,
                    text=True,
                    check=True,
                )
                runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            rows.append({"step_ms": step_ms, "sync_seconds": sync_s, "runs": runs})
    lines = ["| step | sync_seconds | steps to the checkpoint | seconds to the checkpoint |", "|---|---|---|---|"]
    for row in rows:
        steps = [run["steps"] for run in row["runs"]]
        seconds = [run["seconds"] for run in row["runs"]]
        lines.append(f"| {row['step_ms']:g} ms | {row['sync_seconds']:g} | {_span(steps, 0)} | {_span(seconds, 3)} |")
    table = "\n".join(lines)
    print(table)
    if args.name:
        import torch

        info = {
            "date": datetime.date.today().isoformat(),
            "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "repeats": args.repeats,
            "rows": rows,
        }
        (REPO / "benchmarks" / f"{args.name}.json").write_text(json.dumps(info, indent=2) + "\n")
        head = f"# Signal to checkpoint ({info['date']}, torch {info['torch']}, {info['cores']} cores)\n\n"
        command = (
            f"`python benchmarks/signal_delay.py --name {args.name}`; medians of {args.repeats} runs [min-max].\n\n"
        )
        (REPO / "benchmarks" / f"{args.name}.md").write_text(head + command + table + "\n")


if __name__ == "__main__":
    main()
