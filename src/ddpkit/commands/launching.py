"""What ``ddpkit train`` and ``ddpkit run`` share: the launch of local workers from a command's options, the
exit status it ends with, and the lines that say how the workers ended."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from ddpkit.launchers.failure import LaunchError
from ddpkit.names import (
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_PREEMPTED,
    EXIT_STORAGE,
    EXIT_USER_ERROR,
    EXIT_WORKER_FAILED,
)

if TYPE_CHECKING:
    from ddpkit.launchers.local import LaunchSpec
    from ddpkit.launchers.script import RunConfig
    from ddpkit.train.config import TrainConfig


def exit_statuses(again: str) -> tuple[tuple[str, str], ...]:
    """What the exit status of ``ddpkit train`` or ``ddpkit run`` means (their --help lists it); ``again``: what
    continues a run that stopped with a checkpoint."""
    return (
        ("0", "every worker finished"),
        (str(EXIT_WORKER_FAILED), "a worker failed; one report names its rank, exit code and traceback"),
        (str(EXIT_USER_ERROR), "bad input: one line names the fix, before any worker starts"),
        (
            str(EXIT_STORAGE),
            "a checkpoint or metrics.jsonl could not be written (no space, read-only folder): fix it, then run again",
        ),
        (
            str(EXIT_PREEMPTED),
            "preempted: a signal (SIGTERM, SIGUSR1, SIGUSR2) reached the launcher or a worker, and the workers "
            f"wrote a checkpoint and exited 75; {again} (a requeued Slurm job does so by itself)",
        ),
        (str(EXIT_INTERRUPTED), f"Ctrl-C: the workers wrote a checkpoint and stopped; {again}"),
        ("128+N", "the launcher received signal N and the workers did not checkpoint (143: SIGTERM); one line says so"),
    )


def warn_if_oversubscribed(nproc: int, device: str) -> None:
    """One line on stderr when a CPU run starts more workers here than the cores it may use."""
    from ddpkit.train.preflight import cpu_cores, oversubscribed

    crowded = oversubscribed(nproc, device, cpu_cores())
    if crowded is not None:
        print(f"ddpkit: warning: {crowded}", file=sys.stderr)


def quiet_cpp_logs(elastic: bool) -> dict[str, str]:
    """The variables that quiet torch's C++ warnings in the launcher of an elastic job, unless the user set them.

    Its agent's store client logs every closed connection (a node that left, the store's host lost) as a warning
    with a C++ stack, before ddpkit can say in one line what happened; c10 reads TORCH_CPP_LOG_LEVEL once, when
    torch is imported.
    """
    return {"TORCH_CPP_LOG_LEVEL": "ERROR"} if elastic and "TORCH_CPP_LOG_LEVEL" not in os.environ else {}


@contextlib.contextmanager
def environ_set(variables: Mapping[str, str]) -> Iterator[None]:
    """``variables`` in os.environ for the block, the environment as it was after it."""
    before = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch_spec(config: TrainConfig | RunConfig, **options: Any) -> LaunchSpec:
    """The LaunchSpec of a command's options (nproc, the nodes, the port, restarts, the ranks shown), with
    ``options`` added."""
    from ddpkit.launchers.local import LaunchSpec
    from ddpkit.launchers.options import shown_ranks

    nodes = config.nodes
    return LaunchSpec(
        config.nproc,
        config.master_port,
        config.max_restarts,
        nnodes=nodes.min_nodes,
        elastic=nodes.elastic,
        max_nodes=nodes.max_nodes,
        rdzv_id=config.rdzv_id,
        rdzv_last_call=config.rdzv_last_call,
        node_rank=config.node_rank,
        master_addr=config.master_addr,
        show_ranks=shown_ranks(config.show_ranks),
        **options,
    )


def launch(spec: LaunchSpec, fn: Callable[..., object], *args: object) -> tuple[int, str]:
    """Run ``fn(*args)`` in ``spec.nproc`` local workers; the exit status of the command, and the signal that ended it.

    The status: 0 when every worker succeeded; EXIT_PREEMPTED when a worker
    exited with it, or when the launcher received a signal, passed it on, and
    every worker still running exited with it (they checkpointed on their way
    out); EXIT_INTERRUPTED after Ctrl-C; 128 + the signal's number when the
    launcher received a signal and the workers did not checkpoint (one line
    says so). The signal: its name when the launcher received one, else "".

    Raises:
        LaunchError: a worker failed (after the allowed restarts).
    """
    import signal

    from ddpkit.launchers.elastic import StoreLost
    from ddpkit.launchers.local import StoppedBySignal, launch_local

    try:
        launch_local(spec, fn, *args)
    except StoreLost as e:  # an elastic job's store went with its host: no node can go on
        print(f"error: {e}", file=sys.stderr)
        return EXIT_WORKER_FAILED, ""
    except LaunchError as e:
        if e.failure.exitcode in (EXIT_PREEMPTED, EXIT_INTERRUPTED):
            return e.failure.exitcode, ""
        if spec.max_restarts:
            print(
                f"error: the job failed after {spec.max_restarts} restart(s) (max_restarts={spec.max_restarts})",
                file=sys.stderr,
            )
        raise
    except StoppedBySignal as e:  # the launcher itself got the signal and passed it on to the workers
        if e.checkpointed_status is not None:
            return e.checkpointed_status, e.signal_name
        print(f"error: stopped by {e.signal_name}{_how_workers_ended(e.exit_codes)}", file=sys.stderr)
        return 128 + int(signal.Signals[e.signal_name]), e.signal_name
    return 0, ""


def _how_workers_ended(exit_codes: Mapping[int, int | None]) -> str:
    """'; the workers were killed by it (no checkpoint)' or '; rank 0 exited 1, rank 1 ...', for the line above."""
    import signal

    if not exit_codes:
        return " before the workers started"
    if len({code for code in exit_codes.values()}) == 1 and (code := next(iter(exit_codes.values()))):
        if code < 0:
            return f": the workers were killed by {signal.Signals(-code).name} (no checkpoint)"
        return f": the workers exited with status {code}"
    ends = [
        f"rank {rank} {'exited ' + str(code) if code is None or code >= 0 else 'killed by ' + signal.Signals(-code).name}"
        for rank, code in sorted(exit_codes.items())
    ]
    return ": " + ", ".join(ends)


def failed_status(error: LaunchError) -> int:
    """The exit status of a command whose workers failed: the root cause's where it has a meaning of its own
    (EXIT_STORAGE: a checkpoint could not be written; EXIT_DIVERGED: the loss became NaN; EXIT_USER_ERROR: the
    run folder is another run's), else EXIT_WORKER_FAILED."""
    code = error.failure.exitcode
    return code if code in (EXIT_STORAGE, EXIT_DIVERGED, EXIT_USER_ERROR) else EXIT_WORKER_FAILED
