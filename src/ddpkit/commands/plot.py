"""``ddpkit plot``: the curves of runs' metrics.jsonl (:mod:`ddpkit.train.plot`) into one PNG."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ddpkit.commands.help import CommandHelp
from ddpkit.keyvalue import parse
from ddpkit.train.config import local_run_folder
from ddpkit.train.storage_url import url_scheme

PLOT_HELP = CommandHelp(
    usage="ddpkit plot RUN_DIR [RUN_DIR ...] [key=value ...]",
    summary="Draw runs' training loss, test metric and throughput against the step (or epoch) from their "
    "metrics.jsonl into one PNG, several runs overlaid and named by the settings in which they differ.",
    schema="ddpkit.train.plot:PlotConfig",
    positional=(("RUN_DIR", "a run's folder (e.g. runs/latest) or its metrics.jsonl; several are overlaid"),),
    examples=(
        "ddpkit plot runs/latest",
        "ddpkit plot runs/w1 runs/w2 output=workers.png",
        "ddpkit plot runs/lr-a runs/lr-b x=epoch panels=loss,test",
    ),
)


def plot_command(args: Sequence[str]) -> int:
    """``ddpkit plot RUN_DIR [RUN_DIR ...] [key=value ...]``: write the PNG and say where."""
    from ddpkit.train.plot import PlotConfig, PlotError, default_output, draw, label_runs, read_run  # deferred

    folders = [word for word in args if not _is_config_word(word)]
    cfg = parse(PlotConfig, [word for word in args if _is_config_word(word)])
    if not folders:
        raise PlotError("ddpkit plot needs a run folder (the output_dir of ddpkit train), e.g. ddpkit plot runs/latest")
    for folder in folders:
        if url_scheme(folder):  # output_dir=URL kept only the checkpoints there; metrics.jsonl stayed local
            raise PlotError(
                f"{folder}: a run's metrics stay in its local folder; ddpkit plot {local_run_folder(folder)}"
            )
    runs = label_runs([read_run(Path(folder)) for folder in folders])
    output = Path(cfg.output) if cfg.output else default_output(runs)
    draw(runs, cfg, output)
    print(f"wrote {output} ({len(runs)} run(s): {', '.join(cfg.panel_names())} against {cfg.x})")
    return 0


def _is_config_word(word: str) -> bool:
    return "=" in word or (word.endswith((".yaml", ".yml")) and os.path.isfile(word))
