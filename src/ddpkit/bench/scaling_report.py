"""The ``ddpkit bench scaling`` report as text and figures.

From the report dict that :func:`ddpkit.bench.scaling.run_scaling_benchmark`
builds: the terminal table, the projection in words, the Markdown file and the
PNG (speedup, efficiency, time per step by part, model against measurement,
projected speedup). Nothing here measures; a committed JSON renders again with
:func:`render_markdown` and :func:`plot_report`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddpkit.bench.scaling_spec import PARTS
from ddpkit.figures import format_bytes, new_figure, save_figure

TOLERANCE = 0.25
"""Prediction error the report flags as within the model (|predicted / measured - 1|)."""


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"


def _num(value: float | None, fmt: str = ".2f") -> str:
    return "-" if value is None else format(value, fmt)


def render_table(report: dict[str, Any]) -> str:
    """The terminal table: one line per configuration, times in milliseconds."""
    head = (
        f"{'configuration':<28} {'data':>6} {'fwd':>6} {'bwd':>6} {'optim':>6} {'comm':>6} {'step':>7} "
        f"{'pred':>7} {'err':>5} {'samples/s':>10} {'speedup':>7} {'eff':>5}"
    )
    lines = [
        f"scaling: {report['workload']['id']} ({report['workload']['model']}), times in ms per step",
        head,
        "-" * len(head),
    ]
    for r in report["rows"]:
        b = r["breakdown_s"]
        lines.append(
            f"{r['name']:<28} "
            + " ".join(f"{b[p] * 1e3:6.3f}" for p in PARTS)
            + f" {r['step_s']['median'] * 1e3:7.3f} {r['predicted_step_s'] * 1e3:7.3f} "
            f"{100 * r['prediction_error']:+4.0f}% {r['samples_per_s']:10,.0f} {_num(r['speedup']):>7} "
            f"{_pct(r['efficiency']):>5}"
        )
    return "\n".join(lines)


def render_markdown(report: dict[str, Any], png_name: str | None = None) -> str:
    """The Markdown report: method, measured table, model vs measured, bottlenecks, projection."""
    m, w = report["machine"], report["workload"]
    rows = report["rows"]
    lines = [
        f"# Scaling: {w['id']} ({w['model']} on {w['dataset']}, batch {w['batch_size']} {w['batch_scope']})",
        "",
        f"{m['date']} · torch {m['torch']} · {m['cpu_model']} · {m['cores']} cores · {report['runtime_s']:.0f} s · "
        f"load average {report['load_average']['before']:.1f} before, {report['load_average']['after']:.1f} after "
        "(other users' processes share the cores)",
        "",
        f"Command: `ddpkit bench scaling {' '.join(report['command_words'])}`",
        "",
        "Method: " + "; ".join(f"{k}: {v}" for k, v in report["method"].items()) + ".",
        "",
        "## Measured (ms per step; median over steps, slowest rank)",
        "",
        "| configuration | data | forward | backward | optimizer | exposed comm | step (min-max) | samples/s "
        "| speedup | efficiency |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        b, s = r["breakdown_s"], r["step_s"]
        lines.append(
            f"| {r['name']} | "
            + " | ".join(f"{b[p] * 1e3:.3f}" for p in PARTS)
            + f" | {s['median'] * 1e3:.3f} ({s['min'] * 1e3:.3f}-{s['max'] * 1e3:.3f}) "
            f"| {r['samples_per_s']:,.0f} | {_num(r['speedup'])} | {_pct(r['efficiency'])} |"
        )
    within = sum(abs(r["prediction_error"]) <= TOLERANCE for r in rows)
    lines += [
        "",
        f"## Model against measurement ({within} of {len(rows)} within {100 * TOLERANCE:.0f}%)",
        "",
        "| configuration | alpha (us) | beta (GB/s) | all_reduce of gradients (ms) | isolated (ms) | compute (ms) "
        "| sync overhead (ms) | predicted (ms) | measured (ms) | error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        f = r.get("comm_fit")
        lines.append(
            f"| {r['name']} | {_num(f and f['alpha_s'] * 1e6, '.1f')} "
            f"| {_num(f and 1 / f['beta_s_per_byte'] / 1e9 if f and f['beta_s_per_byte'] else None)} "
            f"| {_num(f and f['allreduce_gradient_s'] * 1e3, '.3f')} "
            f"| {_num(f and f['isolated']['allreduce_gradient_s'] * 1e3, '.3f')} | {r['compute_s'] * 1e3:.3f} "
            f"| {r['sync_overhead_s'] * 1e3:.3f} "
            f"| {r['predicted_step_s'] * 1e3:.3f} | {r['step_s']['median'] * 1e3:.3f} "
            f"| {100 * r['prediction_error']:+.1f}% |"
        )
    lines += ["", "## Bottleneck of each configuration", ""]
    lines += [f"- **{r['name']}**: {r['bottleneck']}." for r in rows]
    p = report["projection"]
    lines += [
        "",
        f"## Projection beyond this machine (one worker per node, up to {p['max_world_size']} nodes)",
        "",
        f"Compute per step = {p['compute_fit']['c0_s'] * 1e3:.3f} ms + "
        f"{p['compute_fit']['c1_s_per_sample'] * 1e6:.2f} us x samples per worker (fitted on one worker's compute-only step at per-worker batches halved down to 1); "
        f"gradients {format_bytes(p['gradient_bytes'])}; ring all_reduce. Networks are projected, not emulated "
        "(this kernel has no netem).",
        "",
        "| network | alpha (us) | bandwidth (Gb/s) | speedup at 2 / 8 / 64 | best speedup (at nodes) "
        "| efficiency < 50% from |",
        "|---|---|---|---|---|---|",
    ]
    for n in p["networks"]:
        by_size = {q["world_size"]: q for q in n["points"]}
        at = " / ".join(_num(by_size[s]["speedup"]) if s in by_size else "-" for s in (2, 8, 64))
        limit = n["limit"]
        half = limit["half_efficiency_world_size"]
        lines.append(
            f"| {n['name']} | {n['latency_s'] * 1e6:.0f} | {n['bandwidth_bytes_per_s'] * 8 / 1e9:.0f} "
            f"| {at} | {limit['best_speedup']:.2f} ({limit['best_world_size']}) "
            f"| {half if half else 'never'} nodes |"
        )
    lines += ["", render_projection_sentence(report)]
    if png_name:
        lines += ["", f"![scaling plots]({png_name})"]
    return "\n".join(lines) + "\n"


def render_projection_sentence(report: dict[str, Any]) -> str:
    """The projection in one paragraph: where each network stops scaling, and what caps the speedup."""
    p = report["projection"]
    words = []
    for n in p["networks"]:
        limit = n["limit"]
        half = limit["half_efficiency_world_size"]
        words.append(
            f"on {n['name']} it stops scaling at about {limit['best_world_size']} nodes "
            f"(speedup {limit['best_speedup']:.1f})"
            + (f" and falls below 50% efficiency from {half} nodes" if half else "")
        )
    cap = (
        ""
        if p["per_worker"]
        else (
            f" With a global batch of {p['batch_size']}, more than {p['batch_size']} "
            "nodes would have workers without a sample."
        )
    )
    c0, c1 = p["compute_fit"]["c0_s"], p["compute_fit"]["c1_s_per_sample"]
    if not p["per_worker"] and c0 > 0:
        # Even a free network cannot shrink the per-step cost that does not depend on the batch.
        ceiling = (c0 + c1 * p["batch_size"]) / (c0 + c1)
        cap += (
            f" Whatever the network, the per-step compute that does not shrink with the batch "
            f"({c0 * 1e3:.3f} ms of {(c0 + c1 * p['batch_size']) * 1e3:.3f} ms) caps the speedup at "
            f"{ceiling:.1f}."
        )
    return "In words: " + "; ".join(words) + "." + cap


def plot_report(report: dict[str, Any], path: Path) -> Path | None:
    """Five panels: speedup, efficiency, time breakdown, predicted vs measured, projection."""
    made = new_figure(5, ncols=3)
    if made is None:
        return None
    figure, (ax_speed, ax_eff, ax_parts, ax_pred, ax_proj) = made
    rows = report["rows"]
    base = next((r for r in rows if r["workers"] == 1), None)
    series: dict[tuple[int, str], list[dict[str, Any]]] = {}
    for r in rows:
        if r["workers"] > 1:
            series.setdefault((r["nodes"], r["allreduce"]), []).append(r)
    max_workers = max(r["workers"] for r in rows)
    for (nodes, algorithm), points in series.items():
        points = ([base] if base else []) + sorted(points, key=lambda r: r["workers"])
        label = f"{algorithm}, {nodes} node{'s' if nodes > 1 else ''}"
        if points[0]["speedup"] is not None:
            ax_speed.plot([r["workers"] for r in points], [r["speedup"] for r in points], marker="o", label=label)
            ax_eff.plot([r["workers"] for r in points], [r["efficiency"] for r in points], marker="o", label=label)
    ax_speed.plot([1, max_workers], [1, max_workers], "k:", label="ideal")
    ax_eff.axhline(1.0, color="k", linestyle=":")
    for ax, title, ylabel in (
        (ax_speed, "speedup vs 1 worker", "speedup"),
        (ax_eff, "efficiency (speedup / workers)", "efficiency"),
    ):
        ax.set_title(title)
        ax.set_xlabel("workers")
        ax.set_ylabel(ylabel)
        ax.set_xticks(sorted({r["workers"] for r in rows}))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    names = [r["name"].replace(", ", "\n") for r in rows]
    bottom = [0.0] * len(rows)
    for part in PARTS:
        heights = [r["breakdown_s"][part] * 1e3 for r in rows]
        ax_parts.bar(names, heights, bottom=bottom, label=part.replace("_", " "))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax_parts.set_title("time per step")
    ax_parts.set_ylabel("ms")
    ax_parts.tick_params(axis="x", labelsize=6)
    ax_parts.legend(fontsize=7)
    measured = [r["step_s"]["median"] * 1e3 for r in rows]
    predicted = [r["predicted_step_s"] * 1e3 for r in rows]
    ax_pred.scatter(measured, predicted)
    for r, x, y in zip(rows, measured, predicted):
        ax_pred.annotate(r["name"], (x, y), fontsize=6)
    top = max(measured + predicted) * 1.15
    ax_pred.plot([0, top], [0, top], "k:", label="exact")
    ax_pred.fill_between(
        [0, top], [0, top * (1 - TOLERANCE)], [0, top * (1 + TOLERANCE)], alpha=0.15, label=f"±{100 * TOLERANCE:.0f}%"
    )
    ax_pred.set_xlim(0, top)
    ax_pred.set_ylim(0, top)
    ax_pred.set_title("model vs measured step")
    ax_pred.set_xlabel("measured (ms)")
    ax_pred.set_ylabel("predicted (ms)")
    ax_pred.legend(fontsize=7)
    for n in report["projection"]["networks"]:
        ax_proj.plot([q["world_size"] for q in n["points"]], [q["speedup"] for q in n["points"]], label=n["name"])
    ax_proj.set_xscale("log")
    ax_proj.set_yscale("log")
    ax_proj.set_title(f"projected speedup ({report['workload']['id']}, one worker per node)")
    ax_proj.set_xlabel("nodes")
    ax_proj.set_ylabel("speedup")
    ax_proj.grid(True, alpha=0.3, which="both")
    ax_proj.legend(fontsize=7)
    return save_figure(figure, path)
