"""The report as text or JSON: rank 0 prints it; the other workers print only their problems."""

from __future__ import annotations

import json
import sys

from ddpkit.doctor.results import Report


def format_report(report: Report) -> str:
    """The report as text, for rank 0 to print."""
    env, net, dev = report.environment, report.network, report.devices
    cuda = f"{len(dev.cuda)} CUDA device(s): {', '.join(dev.cuda)}" if dev.cuda else "no CUDA device"
    backends = ", ".join(b for b, ok in (("gloo", dev.gloo), ("nccl", dev.nccl)) if ok) or "none"
    if net.interface:
        why = "set by GLOO_SOCKET_IFNAME" if net.reason == "GLOO_SOCKET_IFNAME" else "routes to the master"
        interface = f"{net.interface} {net.address} ({why})"
    else:
        interface = f"none routes to the master; gloo uses the host name's address {net.address or '(unresolved)'}"
    lines = [
        "ddpkit doctor",
        f"  environment   {env.source}: rank {env.rank} of world_size {env.world_size}, "
        f"local rank {env.local_rank} of {env.local_world_size}, node {env.node_rank} of {env.num_nodes}",
        f"  host          {report.host}",
        f"  master        {env.master_addr}:{env.master_port}",
        f"  interface     {interface}",
        f"  backend       {report.backend} (available: {backends})",
        f"  devices       {dev.cpu_count} CPUs ({dev.usable_cpus} usable), {cuda}, torch {dev.torch}",
    ]
    lines += [f"  warning       {w}" for w in report.warnings]
    lines.append("checks")
    for c in report.checks:
        timing = f" ({c.seconds:.2f} s)" if c.seconds >= 1 else f" ({c.seconds * 1e3:.1f} ms)"
        outcome = f"ok    {c.name}: {c.detail}" if c.ok else f"FAIL  {c.name}: see the problem below"
        lines.append(f"  {outcome}{timing}")
    if report.workers and report.ok and len(report.workers) > 1:
        lines.append("workers")
        lines += _table(report)
        if report.allreduce_latency_us is not None:
            workers, latency = len(report.workers), report.allreduce_latency_us
            lines.append(f"  all_reduce of 4 bytes over {workers} workers: {latency:.0f} us (median)")
    if report.hints:
        lines.append(
            "This process runs alone: nothing to check between workers. To check a job, run the doctor "
            "as every worker of it:"
        )
        lines += [f"  {h}" for h in report.hints]
    lines.append(f"problem: {report.problem}" if report.problem else "result: OK")
    return "\n".join(lines)


def _table(report: Report) -> list[str]:
    links = {p.rank: p for p in report.peers}
    header = ("rank", "node", "host", "interface", "address", "latency us", "bandwidth GB/s")
    rows = [header]
    for w in report.workers:
        link = links.get(w.rank)
        if link:
            measured = (f"{link.latency_us:.0f}", f"{link.bandwidth_gbps:.2f}")
        else:
            measured = ("(rank 0)" if w.rank == 0 else "", "")
        rows.append((str(w.rank), str(w.node_rank), w.host, w.interface or "-", w.address or "-", *measured))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return ["  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows]


def print_report(report: Report, as_json: bool) -> None:
    if report.environment.rank == 0:
        print(json.dumps(report.to_dict(), indent=2) if as_json else format_report(report), flush=True)
    elif not report.ok:
        print(
            f"[rank {report.environment.rank}/{report.environment.world_size}] problem: {report.problem}",
            file=sys.stderr,
            flush=True,
        )
