"""Joining the job: device, backend, network interface and process group.

``ddpkit.init()`` is the one call a worker makes, whatever started it
(ddpkit's own launcher, torchrun, srun, mpirun, or plain ``python``)::

    ctx = ddpkit.init()          # detects the environment, joins the group
    model = model.to(ctx.device)
    ...
    ddpkit.shutdown()            # also registered to run at exit

It detects who the process is (``ddpkit.env``), binds the CUDA device of the
local rank before any CUDA tensor exists, resolves the backend (gloo on CPU,
nccl on CUDA), chooses the network interface gloo should use (the one that
routes to the master) unless ``GLOO_SOCKET_IFNAME`` is set, and initialises
the process group with a timeout, so that a missing peer is an error rather
than a hang. This module is the boundary where ddpkit writes ``os.environ``
(the variables torch.distributed reads); nothing deeper does.

A script that formed the default process group itself (``init_process_group``
with a store of its own, say) calls ``ddpkit.init()`` afterwards: ddpkit then
adopts that group instead of joining another, and leaves it to the script to
destroy.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from ddpkit import stacks
from ddpkit.allocator import keep_freed_memory
from ddpkit.env.base import JobEnvironment
from ddpkit.env.detect import detect_environment
from ddpkit.errors import UserError, check_positive
from ddpkit.log import get_logger, show_messages
from ddpkit.process_group import environment_of_existing_group, existing_backend, form_process_group

BACKENDS = ("auto", "gloo", "nccl", "cpu:gloo,cuda:nccl")


@dataclass(frozen=True)
class Context:
    """What a worker needs to know after joining the job."""

    env: JobEnvironment
    """The resolved environment: ranks, sizes, master."""
    device: torch.device
    """The device this worker trains on (its local GPU, or the CPU)."""
    backend: str
    """The process-group backend in use."""

    @property
    def rank(self) -> int:
        """Global rank."""
        return self.env.rank

    @property
    def local_rank(self) -> int:
        """Rank on this node."""
        return self.env.local_rank

    @property
    def world_size(self) -> int:
        """Number of workers in the job."""
        return self.env.world_size

    @property
    def local_world_size(self) -> int:
        """Number of workers on this node."""
        return self.env.local_world_size

    @property
    def node_rank(self) -> int:
        """Index of this worker's node."""
        return self.env.node_rank

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0, the one that logs and writes."""
        return self.env.rank == 0


def resolve_device(requested: str, local_rank: int, cuda_available: bool) -> torch.device:
    """The device for ``requested`` (auto, cpu, cuda) on this local rank.

    Raises:
        ValueError: cuda was asked for on a machine without CUDA.
    """
    if requested == "cuda" and not cuda_available:
        raise UserError("device=cuda but CUDA is not available here; use device=cpu or device=auto")
    if requested == "cpu" or not cuda_available:
        return torch.device("cpu")
    return torch.device("cuda", local_rank)


_FEWER_WORKERS = {
    "local": "nproc={gpus}",
    "torchrun": "torchrun --nproc-per-node {gpus}",
    "slurm": "srun --ntasks-per-node {gpus}",
    "openmpi": "mpirun --npernode {gpus}",
}
"""How each launcher starts fewer workers per node (``JobEnvironment.source``); others: "{gpus} per node"."""


def gpu_shortage(local_world_size: int, num_gpus: int, device: str, source: str = "local") -> str | None:
    """None when this node's workers each get a GPU of their own (or train on the CPU); else the one line that says so.

    ``device`` auto (with GPUs) and cuda give local rank r GPU r, so a node
    with more workers than visible GPUs would fail in ``torch.cuda.set_device``
    ("invalid device ordinal") on the workers beyond them.

    Args:
        local_world_size: workers on this node.
        num_gpus: GPUs visible to them (``torch.cuda.device_count()``, which
            honours CUDA_VISIBLE_DEVICES and does not initialize CUDA).
        device: the device option: auto, cpu or cuda.
        source: the launcher (``JobEnvironment.source``), to word the fix in its terms.
    """
    if device == "cpu" or num_gpus == 0 or local_world_size <= num_gpus:
        return None  # (no GPU at all: auto trains on the CPU, and device=cuda is refused by resolve_device)
    fewer = _FEWER_WORKERS.get(source, "{gpus} per node").format(gpus=num_gpus)
    return (
        f"{local_world_size} workers on this node but {num_gpus} visible GPU{'s' if num_gpus > 1 else ''}: "
        f"device={device} gives each worker a GPU of its own; start {num_gpus} per node ({fewer}), "
        "or train on the CPU (device=cpu), or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
    )


def process_group_options(backend: str, device: torch.device) -> dict[str, Any]:
    """The keywords of ``init_process_group`` that depend on the worker's device.

    On CUDA with nccl, ``device_id``: the group is bound to the worker's GPU
    (torch >= 2.3), so ``barrier()`` and nccl need not guess the device from
    the global rank (torch's warnings "barrier(): using the device under
    current context" and "Guessing device ID based on global rank"), and the
    communicator is formed at once, in ``init``, rather than by the first
    collective. gloo takes no device.
    """
    if device.type == "cuda" and "nccl" in backend:
        return {"device_id": device}
    return {}


def resolve_backend(requested: str, device: torch.device) -> str:
    """The process-group backend for ``requested`` on ``device``.

    Raises:
        ValueError: unknown backend, or nccl without a CUDA device.
    """
    if requested not in BACKENDS:
        raise UserError(f"backend={requested!r} is not valid; choose one of: {', '.join(BACKENDS)}")
    if requested == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if requested == "nccl" and device.type != "cuda":
        raise UserError("backend=nccl needs CUDA devices; use backend=gloo (or auto) on CPU")
    return requested


def default_num_threads(local_world_size: int) -> int:
    """Torch threads per worker: this machine's cores shared among its workers."""
    return max(1, len(os.sched_getaffinity(0)) // local_world_size)


def init(
    backend: str = "auto",
    device: str = "auto",
    timeout: float = 300.0,
    threads: int = 0,
    environ: MutableMapping[str, str] | None = None,
) -> Context:
    """Join the job this process belongs to and return its context.

    Args:
        backend: auto, gloo, nccl or cpu:gloo,cuda:nccl.
        device: auto (the local rank's GPU when CUDA is available), cpu or cuda.
        timeout: seconds a rendezvous or collective waits for peers before failing.
        threads: torch threads for this worker; 0 shares the cores among local workers.
        environ: the environment to read and complete (defaults to ``os.environ``).

    Returns:
        The worker's Context. Calling init again returns the same context.
        Where torch.distributed's default group already exists, init adopts
        it (a collective then: every rank calls init): ranks come from the
        group, and without a launcher's variables the node layout from the
        ranks' host names; ``timeout`` is the group's own.

    Raises:
        ValueError: inconsistent environment or options, or an existing group
            that contradicts the launcher's variables or ``backend``.
        RuntimeError: the process group could not be formed (peer missing,
            port taken); the message names the rank, the master and the fix.
    """
    global _context, _joined_multiprocess_job, _owns_group
    if _context is not None:
        return _context
    check_positive("timeout", timeout)  # NaN or infinity would reach timedelta (a traceback) or wait forever
    if not faulthandler.is_enabled():
        # A worker that dies in C++ (abort, segfault) then prints every thread's
        # Python stack, which the launcher's failure report passes on.
        faulthandler.enable()
    environ = os.environ if environ is None else environ
    env = detect_environment(environ)
    adopted = dist.is_available() and dist.is_initialized()
    if adopted:
        env = environment_of_existing_group(env)
    resolved_device = resolve_device(device, env.local_rank, torch.cuda.is_available())
    if resolved_device.type == "cuda":
        # Every rank of a node with too few GPUs says why, rather than those beyond them failing in set_device.
        shortage = gpu_shortage(env.local_world_size, torch.cuda.device_count(), device, env.source)
        if shortage is not None:
            raise UserError(shortage)
        torch.cuda.set_device(resolved_device)  # before any CUDA tensor: one GPU per local rank
    resolved_backend = existing_backend(backend) if adopted else resolve_backend(backend, resolved_device)
    torch.set_num_threads(threads or default_num_threads(env.local_world_size))
    keep_freed_memory(environ)  # a CPU step's buffers reused, not faulted in again every step
    if not adopted:
        form_process_group(
            env, resolved_backend, timeout, environ, process_group_options(resolved_backend, resolved_device)
        )
        if env.world_size > 1:  # a wait that times out can then ask the others where they are
            stacks.arm(dist.distributed_c10d._get_default_store(), env.rank, environ)
    _owns_group = not adopted
    _context = Context(env, resolved_device, resolved_backend)
    atexit.register(shutdown)
    show_messages(env.rank, env.world_size)
    _say_restart(environ, env.rank)
    _joined_multiprocess_job = _joined_multiprocess_job or env.world_size > 1
    return _context


NODES_CHANGED_VARIABLE = "DDPKIT_NODES_CHANGED_FILE"
"""The file in which the agent of an elastic ``ddpkit run``/``ddpkit train`` writes, at each round, which nodes
left or joined since the round before ("node 10.0.0.2 left"; empty: none), for :func:`nodes_change_line`."""
NODES_JOINING = "nodes are joining"
"""What the agent writes in that file just before it stops its workers (SIGTERM) for nodes waiting to join: the
workers' checkpoint on that signal is no preemption, and :func:`nodes_joining` lets them say so."""


def nodes_change(environ: Mapping[str, str]) -> str:
    """Which nodes left or joined before this round of an elastic ddpkit launch ('node B left'), else ''."""
    path = environ.get(NODES_CHANGED_VARIABLE, "")
    try:
        with open(path, encoding="utf-8") as file:
            return file.read().strip()
    except OSError:  # no file: not an elastic ddpkit launch, or its first round
        return ""


def nodes_joining(environ: Mapping[str, str]) -> bool:
    """Whether this elastic ddpkit launch's agent is stopping the workers to take in nodes that wait to join."""
    return nodes_change(environ) == NODES_JOINING


def nodes_change_line(environ: Mapping[str, str], saved_world_size: int, world_size: int, global_step: int) -> str:
    """The line of a resume in an elastic job whose size changed, else ''.

    ``node X left; continuing on K nodes, W workers, from step S``: the
    nodes by name under ddpkit's launcher, by count under torchrun's (whose
    agents do not say which node went; there, only in a restarted round, as
    a job started again at another size is not one that lost a node). K is
    torchelastic's GROUP_WORLD_SIZE.
    """
    nodes = environ.get("GROUP_WORLD_SIZE")
    if nodes is None or saved_world_size == world_size:
        return ""
    change = nodes_change(environ)
    if not change and (NODES_CHANGED_VARIABLE in environ or not int(environ.get("TORCHELASTIC_RESTART_COUNT") or 0)):
        return ""  # not a change of this job's nodes: a run started again at another size (said in detail)
    if not change:
        per_node = int(environ.get("LOCAL_WORLD_SIZE", "1") or 1)
        count = abs(saved_world_size - world_size) // per_node or 1
        change = f"{count} node(s) {'left' if world_size < saved_world_size else 'joined'}"
    return (
        f"{change}; continuing on {nodes} nodes, {world_size} workers, from step {global_step} "
        "(the same global batch and sample order)"
    )


def _say_restart(environ: Mapping[str, str], rank: int) -> None:
    """On rank 0 of a restarted round (torchrun's, ddpkit run's), one line: which restart this is.

    None when nodes left or joined: the resume says so (:func:`nodes_change_line`).
    """
    restart = int(environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    if restart and rank == 0 and not nodes_change(environ):
        limit = environ.get("TORCHELASTIC_MAX_RESTARTS", "?")
        get_logger().warning(
            f"restart {restart} of {limit}: the workers were started again after a failure; "
            "a Checkpointer with resume('auto') continues from the newest checkpoint"
        )


def shutdown() -> None:
    """Leave the process group (safe to call more than once); a group init adopted stays to its creator."""
    global _context, _owns_group
    if _owns_group and dist.is_available() and dist.is_initialized():
        # A gloo thread frees a collective's tensors just after its caller moved on, taking the GIL to do so.
        # A DDP model that outlives the group (a script's, still in scope) destroys the group when it is freed,
        # holding the GIL, and joins those threads: with one of them still waiting for the GIL, the process
        # hangs (2 runs in 60 of a script ending so; none in 70 with this). A moment without the GIL lets them finish.
        time.sleep(GLOO_THREADS_SETTLE_S)
        dist.destroy_process_group()
        stacks.disarm()
    _context = None
    _owns_group = True


def exit_process(code: int, leave_group: bool = True) -> NoReturn:
    """End this process with ``code`` once its work is done and written (or it failed and said why).

    The process flushes its output and logs, then exits without the
    interpreter's teardown (``os._exit``, as multiprocessing's children do).
    The teardown of an interpreter that imported torch takes 0.4-0.8 s on a
    2-core machine and does nothing a finished command needs. Besides, in
    multi-host runs with the shared-memory all_reduce, a worker that had
    finished and written everything was seen aborting in that teardown
    ("terminate called without an active exception", about one run in three
    under torchrun across network namespaces), which turned a successful job
    into a failed one.

    A process that took part in a multi-process job leaves the group (unless
    ``leave_group`` is False) and flushes its logs; any other process runs its
    ``atexit`` handlers first, as a normal exit would (logging, temporary
    folders, a one-process group).

    Args:
        code: the exit status.
        leave_group: destroy the process group first; a failed worker passes False
            so that its peers notice only once it is gone.
    """
    if _joined_multiprocess_job:
        if leave_group:
            shutdown()
        logging.shutdown()
    else:
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can be said
            pass
    os._exit(code)


def context() -> Context:
    """The context of the current worker.

    Raises:
        RuntimeError: ddpkit.init() has not been called.
    """
    if _context is None:
        raise RuntimeError("ddpkit.init() has not been called in this process; call it first")
    return _context


def worker_device() -> torch.device | None:
    """The device this worker trains on: ddpkit.init's choice; without it, the current GPU of an nccl group; else None.

    What ``ddpkit.DataLoader(device="auto")`` places its batches on when it is a CUDA device.
    """
    if _context is not None:
        return _context.device
    if dist.is_available() and dist.is_initialized() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return None


def joined() -> bool:
    """True between ``ddpkit.init()`` and ``ddpkit.shutdown()`` in this process."""
    return _context is not None


def local_ranks() -> tuple[int, int]:
    """(local_rank, local_world_size) of this process: its place among the workers of its node.

    From ``ddpkit.init()``'s context; (0, 1) before it, or in a process that never called it.
    """
    if _context is None:
        return 0, 1
    return _context.local_rank, _context.env.local_world_size


@contextlib.contextmanager
def main_process_first(local: bool = True) -> Iterator[None]:
    """Run the enclosed block on the main process first, then on the others.

    With ``local=True`` the main process is local rank 0 of each node (for
    node-local work such as downloading data); otherwise global rank 0.
    """
    ctx = context()
    is_first = (ctx.local_rank if local else ctx.rank) == 0
    if not is_first:
        _barrier()
    try:
        yield
    finally:
        if is_first:
            _barrier()


def _barrier() -> None:
    """``dist.barrier()``; under nccl on this worker's GPU (a group formed without ddpkit's device_id, adopted)."""
    if dist.get_backend() == "nccl":
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


GLOO_THREADS_SETTLE_S = 0.01
"""How long ``shutdown`` leaves the GIL to gloo's threads before leaving the group (see there)."""

_context: Context | None = None
_joined_multiprocess_job = False
_owns_group = True  # False while the context belongs to a group that init adopted


def control_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device of small control tensors (metrics, agreements) for a collective on ``group``.

    nccl takes CUDA tensors only; gloo (and ``cpu:gloo,cuda:nccl`` for CPU
    tensors) takes CPU tensors. Every control collective of ddpkit builds its
    tensor here, so that it works on both.
    """
    if dist.is_available() and dist.is_initialized() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
