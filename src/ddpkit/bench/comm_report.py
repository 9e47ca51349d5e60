"""The ``ddpkit bench comm`` report as text and figures.

From the report dict that :func:`ddpkit.bench.comm.run_worker` builds: the
terminal table printed as the rows come in, the target lines printed at the
end, the Markdown file and the PNG (time per call and bus bandwidth by size,
ping-pong latency). Nothing here measures; a committed JSON renders again
with :func:`render_markdown` and :func:`plot_report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpkit.bench.comm_spec import BUILTIN, TARGET_T3, TARGET_T4, CommBenchConfig, median_times
from ddpkit.figures import bytes_axis, format_bytes, new_figure, save_figure


class TerminalTable:
    """The terminal table, printed row by row as the measurements come in (rank 0 only).

    Args:
        cfg: the benchmark's options (dtype and repeats go in the headers).
        enabled: print; False on the ranks other than 0, which call it all the same.
    """

    def __init__(self, cfg: CommBenchConfig, enabled: bool):
        self.cfg, self.enabled = cfg, enabled

    def _print(self, line: str) -> None:
        if self.enabled:
            print(line, flush=True)

    def header(self, op: str, world_size: int) -> None:
        self._print(
            f"\n# {op}, {self.cfg.dtype}, {world_size} ranks; time per call of the slowest rank, "
            f"median (min, max) over {self.cfg.repeats} batches"
        )
        self._print(
            f"#{'size(B)':>11} {'count':>10}  {'algorithm':<10} {'time(us)':>10} {'min':>10} {'max':>10} "
            f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12} {'vs builtin':>10}"
        )

    def collective_row(self, row: dict[str, Any]) -> None:
        t = row["time_us"]
        ratio = f"{row['vs_builtin']:.2f}x" if row["vs_builtin"] is not None else "-"
        self._print(
            f"{row['bytes']:>12} {row['count']:>10}  {row['algorithm']:<10} {t['median']:>10.1f} "
            f"{t['min']:>10.1f} {t['max']:>10.1f} {row['algbw_gbps']:>12.3f} {row['busbw_gbps']:>12.3f} "
            f"{ratio:>10}"
        )

    def pingpong_header(self) -> None:
        self._print(
            f"\n# pingpong, {self.cfg.dtype}, rank 0 with each peer; latency = half the round trip, "
            f"median (min, max) over {self.cfg.repeats} batches"
        )
        self._print(
            f"#{'size(B)':>11} {'count':>10}  {'peer':<28} {'lat(us)':>10} {'min':>10} {'max':>10} {'bw(GB/s)':>12}"
        )

    def pingpong_row(self, row: dict[str, Any]) -> None:
        t = row["latency_us"]
        self._print(
            f"{row['bytes']:>12} {row['count']:>10}  {_peer_label(row):<28} {t['median']:>10.1f} "
            f"{t['min']:>10.1f} {t['max']:>10.1f} {row['bandwidth_gbps']:>12.3f}"
        )


def _target_line(name: str, target: dict[str, Any]) -> str:
    if "not_applicable" in target:
        return f"{name}: not applicable ({target['not_applicable']})"
    if not target["per_size"]:
        return f"{name}: no size measured in the target's range"
    verdict = "met" if target["met"] else "NOT met"
    span = f"{format_bytes(target['sizes'][0])}..{format_bytes(target['sizes'][1])}"
    coverage = "" if target.get("covers_range", True) else " (the run does not cover the whole range)"
    return (
        f"{name}: {target['what']}: worst {target['worst']:.2f} at {format_bytes(target['worst_bytes'])} "
        f"over {span}, target {target['target']}: {verdict}{coverage}"
    )


def render_targets(report: dict[str, Any]) -> str:
    """One line per target, as printed at the end of a run."""
    return "".join(f"\n{_target_line(name, t)}" for name, t in report["targets"].items())


def render_markdown(report: dict[str, Any], png_name: str | None = None) -> str:
    """The report as Markdown: targets, one table per op (median times), the ping-pong table.

    Args:
        report: the report from :func:`ddpkit.bench.comm.run_worker`.
        png_name: file name of the plot to link, if one was written.

    Returns:
        The Markdown text.
    """
    m, cfg = report["machine"], report["config"]
    lines = [
        f"# Communication benchmark: {report['world_size']} ranks on {report['num_nodes']} node(s), {report['dtype']}",
        "",
        f"{m['date']} · torch {m['torch']} · {m['cpu_model']} · {m['cores']} cores · host {m['host']} "
        f"· launched by {report['launcher']} · {report['runtime_s']:.0f} s",
        "",
        f"Command: `ddpkit bench comm {' '.join(report['command_words'])}`",
        "",
        f"Time: {report['timing']} ({cfg['repeats']} batches, {cfg['warmup']} warm-up calls). "
        "Sizes are whole buffers as in nccl-tests; busbw = algbw x (2(n-1)/n for all_reduce, 1 for broadcast "
        "and reduce, (n-1)/n otherwise). Figures from a shared machine: compare ratios, not absolute times.",
    ]
    if report["skipped"]:
        lines += ["", "Skipped: " + "; ".join(f"{k} ({v})" for k, v in report["skipped"].items())]
    lines += _markdown_targets(report)
    if png_name:
        lines += ["", f"![time, bus bandwidth and ping-pong latency by size]({png_name})"]
    for op, algorithms in report["algorithms"].items():
        lines += _markdown_op(op, algorithms, [r for r in report["collectives"] if r["op"] == op])
    lines += _markdown_pingpong(report["pingpong"])
    return "\n".join(lines) + "\n"


def _markdown_targets(report: dict[str, Any]) -> list[str]:
    if not report["targets"]:
        return []
    lines = ["", "## Targets (ratios of medians, same run)", ""]
    lines += [f"- {_target_line(name, t)}" for name, t in report["targets"].items()]
    builtin = median_times(report["collectives"], "all_reduce", BUILTIN)
    for name, target, label in (("T3", TARGET_T3, "builtin / shm"), ("T4", TARGET_T4, "ring / builtin")):
        per_size = report["targets"].get(name, {}).get("per_size")
        if not per_size:
            continue
        other = median_times(report["collectives"], "all_reduce", target["algorithm"])
        lines += ["", f"| size | builtin (us) | {target['algorithm']} (us) | {name}: {label} |", "|---|---|---|---|"]
        lines += [
            f"| {format_bytes(int(s))} | {builtin[int(s)]:.1f} | {other[int(s)]:.1f} | {v:.2f} |"
            for s, v in per_size.items()
        ]
    return lines


def _markdown_op(op: str, algorithms: list[str], rows: list[dict[str, Any]]) -> list[str]:
    by_size: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_size.setdefault(r["bytes"], {})[r["algorithm"]] = r
    lines = [
        "",
        f"## {op}",
        "",
        "Median time per call in us, (time / builtin's); bus bandwidth of the fastest.",
        "",
        "| size | " + " | ".join(algorithms) + " | best busbw (GB/s) |",
        "|---" * (len(algorithms) + 2) + "|",
    ]
    for size, cells in sorted(by_size.items()):
        texts = []
        for name in algorithms:
            cell = cells.get(name)
            if cell is None:
                texts.append("-")
            elif name == BUILTIN or cell["vs_builtin"] is None:
                texts.append(f"{cell['time_us']['median']:.1f}")
            else:
                texts.append(f"{cell['time_us']['median']:.1f} ({cell['vs_builtin']:.2f})")
        best = max(cells.values(), key=lambda r: r["busbw_gbps"])
        lines.append(f"| {format_bytes(size)} | {' | '.join(texts)} | {best['busbw_gbps']:.3f} ({best['algorithm']}) |")
    return lines


def _peer_label(row: dict[str, Any]) -> str:
    where = "same node" if row["same_node"] else f"node {row['peer_node_rank']} ({row['peer_host']})"
    return f"rank {row['peer']}, {where}"


def _markdown_pingpong(rows: list[dict[str, Any]]) -> list[str]:
    if not rows:
        return []
    peers = {r["peer"]: _peer_label(r) for r in rows}
    by_size: dict[int, dict[int, dict[str, Any]]] = {}
    for r in rows:
        by_size.setdefault(r["bytes"], {})[r["peer"]] = r
    lines = [
        "",
        "## pingpong",
        "",
        "Rank 0 with each peer: latency (half the round trip, median, us) / bandwidth (GB/s).",
        "",
        "| size | " + " | ".join(peers.values()) + " |",
        "|---" * (len(peers) + 1) + "|",
    ]
    for size, cells in sorted(by_size.items()):
        texts = [
            f"{cells[p]['latency_us']['median']:.1f} / {cells[p]['bandwidth_gbps']:.3f}" if p in cells else "-"
            for p in peers
        ]
        lines.append(f"| {format_bytes(size)} | " + " | ".join(texts) + " |")
    return lines


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """Draw the report: per op, time vs size per algorithm; all_reduce busbw; ping-pong latency.

    Returns:
        ``path``, or None when matplotlib is missing (one warning line is printed).
    """
    ops = list(report["algorithms"])
    show_busbw = "all_reduce" in ops and report["world_size"] > 1  # busbw is 0 on one rank
    panels = len(ops) + show_busbw + bool(report["pingpong"])
    made = new_figure(panels)
    if made is None:
        return None
    figure, axes = made
    figure.suptitle(
        f"ddpkit bench comm: {report['world_size']} ranks, {report['dtype']}, "
        f"{report['machine']['cpu_model']}, {report['machine']['date'][:10]}",
        fontsize=11,
    )
    panel = iter(axes)
    for op in ops:
        ax = next(panel)
        for algorithm in report["algorithms"][op]:
            rows = [r for r in report["collectives"] if r["op"] == op and r["algorithm"] == algorithm]
            sizes = [r["bytes"] for r in rows]
            ax.plot(sizes, [r["time_us"]["median"] for r in rows], marker=".", label=algorithm)
            ax.fill_between(sizes, [r["time_us"]["min"] for r in rows], [r["time_us"]["max"] for r in rows], alpha=0.15)
        _style_panel(ax, f"{op}: time (slowest rank, median)", "time per call (us)")
    if show_busbw:
        ax = next(panel)
        for algorithm in report["algorithms"]["all_reduce"]:
            rows = [r for r in report["collectives"] if r["op"] == "all_reduce" and r["algorithm"] == algorithm]
            ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker=".", label=algorithm)
        _style_panel(ax, "all_reduce: bus bandwidth", "busbw (GB/s)")
    if report["pingpong"]:
        ax = next(panel)
        for peer in sorted({r["peer"] for r in report["pingpong"]}):
            rows = [r for r in report["pingpong"] if r["peer"] == peer]
            ax.plot(
                [r["bytes"] for r in rows],
                [r["latency_us"]["median"] for r in rows],
                marker=".",
                label=f"rank 0 <-> {_peer_label(rows[0])}",
            )
        _style_panel(ax, "ping-pong: latency (half round trip)", "latency (us)")
    return save_figure(figure, path)


def _style_panel(ax: Any, title: str, ylabel: str) -> None:
    """Log-log axes with byte sizes on x, a title, a grid and a legend."""
    bytes_axis(ax)
    ax.set_yscale("log")
    ax.set_title(title)
    ax.set_xlabel("message size")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8)
