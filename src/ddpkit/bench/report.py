"""Writing a benchmark's results: ``<stem>.json``, ``<stem>.md`` and, for benchmarks that draw one, ``<stem>.png``.

Every benchmark builds its report as one JSON-ready dict, then hands it here
with the functions that render it::

    paths = write_report(report, cfg.output_dir, stem, render_markdown, plot_report)

The JSON is the record (``json.dumps(report, indent=2)``); the Markdown and
the PNG are views of it, so a committed JSON can be rendered again.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def write_report(
    report: dict[str, Any],
    output_dir: str,
    stem: str,
    render_markdown: Callable[..., str],
    plot: Callable[[dict[str, Any], Path], Path | None] | None = None,
) -> list[Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and, with ``plot`` and matplotlib, ``<stem>.png`` into ``output_dir``.

    Args:
        report: the benchmark's results, JSON-serialisable.
        output_dir: folder for the files, created if missing.
        stem: the files' name without extension.
        render_markdown: the report as Markdown. Called as
            ``render_markdown(report)`` without ``plot``; with ``plot``, as
            ``render_markdown(report, png_name)``, ``png_name`` being the PNG's
            file name to link, or None when no PNG was written.
        plot: draws the report to the path it is given and returns that
            path, or None when it could not (matplotlib missing).

    Returns:
        The paths written: JSON, Markdown, then the PNG if there is one.
    """
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    json_path, md_path = folder / f"{stem}.json", folder / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if plot is None:
        md_path.write_text(render_markdown(report))
        return [json_path, md_path]
    # The figure is drawn before the Markdown, which links it only if it was written.
    png_path = plot(report, folder / f"{stem}.png")
    md_path.write_text(render_markdown(report, png_path.name if png_path else None))
    return [json_path, md_path] + ([png_path] if png_path else [])


def file_stem(name: str, smoke: bool, tag: str = "") -> str:
    """``<name>[-smoke][-<tag>]``: a result's file name without extension, as every benchmark names them."""
    return name + ("-smoke" if smoke else "") + (f"-{tag}" if tag else "")
