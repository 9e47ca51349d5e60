"""``ddpkit bench train``: training time of a workload, side by side with a bare loop.

Each round runs every configuration once, in a fresh process, in the same
order: the bare loop (no framework), then ``ddpkit train`` with each worker
count, all_reduce algorithm and gradient sync mode. Rounds repeat, and the report gives the
median with min and max, and the ratios the targets are stated in:

- T1: ddpkit with 1 worker / bare loop                                      (target <= 1.15)
- ddpkit with 2 workers / ddpkit with 1 (what two workers buy end to end)
- T6: W1 as an own loop with the public API over tensors / bare loop       (target <= 1.10)
- T7: own loop over a per-sample Dataset, num_workers=2, 2 workers:
  ddpkit.DataLoader's time / torch's DataLoader + DistributedSampler's      (target <= 1.00)

The own-loop rows run ``ddpkit.bench.own_loop`` (one worker in-process, two through ``ddpkit run``).

Results go to ``<output_dir>/train-<model>-<machine>-<date>.json`` and ``.md``.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from ddpkit.bench.report import file_stem, write_report
from ddpkit.bench.system import machine_info, machine_tag, summarize
from ddpkit.config import GRAD_SYNC_MODES, check_choice, parse


@dataclasses.dataclass
class TrainBenchConfig:
    """Options of ``ddpkit bench train``."""

    model: str = "mlp"
    """Registered model to train (the bare loop covers classifiers without input normalisation)."""
    dataset: str = "fashion-mnist"
    """Dataset to train on."""
    epochs: int = 0
    """Epochs per run; 0 takes the model's recipe."""
    workers: list[int] = dataclasses.field(default_factory=lambda: [1, 2])
    """Worker counts to run ddpkit with."""
    allreduce: list[str] = dataclasses.field(default_factory=lambda: ["auto", "builtin"])
    """all_reduce algorithms to compare for runs with more than one worker."""
    grad_sync: list[str] = dataclasses.field(default_factory=lambda: ["auto", "ddp"])
    """Gradient synchronisation modes to compare for runs with more than one worker (auto, ddp, flat, manual)."""
    repeats: int = 3
    """Rounds of every configuration."""
    own_loop: bool = True
    """Also run W1 as an own loop with the public API (rows for T6 and T7)."""
    smoke: bool = False
    """A tiny run (synthetic data, one short epoch, one round) to check the benchmark works."""
    output_dir: str = "benchmarks"
    """Folder for the JSON and Markdown results."""
    timeout: float = 900.0
    """Seconds one run may take before the benchmark fails."""

    def __post_init__(self) -> None:
        # Checked here, before any run: a bad name would otherwise fail minutes into the benchmark.
        from ddpkit.comm.registry import ALLREDUCE_ALGORITHMS

        for name in self.allreduce:
            check_choice("allreduce", name, ("auto", *ALLREDUCE_ALGORITHMS))
        for mode in self.grad_sync:
            check_choice("grad_sync", mode, GRAD_SYNC_MODES)


def _train_words(cfg: TrainBenchConfig) -> list[str]:
    words = [f"model={cfg.model}", f"dataset={cfg.dataset}", "progress=false", "eval_every_epoch=false"]
    if cfg.smoke:
        words = [f"model={cfg.model}", "dataset=synthetic", "synthetic_samples=2048", "epochs=1",
                 "progress=false", "eval_every_epoch=false"]
    elif cfg.epochs:
        words.append(f"epochs={cfg.epochs}")
    return words


def _configurations(cfg: TrainBenchConfig) -> list[dict[str, Any]]:
    runs = [{"name": "bare loop", "kind": "bare", "workers": 1}]
    for n in cfg.workers:
        if n == 1:
            runs.append({"name": "ddpkit 1 worker", "kind": "ddpkit", "workers": 1})
            continue
        for algorithm in cfg.allreduce:
            for mode in cfg.grad_sync:
                name = f"ddpkit {n} workers, allreduce={algorithm}, grad_sync={mode}"
                runs.append({"name": name, "kind": "ddpkit", "workers": n, "allreduce": algorithm, "grad_sync": mode})
    if cfg.own_loop:
        runs += [
            {"name": OWN_TENSORS, "kind": "own", "workers": 1, "loader": "tensors"},
            {"name": OWN_SAMPLES, "kind": "own", "workers": 2, "loader": "samples"},
            {"name": OWN_TORCH, "kind": "own", "workers": 2, "loader": "torch"},
        ]
    return runs


OWN_TENSORS = "own loop 1 worker, tensors (public API)"
OWN_SAMPLES = "own loop 2 workers, per-sample Dataset, ddpkit.DataLoader num_workers=2"
OWN_TORCH = "own loop 2 workers, per-sample Dataset, torch DataLoader + DistributedSampler num_workers=2"


def _own_loop_words(cfg: TrainBenchConfig, loader: str) -> list[str]:
    words = [f"loader={loader}", f"dataset={cfg.dataset}"]
    if cfg.smoke:
        words = [f"loader={loader}", "dataset=synthetic", "synthetic_samples=2048", "epochs=1"]
    elif cfg.epochs:
        words.append(f"epochs={cfg.epochs}")
    return words


def _run_once(run: dict[str, Any], words: list[str], timeout: float) -> dict[str, Any]:
    if run["kind"] == "own":
        module = ["-m", "ddpkit.bench.own_loop", *words]
        command = [sys.executable, *module] if run["workers"] == 1 else \
            [sys.executable, "-m", "ddpkit", "run", f"nproc={run['workers']}", *module]
        out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        _check(out, run)
        return json.loads(out.stdout.strip().splitlines()[-1])
    if run["kind"] == "bare":
        out = subprocess.run([sys.executable, "-m", "ddpkit.bench.bare_loop", *words],
                             capture_output=True, text=True, timeout=timeout)
        _check(out, run)
        return json.loads(out.stdout.strip().splitlines()[-1])
    with tempfile.TemporaryDirectory(prefix="ddpkit-bench-") as tmp:
        extra = [f"nproc={run['workers']}", f"output_dir={tmp}"]
        if run["workers"] > 1:
            extra += [f"allreduce={run['allreduce']}", f"grad_sync={run['grad_sync']}"]
        out = subprocess.run([sys.executable, "-m", "ddpkit", "train", *words, *extra],
                             capture_output=True, text=True, timeout=timeout)
        _check(out, run)
        summary = json.loads((Path(tmp) / "summary.json").read_text())
    return {"train_time_s": summary["train_time_s"], "test_accuracy": summary["test"].get("accuracy"),
            "allreduce": summary["allreduce"], "grad_sync": summary.get("grad_sync")}


def _check(out: subprocess.CompletedProcess, run: dict[str, Any]) -> None:
    if out.returncode != 0:
        raise RuntimeError(f"benchmark run {run['name']!r} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")


def run_train_benchmark(cfg: TrainBenchConfig) -> dict[str, Any]:
    """Run every configuration ``cfg.repeats`` times, interleaved; return the results."""
    words = _train_words(cfg)
    runs = _configurations(cfg)
    samples: dict[str, list[dict[str, Any]]] = {r["name"]: [] for r in runs}
    for round_index in range(1 if cfg.smoke else cfg.repeats):
        for run in runs:
            run_words = _own_loop_words(cfg, run["loader"]) if run["kind"] == "own" else words
            result = _run_once(run, run_words, cfg.timeout)
            samples[run["name"]].append(result)
            print(f"round {round_index + 1}: {run['name']:<55} {result['train_time_s']:7.2f}s  "
                  f"accuracy {100 * (result['test_accuracy'] or 0):.2f}%", file=sys.stderr)
    results = []
    for run in runs:
        times = [s["train_time_s"] for s in samples[run["name"]]]
        accuracies = [s["test_accuracy"] for s in samples[run["name"]]]
        results.append({**run, "train_time_s": summarize(times), "test_accuracy": summarize(accuracies),
                        "resolved_allreduce": samples[run["name"]][-1].get("allreduce"),
                        "resolved_grad_sync": samples[run["name"]][-1].get("grad_sync")})
    return {"benchmark": "train", "machine": machine_info(), "config": dataclasses.asdict(cfg),
            "train_words": words, "results": results, "ratios": _ratios(results)}


def _ratios(results: list[dict[str, Any]]) -> dict[str, float]:
    by_name = {r["name"]: r["train_time_s"]["median"] for r in results}
    ratios = {}
    one = by_name.get("ddpkit 1 worker")
    if one and "bare loop" in by_name:
        ratios["T1 ddpkit 1 worker / bare loop"] = one / by_name["bare loop"]
    for name, value in by_name.items():
        if one and name.startswith("ddpkit 2 workers"):
            ratios[f"{name} / ddpkit 1 worker"] = value / one
    if OWN_TENSORS in by_name and "bare loop" in by_name:
        ratios["T6 own loop (public API, tensors) / bare loop"] = by_name[OWN_TENSORS] / by_name["bare loop"]
    if OWN_SAMPLES in by_name and OWN_TORCH in by_name:
        ratios["T7 ddpkit.DataLoader / torch DataLoader + DistributedSampler (2 workers, num_workers=2)"] = \
            by_name[OWN_SAMPLES] / by_name[OWN_TORCH]
    return ratios


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table plus the target ratios."""
    m = report["machine"]
    lines = [
        f"# Training benchmark: {report['config']['model']} on {report['config']['dataset']}",
        "",
        f"{m['date']} · torch {m['torch']} · {m['cpu_model']} · {m['cores']} cores",
        "",
        f"Command: `ddpkit bench train {' '.join(report.get('command_words', []))}`",
        f"Train words: `{' '.join(report['train_words'])}`",
        "",
        "| configuration | train time median (s) | min | max | test accuracy (median) |",
        "|---|---|---|---|---|",
    ]
    for r in report["results"]:
        t, a = r["train_time_s"], r["test_accuracy"]
        lines.append(f"| {r['name']} | {t['median']:.2f} | {t['min']:.2f} | {t['max']:.2f} | {100 * a['median']:.2f}% |")
    lines += ["", "| ratio (medians, same run) | value |", "|---|---|"]
    lines += [f"| {k} | {v:.3f} |" for k, v in report["ratios"].items()]
    return "\n".join(lines) + "\n"


def main(words: list[str]) -> int:
    """``ddpkit bench train [key=value ...]``."""
    cfg = parse(TrainBenchConfig, words)
    report = run_train_benchmark(cfg)
    report["command_words"] = list(words)
    date = report["machine"]["date"][:10]
    stem = file_stem(f"train-{cfg.model}-{machine_tag()}-{date}", cfg.smoke)
    json_path, md_path = write_report(report, cfg.output_dir, stem, render_markdown)
    print(render_markdown(report))
    print(f"wrote {json_path} and {md_path}", file=sys.stderr)
    return 0
