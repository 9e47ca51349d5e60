"""Whole ``ddpkit train`` runs with glibc's allocator keeping freed memory (the default) against glibc's own behaviour.

    python benchmarks/allocator.py                       # W2 at 1 and 2 workers, W1 at 2; 5 alternated rounds
    python benchmarks/allocator.py --smoke --output /tmp/alloc     # a tiny run on synthetic data

Each configuration runs as ``python -m ddpkit train WORDS`` twice per round,
``DDPKIT_MALLOC=keep`` and ``DDPKIT_MALLOC=default`` (see
``ddpkit.allocator``), the order alternating between rounds; the train time
and samples/s come from each run's ``summary.json``. Writes
``<output>.json`` and ``<output>.md``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
from pathlib import Path
from typing import Any

from ddpkit.allocator import GLIBC_VARIABLES
from ddpkit.bench.report import write_report
from ddpkit.bench.system import machine_info, machine_tag, summarize
from ddpkit.bench.train import ddpkit_summary

CONFIGURATIONS = {
    "W2, 1 worker": ["model=cnn", "nproc=1", "max_steps=600"],
    "W2, 2 workers": ["model=cnn", "nproc=2", "max_steps=600"],
    "W1, 2 workers": ["model=mlp", "nproc=2", "epochs=5"],
}
COMMON = ["progress=false", "eval_every_epoch=false", "checkpoint.enabled=false"]
SMOKE = ["dataset=synthetic", "synthetic_samples=256", "max_steps=4"]
CHOICES = ("keep", "default")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="synthetic data, 4 steps, one round")
    parser.add_argument("--output", default=f"benchmarks/allocator-{machine_tag()}-{datetime.date.today()}")
    return parser.parse_args()


def train(words: list[str], choice: str) -> dict[str, float]:
    """One ``ddpkit train`` process with ``DDPKIT_MALLOC=choice``; its train time and samples/s."""
    # glibc's own variables would make ddpkit leave the allocator alone in both runs.
    environ = {k: v for k, v in os.environ.items() if k not in GLIBC_VARIABLES}
    summary = ddpkit_summary(words, timeout=900, environ={**environ, "DDPKIT_MALLOC": choice})
    return {"train_time_s": summary["train_time_s"], "samples_per_s": summary["samples_per_s"]}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    configurations = {name: [*words, *COMMON, *(SMOKE if args.smoke else [])] for name, words in CONFIGURATIONS.items()}
    runs: dict[str, dict[str, list[dict[str, float]]]] = {name: {c: [] for c in CHOICES} for name in CONFIGURATIONS}
    rounds = 1 if args.smoke else args.rounds
    for round_index in range(rounds):
        for name, words in configurations.items():
            order = CHOICES if round_index % 2 == 0 else CHOICES[::-1]
            for choice in order:
                runs[name][choice].append(train(words, choice))
            times = {c: runs[name][c][-1]["train_time_s"] for c in CHOICES}
            print(f"round {round_index + 1}, {name}: keep {times['keep']:.2f} s, default {times['default']:.2f} s")
    return {
        "machine": {**machine_info(), "libc": os.confstr("CS_GNU_LIBC_VERSION")},
        "command": "python benchmarks/allocator.py" + (" --smoke" if args.smoke else f" --rounds {rounds}"),
        "configurations": configurations,
        "runs": runs,
    }


def markdown(report: dict[str, Any]) -> str:
    """The report as a table: each configuration's train time with either choice, medians and ranges."""
    machine = report["machine"]
    lines = [
        "# ddpkit train with glibc's allocator keeping freed memory (`DDPKIT_MALLOC=keep`) or not (`default`)",
        "",
        f"{machine['date']} · {machine['cpu_model']} · {machine['cores']} cores · torch {machine['torch']} · {machine['libc']}",
        "",
        f"Command: `{report['command']}`; each configuration's two runs alternated in order between rounds.",
        "",
        "| configuration | train time, keep (s) | train time, default (s) | keep / default | samples/s, keep | samples/s, default |",
        "|---|---|---|---|---|---|",
    ]
    for name, by_choice in report["runs"].items():
        times = {c: summarize([r["train_time_s"] for r in by_choice[c]]) for c in CHOICES}
        rates = {c: statistics.median(r["samples_per_s"] for r in by_choice[c]) for c in CHOICES}
        spread = {c: f"{times[c]['median']:.2f} ({times[c]['min']:.2f}-{times[c]['max']:.2f})" for c in CHOICES}
        lines.append(
            f"| {name} (`{' '.join(report['configurations'][name])}`) | {spread['keep']} | {spread['default']} "
            f"| {times['keep']['median'] / times['default']['median']:.2f} | {rates['keep']:,.0f} | {rates['default']:,.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    args = arguments()
    report = measure(args)
    output = Path(args.output)
    write_report(report, str(output.parent), output.name, markdown)
    print(markdown(report))


if __name__ == "__main__":
    main()
