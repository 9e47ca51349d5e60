"""``ddpkit bench startup``: time to the first training step and whole-process wall time, beside torchrun's bare launch.

Each round runs three commands, one after the other, each as a fresh
process as a user would type it; the order rotates from round to round so
that a slow spell of a shared machine does not always hit the same command:

- ``ddpkit train nproc=1`` and ``ddpkit train nproc=2`` (W1 with the default
  config unless ``train_words`` say otherwise);
- ``python -m torch.distributed.run --nproc-per-node 2 bare.py``, where
  ``bare.py`` imports torch, joins a gloo group, does one all_reduce and
  exits (the least any 2-worker job started by torchrun does).

Time to first step: from just before the command is started to the wall
clock of the ``start`` line rank 0 writes into ``metrics.jsonl`` when every
part of the run is ready and its first step begins. Wall time: until the
process has exited. Ratios of medians, same run:

- T8: ``ddpkit train nproc=2`` time to first step / torchrun bare wall time  (target <= 1.0)
- T9: ``ddpkit train nproc=2`` wall time / ``ddpkit train nproc=1`` wall time (target <= 1.0)

Results go to ``<output_dir>/startup-<machine>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ddpkit.bench.report import file_stem, write_report
from ddpkit.bench.system import check_run, machine_info, machine_tag, summarize
from ddpkit.env.ports import free_port
from ddpkit.keyvalue import parse

BARE_SCRIPT = """\
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
tensor = torch.ones(1)
dist.all_reduce(tensor)
assert tensor.item() == dist.get_world_size()
dist.destroy_process_group()
"""
"""What every worker of torchrun's bare launch runs."""

DDPKIT_1 = "ddpkit train nproc=1"
DDPKIT_2 = "ddpkit train nproc=2"
TORCHRUN = "torchrun --nproc-per-node 2 (bare: import torch, gloo group, one all_reduce)"

T8 = "T8 ddpkit train nproc=2 time to first step / torchrun bare wall"
T9 = "T9 ddpkit train nproc=2 wall / ddpkit train nproc=1 wall"
TARGETS = {T8: 1.0, T9: 1.0}
"""Each ratio's target: met when the ratio is at most this."""


@dataclasses.dataclass
class StartupBenchConfig:
    """Options of ``ddpkit bench startup``."""

    repeats: int = 5
    """Rounds of the three commands."""
    train_words: list[str] = dataclasses.field(default_factory=list)
    """Extra ``ddpkit train`` words for both worker counts; none is W1 with the default config."""
    smoke: bool = False
    """A tiny run (synthetic data, one short epoch, one round) to check the benchmark works."""
    output_dir: str = "benchmarks"
    """Folder for the JSON and Markdown results."""
    timeout: float = 600.0
    """Seconds one command may take before the benchmark fails."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"repeats={self.repeats} is not valid; it must be at least 1")


def _train_words(cfg: StartupBenchConfig) -> list[str]:
    words = ["progress=false", *cfg.train_words]
    if cfg.smoke:
        words = ["progress=false", "dataset=synthetic", "synthetic_samples=512", "epochs=1", *cfg.train_words]
    return words


def _run_ddpkit(nproc: int, words: list[str], timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-startup-") as tmp:
        command = [sys.executable, "-m", "ddpkit", "train", f"nproc={nproc}", f"output_dir={tmp}", *words]
        start = time.time()
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=tmp)
        wall = time.time() - start
        check_run(out, f"ddpkit train nproc={nproc}")
        events = [json.loads(line) for line in (Path(tmp) / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    first_step = next(e["time"] for e in events if e["event"] == "start")
    return {"wall_s": wall, "first_step_s": first_step - start, "train_time_s": summary["train_time_s"]}


def _run_torchrun(script: Path, timeout: float) -> dict[str, float]:
    # torchrun's default (static) rendezvous, on a free port rather than 29500: the machine is shared.
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        "2",
        "--master-port",
        str(free_port("127.0.0.1")),
        str(script),
    ]
    start = time.time()
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=script.parent)
    wall = time.time() - start
    check_run(out, "torchrun bare launch")
    return {"wall_s": wall}


def run_startup_benchmark(cfg: StartupBenchConfig) -> dict[str, Any]:
    """Run the three commands ``cfg.repeats`` times, the order rotating each round; return the results."""
    words = _train_words(cfg)
    load_before = os.getloadavg()
    names = [DDPKIT_1, DDPKIT_2, TORCHRUN]
    samples: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-bare-") as tmp:
        script = Path(tmp) / "bare.py"
        script.write_text(BARE_SCRIPT)
        for round_index in range(1 if cfg.smoke else cfg.repeats):
            order = names[round_index % 3 :] + names[: round_index % 3]
            for name in order:
                if name == TORCHRUN:
                    result = _run_torchrun(script, cfg.timeout)
                else:
                    result = _run_ddpkit(1 if name == DDPKIT_1 else 2, words, cfg.timeout)
                samples[name].append(result)
                first = f"first step {result['first_step_s']:6.2f}s  " if "first_step_s" in result else ""
                print(f"round {round_index + 1}: {name:<75} {first}wall {result['wall_s']:6.2f}s", file=sys.stderr)
    results = []
    for name in names:
        row: dict[str, Any] = {"name": name, "samples": samples[name]}
        for key in ("first_step_s", "wall_s", "train_time_s"):
            if key in samples[name][0]:
                row[key] = summarize([s[key] for s in samples[name]])
        results.append(row)
    return {
        "benchmark": "startup",
        "machine": machine_info(),
        "config": dataclasses.asdict(cfg),
        "train_words": words,
        "bare_script": BARE_SCRIPT,
        "results": results,
        "ratios": _ratios(results),
        # A busy shared machine slows the 2-thread single worker most: say how busy it was.
        "load_average_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
    }


def _ratios(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    by_name = {r["name"]: r for r in results}
    values = {
        T8: by_name[DDPKIT_2]["first_step_s"]["median"] / by_name[TORCHRUN]["wall_s"]["median"],
        T9: by_name[DDPKIT_2]["wall_s"]["median"] / by_name[DDPKIT_1]["wall_s"]["median"],
    }
    return {
        name: {"value": value, "target": TARGETS[name], "met": value <= TARGETS[name]} for name, value in values.items()
    }


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table plus the target ratios."""
    m = report["machine"]
    lines = [
        "# Start-up benchmark: ddpkit train (W1) and torchrun's bare 2-worker launch",
        "",
        f"{m['date']} · torch {m['torch']} · {m['cpu_model']} · {m['cores']} cores"
        + (
            f" · load average (1 min) {load['before']:.1f} before, {load['after']:.1f} after"
            if (load := report.get("load_average_1min"))
            else ""
        ),
        "",
        f"Command: `ddpkit bench startup {' '.join(report.get('command_words', []))}`",
        f"Train words (besides nproc and output_dir): `{' '.join(report['train_words'])}`",
        "torchrun: `python -m torch.distributed.run --nproc-per-node 2 --master-port PORT bare.py` "
        "(bare.py: import torch, join a gloo group, one all_reduce, exit)",
        "",
        "| command | time to first step median (s) | min | max | wall median (s) | min | max | train time median (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        cells = [
            _cells(r.get("first_step_s")),
            _cells(r["wall_s"]),
            f"{r['train_time_s']['median']:.2f}" if "train_time_s" in r else "-",
        ]
        lines.append(f"| {r['name']} | {' | '.join(cells)} |")
    lines += ["", "| ratio (medians, same run) | value | target | met |", "|---|---|---|---|"]
    lines += [
        f"| {k} | {v['value']:.3f} | <= {v['target']:.2f} | {'met' if v['met'] else 'not met'} |"
        for k, v in report["ratios"].items()
    ]
    return "\n".join(lines) + "\n"


def _cells(stats: dict[str, float] | None) -> str:
    return f"{stats['median']:.2f} | {stats['min']:.2f} | {stats['max']:.2f}" if stats else "- | - | -"


def main(words: list[str]) -> int:
    """``ddpkit bench startup [key=value ...]``."""
    cfg = parse(StartupBenchConfig, words)
    report = run_startup_benchmark(cfg)
    report["command_words"] = list(words)
    stem = file_stem(f"startup-{machine_tag()}-{report['machine']['date'][:10]}", cfg.smoke)
    json_path, md_path = write_report(report, cfg.output_dir, stem, render_markdown)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0
