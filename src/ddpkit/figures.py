"""Figures for benchmark reports and run plots: matplotlib's Agg backend, loaded only when a figure is drawn.

matplotlib is an optional dependency (the ``plot`` and ``test`` extras). A
benchmark asks :func:`new_figure` for a figure; without matplotlib it gets
None, one warning line is printed, and the benchmark writes its JSON and
Markdown without the PNG. Figures are built with the object-oriented API
(``Figure`` + ``FigureCanvasAgg``), never ``pyplot``: no global state, no
display needed, whatever backend the user configured.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_bytes(num_bytes: float) -> str:
    """A byte count the way people write it: ``4 B``, ``64 KiB``, ``1.5 MiB``.

    Args:
        num_bytes: a count of bytes, >= 0.

    Returns:
        The count in the largest binary unit that keeps it >= 1.
    """
    value, unit = float(num_bytes), 0
    while value >= 1024 and unit < len(_UNITS) - 1:
        value /= 1024
        unit += 1
    text = f"{value:.0f}" if value == int(value) else f"{value:.3g}"
    return f"{text} {_UNITS[unit]}"


def new_figure(
    num_panels: int, ncols: int = 3, panel_size: tuple[float, float] = (5.0, 3.6)
) -> tuple[Any, list[Any]] | None:
    """A figure with ``num_panels`` axes on a grid, or None (after one warning line) without matplotlib.

    Args:
        num_panels: axes wanted; unused cells of the grid are hidden.
        ncols: columns of the grid (fewer when there are fewer panels).
        panel_size: width and height of one panel, in inches.

    Returns:
        ``(figure, axes)`` with ``len(axes) == num_panels``, or None.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        print(
            "warning: matplotlib is not installed, so no PNG was written; pip install 'ddpkit[plot]' to get one",
            file=sys.stderr,
        )
        return None
    ncols = max(1, min(ncols, num_panels))
    nrows = max(1, -(-num_panels // ncols))
    figure = Figure(figsize=(panel_size[0] * ncols, panel_size[1] * nrows), layout="constrained")
    FigureCanvasAgg(figure)
    grid = figure.subplots(nrows, ncols, squeeze=False)
    axes = [ax for row in grid for ax in row]
    for ax in axes[num_panels:]:
        ax.set_visible(False)
    return figure, axes[:num_panels]


def bytes_axis(ax: Any, axis: str = "x") -> None:
    """Put a base-2 log scale with byte labels (``4 B``, ``1 KiB``, ...) on one axis of ``ax``.

    Args:
        ax: a matplotlib Axes.
        axis: ``"x"`` or ``"y"``.
    """
    from matplotlib.ticker import FuncFormatter, LogLocator

    getattr(ax, f"set_{axis}scale")("log", base=2)
    target = ax.xaxis if axis == "x" else ax.yaxis
    # A label every 4x keeps 25 sizes readable in a 5-inch panel.
    target.set_major_locator(LogLocator(base=4))
    target.set_minor_locator(LogLocator(base=2))
    target.set_major_formatter(FuncFormatter(lambda value, _: format_bytes(value)))
    target.set_minor_formatter(FuncFormatter(lambda value, _: ""))


def save_figure(figure: Any, path: Path) -> Path:
    """Write ``figure`` to ``path`` as PNG and return the path.

    Args:
        figure: a figure from :func:`new_figure`.
        path: destination file, ending in ``.png``.

    Returns:
        ``path``.
    """
    figure.savefig(path, dpi=110)
    return path
