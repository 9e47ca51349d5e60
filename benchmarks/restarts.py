"""Restarts under each launcher, many rounds: how many end bit-equal to the uninterrupted run.

Each round runs tests/launchers/scripts/own_bn.py (DataLoader workers,
BatchNorm, AdamW + OneCycleLR, ``no_sync`` accumulation, a Checkpointer)
with 2 workers and one restart allowed, and SIGKILLs one rank after an
optimizer step drawn from ``random.Random(seed)`` (the same draws for every
launcher). A round is ``equal`` when the launcher exited 0 and rank 0's final
weights equal the uninterrupted run's bit for bit; else ``differs``,
``failed`` (with the output's most telling line) or ``hung`` (still running
at the timeout). ``traceback`` counts ``ddpkit run`` rounds whose output
holds a Python traceback although the launcher exited 0.

Run from the repository root, with the venv's python::

    python benchmarks/restarts.py --rounds 10 --name restarts-2core-epyc-2026-11-25
    python benchmarks/restarts.py --launchers ddpkit-run --rounds 10 --name ...
    python benchmarks/restarts.py --launchers srun-torchrun --rounds 10 --name ...   # as root: starts Slurm

``srun-torchrun`` (torchrun inside an srun step, as ``ddpkit slurm
launch=torchrun`` writes it) runs on a one-node Slurm cluster that the
benchmark starts and stops (tests/helpers/slurm.py: root, Slurm and munge).

It writes benchmarks/NAME.json (every round) and benchmarks/NAME.md (counts).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import re
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO)]

import torch  # noqa: E402

from tests.helpers.restarts import LAUNCHERS, SLURM_LAUNCHERS, STEPS, command, launch  # noqa: E402
from tests.helpers.slurm import start_slurm_cluster  # noqa: E402

_TELLING = ("connectFullMesh", "Connection refused", "restart", "Error", "error")
"""Words of the line that best says why a round failed, most telling first."""


def _why(output: str) -> str:
    lines = output.splitlines()
    for word in _TELLING:
        found = [line for line in lines if word in line]
        if found:
            return found[-1].strip()[:240]
    return lines[-1][:240] if lines else ""


def _round(
    launcher: str, folder: Path, kill_at: int, kill_rank: int, reference: dict, timeout: float, environ: dict | None
) -> dict:
    started = time.monotonic()
    outcome = launch(launcher, folder, kill_at, kill_rank, timeout, environ if launcher in SLURM_LAUNCHERS else None)
    wall = round(time.monotonic() - started, 1)
    if outcome.returncode is None:
        result = "hung"
    elif outcome.returncode != 0:
        result = "failed"
    else:
        result = "differs" if outcome.differing(reference) else "equal"
    # Under torchrun the surviving worker of the failed round prints its own traceback (the script's uncaught
    # gloo error); ddpkit run reports a failure in one line, so a traceback there is one too many.
    traceback = (
        launcher == "ddpkit-run" and outcome.returncode == 0 and "Traceback (most recent call last)" in outcome.output
    )
    return {
        "launcher": launcher,
        "kill_at": kill_at,
        "kill_rank": kill_rank,
        "result": result,
        "returncode": outcome.returncode,
        "wall_s": wall,
        "traceback_after_success": traceback,
        "why": "" if result == "equal" else _why(outcome.output),
        "traceback": _last_traceback(outcome.output) if traceback else "",
    }


def _last_traceback(output: str) -> str:
    """The output's last Python traceback, at most 30 lines."""
    start = output.rindex("Traceback (most recent call last)")
    return "\n".join(output[start:].splitlines()[:30])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seed", type=int, default=26)
    parser.add_argument("--timeout", type=float, default=120, help="seconds before a round counts as hung")
    parser.add_argument(
        "--launchers",
        default=",".join(LAUNCHERS),
        help=f"comma-separated, of {', '.join(LAUNCHERS + SLURM_LAUNCHERS)} (default: the local ones)",
    )
    parser.add_argument("--name", required=True, help="file name of the results under benchmarks/, without suffix")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    unknown = sorted(set(launchers) - set(LAUNCHERS + SLURM_LAUNCHERS))
    if unknown:
        parser.error(f"unknown launcher {', '.join(unknown)}; choose among {', '.join(LAUNCHERS + SLURM_LAUNCHERS)}")
    rng = random.Random(args.seed)
    kills = [(rng.randint(2, STEPS - 1), rng.randint(0, 1)) for _ in range(args.rounds)]
    load_before = os.getloadavg()[0]
    rows = []
    with ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="ddpkit-restarts-"))
        slurm = set(launchers) & set(SLURM_LAUNCHERS)
        environ = dict(stack.enter_context(start_slurm_cluster(cpus=8, first_job_id=5001)).env) if slurm else None
        reference = launch("ddpkit-run", Path(tmp) / "reference")
        assert reference.returncode == 0 and reference.weights is not None, reference.output
        for index, (kill_at, kill_rank) in enumerate(kills):
            for launcher in launchers:
                folder = Path(tmp) / f"{launcher}-{index}"
                row = _round(launcher, folder, kill_at, kill_rank, reference.weights, args.timeout, environ)
                print(json.dumps(row), flush=True)
                rows.append(row)
    _write(args, launchers, rows, load_before)


def _write(args: argparse.Namespace, launchers: list[str], rows: list[dict], load_before: float) -> None:
    header = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cpus": len(os.sched_getaffinity(0)),
        "machine": platform.processor(),
        "load_before": load_before,
        "load_after": os.getloadavg()[0],
        "command": "python benchmarks/restarts.py " + " ".join(sys.argv[1:]),
        "seed": args.seed,
    }
    out = REPO / "benchmarks" / args.name
    out.with_suffix(".json").write_text(json.dumps({**header, "rounds": rows}, indent=1) + "\n")
    lines = [
        f"# Restarts: {args.rounds} rounds per launcher, one rank SIGKILLed, max restarts 1",
        "",
        f"{header['date']} · torch {header['torch']} · {header['cpus']} cores · load average (1 min) "
        f"{load_before:.1f} before, {header['load_after']:.1f} after",
        "",
        f"Command: `{header['command']}` (seed {args.seed}; the kill steps and ranks are the same for every launcher)",
        "",
        "| launcher | command | equal | differs | failed | hung | traceback after success |",
        "|---|---|---|---|---|---|---|",
    ]
    for launcher in launchers:
        mine = [row for row in rows if row["launcher"] == launcher]
        counts = [sum(row["result"] == kind for row in mine) for kind in ("equal", "differs", "failed", "hung")]
        shown = " ".join("python" if word == sys.executable else word for word in command(launcher))
        shown = shown.replace(str(REPO) + "/", "")
        shown = re.sub(r"--master-port \d+", "--master-port PORT", shown)
        shown = re.sub(r"--rdzv-endpoint=\S+", "--rdzv-endpoint=HOST:PORT", shown)
        tracebacks = sum(row["traceback_after_success"] for row in mine)
        lines.append(f"| {launcher} | `{shown}` | {' | '.join(map(str, counts))} | {tracebacks} |")
    whys = [
        f"- {row['launcher']} kill at step {row['kill_at']} of rank {row['kill_rank']}: {row['result']}: `{row['why']}`"
        for row in rows
        if row["result"] != "equal"
    ]
    if whys:
        lines += ["", "Rounds that did not end equal:", "", *whys]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
