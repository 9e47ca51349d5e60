"""``ddpkit bench KIND``: dispatch to the benchmark of that kind, or show its help."""

from __future__ import annotations

import importlib
from collections.abc import Sequence

from ddpkit.commands.help import CommandHelp, render_help, wants_help
from ddpkit.errors import UserError

# Each kind's module has ``main(words) -> int`` and its config dataclass.
KINDS = {
    "train": CommandHelp(
        usage="ddpkit bench train [key=value ...]",
        summary="Training time of a workload side by side with a bare loop (no framework), in fresh processes, "
        "rounds repeated: ratios T1 (framework overhead), T6 (own loop with the public API) and T7 "
        "(data loading at scale), and 2 workers against 1. Writes JSON and Markdown.",
        schema="ddpkit.bench.train:TrainBenchConfig",
        examples=("ddpkit bench train repeats=3", "ddpkit bench train smoke=true output_dir=/tmp/out"),
    ),
    "comm": CommandHelp(
        usage="ddpkit bench comm [key=value ...]",
        summary="Every collective and algorithm over a size sweep, and ping-pong, in the style of nccl-tests and "
        "the OSU micro-benchmarks: time, algorithm and bus bandwidth, and the ratio to torch's built-in.",
        schema="ddpkit.bench.comm:CommBenchConfig",
        examples=("ddpkit bench comm", "ddpkit bench comm smoke=true output_dir=/tmp/out"),
    ),
    "scaling": CommandHelp(
        usage="ddpkit bench scaling [key=value ...]",
        summary="Where a workload's step time goes as workers, nodes and all_reduce change: data, forward, "
        "backward, optimizer and exposed communication per step, speedup and efficiency, and an "
        "alpha-beta model projected to other networks.",
        schema="ddpkit.bench.scaling:ScalingBenchConfig",
        examples=("ddpkit bench scaling", "ddpkit bench scaling workload=W3 workers=[1,2,4] nodes=[1]"),
    ),
    "startup": CommandHelp(
        usage="ddpkit bench startup [key=value ...]",
        summary="Time from the command to the first training step, and whole-process wall time, of ddpkit train "
        "nproc=1 and nproc=2 beside torchrun's bare 2-worker launch, rounds rotated: targets T8 and T9.",
        schema="ddpkit.bench.startup:StartupBenchConfig",
        examples=("ddpkit bench startup repeats=5", "ddpkit bench startup smoke=true output_dir=/tmp/out"),
    ),
}
"""Help of each benchmark kind; the kind's code is ``ddpkit.bench.<kind>``."""

BENCH_HELP = CommandHelp(
    usage="ddpkit bench KIND [key=value ...]      (KIND: " + " | ".join(KINDS) + ")",
    summary="Benchmarks, with results written as JSON and Markdown (and a PNG with matplotlib): train (training "
    "time against a bare loop: targets T1, T6, T7), comm (every collective and algorithm over a size "
    "sweep, and ping-pong), scaling (where a workload's step time goes as workers, nodes and all_reduce "
    "change), startup (time to the first step: T8, T9). ddpkit bench KIND --help lists the options of KIND.",
    examples=tuple(help.examples[0] for help in KINDS.values()),
)
"""What ``ddpkit bench --help`` shows."""


def bench_command(args: Sequence[str]) -> int:
    """Run ``ddpkit bench KIND [key=value ...]``, or print the help of bench or of KIND."""
    if args and args[0] in ("-h", "--help"):
        print(render_help(BENCH_HELP))
        return 0
    if not args or args[0] not in KINDS:
        given = repr(args[0]) if args else "nothing"
        raise UserError(
            f"ddpkit bench needs a kind, got {given}; choose one of: {', '.join(KINDS)} (ddpkit bench --help)"
        )
    kind, words = args[0], list(args[1:])
    if wants_help(words):
        print(render_help(KINDS[kind]))
        return 0
    status: int = importlib.import_module(f"ddpkit.bench.{kind}").main(words)
    return status
