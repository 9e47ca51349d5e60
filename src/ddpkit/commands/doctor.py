"""``ddpkit doctor``: the checks of :mod:`ddpkit.doctor`, run as this worker or as nproc local workers."""

from __future__ import annotations

import os
from collections.abc import Sequence

from ddpkit.commands.help import CommandHelp

DOCTOR_HELP = CommandHelp(
    usage="ddpkit doctor [key=value ...]",
    summary="Print what each worker sees (launcher, ranks, network interface, devices, backend) and check "
    "that the workers reach each other: rendezvous, roll call, process group, all_reduce, then "
    "latency and bandwidth between rank 0 and every peer. Run it as the training runs "
    "(nproc=N here, or under torchrun, srun or mpirun).",
    schema="ddpkit.doctor.config:DoctorConfig",
    examples=("ddpkit doctor nproc=2", "srun --nodes 2 --ntasks-per-node 4 python -m ddpkit doctor"),
)


def doctor_command(words: Sequence[str]) -> int:
    """``ddpkit doctor [key=value ...]``: run the checks as this worker (or as nproc local ones).

    Args:
        words: key=value options of DoctorConfig, or YAML files.

    Returns:
        0 when every check passed (on every local worker with nproc), 1 otherwise.

    Raises:
        ValueError: bad option or inconsistent launcher variables.
        LaunchError: a local worker crashed (not a failed check: those are reported).
    """
    from ddpkit.doctor import DoctorConfig, examine, resolved_backend  # deferred: the help needs none of it
    from ddpkit.doctor.report import print_report
    from ddpkit.doctor.run import examine_local_worker
    from ddpkit.env.detect import detect_environment
    from ddpkit.keyvalue import parse

    cfg = parse(DoctorConfig, words)
    env = detect_environment(os.environ)
    if env.source != "local" or cfg.nproc == 1:
        report = examine(cfg, os.environ)
        print_report(report, cfg.json)
        return 0 if report.ok else 1
    from ddpkit.launchers.local import LaunchSpec, launch_local

    resolved_backend(cfg, 0)  # bad options fail here, once, rather than in every worker
    results = launch_local(LaunchSpec(cfg.nproc, cfg.master_port), examine_local_worker, cfg)
    reports = [results[rank] for rank in sorted(results)]
    for report in reports:
        print_report(report, cfg.json)
    return 0 if all(r.ok for r in reports) else 1
