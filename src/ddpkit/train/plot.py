"""The curves of ``ddpkit plot`` (:mod:`ddpkit.commands.plot`): one PNG of a run's curves from its metrics.jsonl, several runs overlaid.

::

    ddpkit plot runs/latest                              # -> runs/latest/metrics.png
    ddpkit plot runs/w1 runs/w2 output=workers.png       # 1 vs 2 workers on one figure
    ddpkit plot runs/lr-a runs/lr-b x=epoch panels=loss,test

A panel per metric (training loss, test accuracy or MSE, throughput...)
against the optimizer step, with the epoch on a second axis when every run
has the same steps per epoch (or against the epoch, ``x=epoch``). Each run is
named in the legend by its folder and by the settings in which the runs
differ (``lr=0.01``, ``world_size=2``), read from the config that ``ddpkit
train`` stores in the run's summary. Drawn with matplotlib's object API on the
Agg backend (see :mod:`ddpkit.figures`), so it needs no display.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ddpkit.keyvalue import ConfigError, check_choice

PANELS = {
    # name: (event, metric, y-axis label)
    "loss": ("train", "loss", "training loss"),
    "test": ("eval", "", "test metric"),  # accuracy, else mse, else loss: what the runs' eval lines hold
    "test_loss": ("eval", "loss", "test loss"),
    "throughput": ("train", "samples_per_s", "samples/s (all workers)"),
    "lr": ("train", "lr", "learning rate"),
}
"""Panels ``ddpkit plot`` can draw (``panels=...``)."""

TEST_METRICS = ("accuracy", "mse", "loss")
"""The test metric of the ``test`` panel: the first of these the runs' eval lines hold."""

NOT_COMPARED = ("output_dir", "checkpoint.dir", "progress", "master_port", "resume", "logger", "nproc", "show_ranks")
"""Config keys left out of the legend: they name where or how a run was written, not what it computed
(``nproc`` is replaced by the summary's ``world_size``, which is also right under torchrun, srun and mpirun)."""

MAX_LEGEND_KEYS = 4
"""Differing settings named per run in the legend; more are counted."""


class PlotError(ConfigError):
    """A run to plot cannot be read, or matplotlib is missing; the message names the fix."""


@dataclasses.dataclass
class PlotConfig:
    """Options of ``ddpkit plot RUN_DIR [RUN_DIR ...]``; every field can be set as key=value."""

    output: str = ""
    """PNG file to write; empty: metrics.png in the run's folder for one run, plot.png here for several."""
    x: str = "step"
    """Horizontal axis: step (optimizer steps, with epochs on the top axis when all runs agree) or epoch."""
    panels: str = "loss,test,throughput"
    """Comma-separated panels: loss (training), test (accuracy, else MSE), test_loss, throughput, lr."""

    def __post_init__(self) -> None:
        check_choice("x", self.x, ("step", "epoch"))
        if not self.panel_names():
            raise ConfigError(f"panels={self.panels!r} names no panel; choose from: {', '.join(PANELS)}")
        for name in self.panel_names():
            check_choice("panels", name, tuple(PANELS))

    def panel_names(self) -> list[str]:
        """The panels, in the order given."""
        return [name.strip() for name in self.panels.split(",") if name.strip()]


@dataclasses.dataclass
class Run:
    """What one run's metrics.jsonl (and summary) hold, ready to draw."""

    folder: Path
    """The run's folder as given (a runs/latest link is kept as such)."""
    train: list[dict[str, Any]]
    """``train`` lines by increasing global_step, one per step (a resumed run's later line wins)."""
    test: list[dict[str, Any]]
    """``eval`` lines of the test split, the same way."""
    settings: dict[str, Any]
    """The run's config, flattened (``checkpoint.keep``), with ``world_size``; empty when not stored."""
    label: str = ""
    """The name in the legend, set by :func:`label_runs`."""

    def steps_per_epoch(self) -> float | None:
        """Optimizer steps per epoch, from an epoch-end eval line; None before the first epoch ends."""
        for line in self.test:
            # an epoch's end (a whole number); a run stopped by max_steps also writes a fraction of an epoch
            if line.get("epoch", 0) > 0 and float(line["epoch"]).is_integer():
                return float(line["global_step"] / line["epoch"])
        return None


def default_output(runs: Sequence[Run]) -> Path:
    """metrics.png in the run's folder for one run; plot.png in the current folder for several."""
    return runs[0].folder / "metrics.png" if len(runs) == 1 else Path("plot.png")


# -- reading ----------------------------------------------------------------


def read_run(path: Path) -> Run:
    """The run in ``path``: a run folder holding metrics.jsonl, or a metrics.jsonl file.

    Raises:
        PlotError: no such path, no metrics.jsonl, an empty file or a line that is not JSON.
    """
    metrics = path if path.is_file() else path / "metrics.jsonl"
    if not path.exists():
        raise PlotError(
            f"{path} does not exist; pass a run folder (the output_dir of ddpkit train) or its metrics.jsonl"
        )
    if not metrics.is_file():
        raise PlotError(
            f"{path} holds no metrics.jsonl (ddpkit train writes one into its output_dir); "
            f"pass the folder of a run{_runs_inside(path)}"
        )
    lines = _read_lines(metrics)
    if not lines:
        raise PlotError(
            f"{metrics} is empty: the run has not written a line yet (ddpkit train writes one every log_every steps)"
        )
    train = _last_per_step(line for line in lines if line.get("event") == "train")
    test = _last_per_step(line for line in lines if line.get("event") == "eval" and line.get("split") == "test")
    if not train and not test:
        raise PlotError(
            f"{metrics} holds no train or eval line to plot "
            "(ddpkit train writes them every log_every steps and at each epoch end)"
        )
    summary = next((line for line in reversed(lines) if line.get("event") == "summary"), None)
    if summary is None and (metrics.parent / "summary.json").is_file():
        summary = json.loads((metrics.parent / "summary.json").read_text())
    if not (summary or {}).get("config"):  # an own loop's Tracker("jsonl") writes its config on a line of its own
        config = next((line for line in lines if line.get("event") == "config"), None)
        summary = {**(summary or {}), **({"config": config["config"]} if config else {})}
    return Run(metrics.parent if path.is_file() else path, train, test, _settings(summary or {}))


def _runs_inside(folder: Path) -> str:
    if not folder.is_dir():
        return ""
    inside = sorted(str(p.parent) for p in folder.glob("*/metrics.jsonl"))
    return f", e.g. one in it: {', '.join(inside[:3])}{', ...' if len(inside) > 3 else ''}" if inside else ""


def _read_lines(metrics: Path) -> list[dict[str, Any]]:
    text = metrics.read_text()
    rows = text.splitlines()
    lines = []
    for number, row in enumerate(rows, 1):
        if not row.strip():
            continue
        try:
            lines.append(json.loads(row))
        except json.JSONDecodeError as e:
            if number == len(rows) and not text.endswith("\n"):
                break  # the last line of a run killed while writing it
            raise PlotError(
                f"line {number} of {metrics} is not JSON ({e.msg}); is it a metrics.jsonl written by ddpkit train?"
            ) from None
    return lines


def _last_per_step(lines: Any) -> list[dict[str, Any]]:
    # A resumed run appends: steps after its checkpoint come again, and the later line counts.
    by_step = {line["global_step"]: line for line in lines if "global_step" in line}
    return [by_step[step] for step in sorted(by_step)]


def _settings(summary: dict[str, Any]) -> dict[str, Any]:
    settings = _flatten(summary.get("config") or {})
    if "world_size" in summary:
        settings["world_size"] = summary["world_size"]
    return {key: value for key, value in settings.items() if key not in NOT_COMPARED}


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


# -- naming -----------------------------------------------------------------


def label_runs(runs: list[Run]) -> list[Run]:
    """Set each run's legend label: its folder's name and the settings in which the runs differ.

    A runs/latest link is named by the folder it points to; names that collide
    take their parent folder too. ``lr=0.01, world_size=2``: keys whose values
    differ among the runs that stored their config (at most MAX_LEGEND_KEYS).
    """
    names = [run.folder.resolve().name or str(run.folder) for run in runs]
    if len(set(names)) < len(names):
        names = [str(Path(*run.folder.resolve().parts[-2:])) for run in runs]
    if len(set(names)) < len(names):
        names = [str(run.folder) for run in runs]
    known = [run.settings for run in runs if run.settings]
    keys = sorted({key for s in known for key in s if len({repr(other.get(key)) for other in known}) > 1})
    for run, name in zip(runs, names):
        differing = [f"{key}={run.settings[key]}" for key in keys if key in run.settings] if len(known) > 1 else []
        if len(differing) > MAX_LEGEND_KEYS:
            differing = differing[:MAX_LEGEND_KEYS] + [f"+{len(differing) - MAX_LEGEND_KEYS} more"]
        run.label = f"{name} ({', '.join(differing)})" if differing else name
    return runs


# -- drawing ----------------------------------------------------------------


def draw(runs: Sequence[Run], cfg: PlotConfig, output: Path) -> Path:
    """Draw ``runs`` as ``cfg`` asks into the PNG ``output``.

    Raises:
        PlotError: matplotlib is not installed, or x=epoch for a run with no epoch end yet.
    """
    _require_matplotlib()
    from ddpkit.figures import new_figure, save_figure

    names = cfg.panel_names()
    drawn = new_figure(len(names), ncols=3, panel_size=(5.0, 4.0))
    assert drawn is not None  # _require_matplotlib() made sure matplotlib is there
    figure, axes = drawn
    if cfg.x == "epoch":
        for run in runs:
            if run.steps_per_epoch() is None:
                raise PlotError(f"x=epoch needs a finished epoch, and {run.folder} has none yet; use x=step")
    steps = runs[0].steps_per_epoch()
    # Epochs on a top axis only where one step means the same epoch in every run.
    epoch_axis = cfg.x == "step" and steps is not None and all(run.steps_per_epoch() == steps for run in runs)
    # Every panel spans the same steps, also one with a single evaluation.
    right = max(
        _x_value(line, event, cfg.x, run)
        for run in runs
        for event, lines in (("train", run.train), ("eval", run.test))
        for line in lines
    )
    for ax, name in zip(axes, names):
        _draw_panel(ax, name, runs, cfg.x)
        ax.set_xlim(0, right * 1.02)
        if epoch_axis:
            top = ax.secondary_xaxis("top", functions=(lambda step: step / steps, lambda epoch: epoch * steps))
            top.set_xlabel("epoch")
    handles, labels = axes[0].get_legend_handles_labels()
    for ax in axes[1:]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if label not in labels:
                handles.append(handle)
                labels.append(label)
    figure.legend(handles, labels, loc="outside lower center", ncols=min(len(labels), 2), fontsize="small")
    output.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(figure, output)


def _require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise PlotError("ddpkit plot needs matplotlib, which is not installed; pip install 'ddpkit[plot]'") from None


def _draw_panel(ax: Any, name: str, runs: Sequence[Run], x: str) -> None:
    event, metric, ylabel = PANELS[name]
    if name == "test":
        held = [m for m in TEST_METRICS if any(m in line for run in runs for line in run.test)]
        metric = held[0] if held else "accuracy"
        ylabel = f"test {metric}"
    for index, run in enumerate(runs):
        lines = [line for line in (run.train if event == "train" else run.test) if metric in line]
        if not lines:
            continue
        xs = [_x_value(line, event, x, run) for line in lines]
        ys = [line[metric] for line in lines]
        marker = "o" if event == "eval" or len(lines) < 3 else None
        ax.plot(xs, ys, color=f"C{index % 10}", marker=marker, markersize=4, label=run.label)
    if not ax.lines:
        ax.text(0.5, 0.5, f"no {metric} in these runs", transform=ax.transAxes, ha="center", va="center")
    ax.set_xlabel("optimizer step" if x == "step" else "epoch")
    ax.set_ylabel(ylabel)
    ax.set_title(ylabel)
    ax.grid(True, alpha=0.3)


def _x_value(line: dict[str, Any], event: str, x: str, run: Run) -> float:
    if x == "step":
        return float(line["global_step"])
    if event == "eval":
        return float(line["epoch"])  # epochs completed at this evaluation
    return float(line["global_step"] / run.steps_per_epoch())
