"""One worker's whole run of the doctor (``examine``); ``ddpkit doctor`` (:mod:`ddpkit.commands.doctor`) starts it."""

from __future__ import annotations

import os
import socket
from collections.abc import MutableMapping

from ddpkit.doctor.checks import join, open_store, reach_master, roll_call, sanity_all_reduce
from ddpkit.doctor.config import DoctorConfig
from ddpkit.doctor.describe import choose_network, describe_devices, network_stack_id, resolved_backend, run_hints
from ddpkit.doctor.diagnoses import loopback_master_warning
from ddpkit.doctor.measure import allreduce_latency, measure_peers
from ddpkit.doctor.results import Check, DoctorProblem, Report, WorkerInfo
from ddpkit.env.base import JobEnvironment
from ddpkit.env.detect import detect_environment
from ddpkit.env.torchrun import uses_agent_store


def examine(cfg: DoctorConfig, environ: MutableMapping[str, str]) -> Report:
    """Run every check as this worker and return its report; problems end up in the report, not raised.

    Args:
        cfg: The doctor's options.
        environ: The process environment (os.environ in a worker: torch's
            env:// rendezvous and gloo read the real one).

    Raises:
        ValueError: the launcher's variables are inconsistent (InconsistentEnvironment).
    """
    env = detect_environment(environ)
    network = choose_network(environ, env.master_addr)
    report = Report(env, socket.gethostname(), network, resolved_backend(cfg, env.local_rank), describe_devices())
    me = WorkerInfo(
        env.rank,
        env.node_rank,
        env.local_rank,
        report.host,
        network.interface,
        network.address,
        network_stack_id(),
        os.getpid(),
    )
    if env.world_size == 1:
        report.workers = [me]
        if env.source == "local":
            report.hints = run_hints()
    warning = loopback_master_warning(env)
    if warning:
        report.warnings.append(warning)
    try:
        _run_checks(cfg, env, environ, report, me)
    except DoctorProblem as p:
        report.checks.append(Check(p.check, False, str(p), p.seconds))
        report.problem = str(p)
    finally:
        from ddpkit import distributed

        distributed.shutdown()
    return report


def _run_checks(
    cfg: DoctorConfig, env: JobEnvironment, environ: MutableMapping[str, str], report: Report, me: WorkerInfo
) -> None:
    store = None
    if env.world_size > 1:
        if env.rank == 0 and not uses_agent_store(environ):
            store, rolls = open_store(env, environ, cfg.timeout)  # rank 0 listens before it connects to itself
            report.checks.append(reach_master(env, cfg.timeout))
        else:
            report.checks.append(reach_master(env, cfg.timeout))
            store, rolls = open_store(env, environ, cfg.timeout)
        report.workers, check = roll_call(rolls, me, env, cfg.timeout)
        report.checks.append(check)
    ctx, check = join(cfg, env, environ, report.workers)
    report.checks.append(check)
    report.checks.append(sanity_all_reduce(ctx, cfg.timeout))
    if env.world_size > 1:
        report.peers = measure_peers(ctx, cfg)
        report.allreduce_latency_us = allreduce_latency(ctx, cfg.latency_iterations)
    del store  # after the process group: rank 0's server may be the group's store too


def examine_local_worker(cfg: DoctorConfig) -> Report:
    """One of nproc local workers: the report goes back to the launching process.

    Module-level: spawned workers unpickle it by reference.
    """
    return examine(cfg, os.environ)
