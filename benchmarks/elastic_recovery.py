"""T15: time from a node's loss to the survivors' first step, ddpkit's elastic launch beside torchrun's.

Two nodes in network namespaces (10.78.0.1, 10.78.0.2), ``nnodes=1:2``, one
node SIGKILLed mid-run; see :mod:`ddpkit.bench.elastic_recovery` for the
runs and the parts of a recovery. Run as root (namespaces), from the
repository root, with the venv's python, when the machine is otherwise idle::

    python benchmarks/elastic_recovery.py --rounds 5 --name elastic-recovery-2core-epyc-2026-11-29
    python benchmarks/elastic_recovery.py --rounds 1 --launches torchrun --name try   # one side only
    python benchmarks/elastic_recovery.py --rounds 3 --last-call 5 --name ...   # a shorter last call on both

It writes benchmarks/NAME.json (every run) and benchmarks/NAME.md (medians, the ratio, every run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src")]

from ddpkit.bench.elastic_recovery import LAUNCHES, RecoverySpec, build_report, render_markdown, run_rounds  # noqa: E402
from ddpkit.bench.netns import unavailable_reason  # noqa: E402
from ddpkit.bench.report import write_report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="alternated pairs of runs")
    parser.add_argument("--launches", default=",".join(LAUNCHES), help=f"comma-separated, of {', '.join(LAUNCHES)}")
    parser.add_argument(
        "--last-call",
        type=int,
        default=30,
        help="seconds a rendezvous waits for more nodes (both launches; torch's 30)",
    )
    parser.add_argument("--name", required=True, help="file name of the results under benchmarks/, without suffix")
    args = parser.parse_args()
    launches = args.launches.split(",")
    if not set(launches) <= set(LAUNCHES):
        parser.error(f"--launches {args.launches}: choose among {', '.join(LAUNCHES)}")
    reason = unavailable_reason()
    if reason:
        parser.error(f"{reason}: run as root on a machine with iproute2")
    spec = RecoverySpec(last_call=args.last_call)
    rows = run_rounds(args.rounds, spec, launches)
    report = build_report(rows, spec, "python benchmarks/elastic_recovery.py " + " ".join(sys.argv[1:]))
    for path in write_report(report, str(REPO / "benchmarks"), args.name, render_markdown):
        print(path)


if __name__ == "__main__":
    main()
