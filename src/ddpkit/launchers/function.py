"""``ddpkit.launch(fn, *args, nproc=N)``: N workers from Python, a notebook cell or a REPL.

::

    import ddpkit

    def train(epochs):
        ctx = ddpkit.init()                  # rank, world_size, device: as under ddpkit run
        ...
        return final_loss

    losses = ddpkit.launch(train, 3, nproc=2)   # [rank 0's, rank 1's]

``fn(*args)`` runs in ``nproc`` workers on this machine, started by the
launcher of ``ddpkit run`` and ``ddpkit train``
(:func:`ddpkit.launchers.local.launch_local`: torch's elastic agent, a
rendezvous on loopback at a free port, torchrun's variables in every worker,
so ``ddpkit.init()`` joins the job, one report of a failed rank, restarts).
``fn`` is called with ``args`` only: a worker learns its rank from
``ddpkit.init()`` (``ctx.rank``), as a script does. A script written for
``mp.spawn(train, nprocs=N, args=(a, b))`` ports as
``ddpkit.launch(train, a, b, nproc=N)`` with ``train(a, b)`` taking
``rank = ddpkit.init().rank`` instead of its first parameter (docs/guides/notebooks.md).

What comes back
---------------
The workers' return values, in rank order (they travel pickled, so return
tensors, numbers or containers of them). A failed rank raises one
:class:`~ddpkit.launchers.failure.LaunchError` naming the rank, its exit code,
the error and its traceback (one line for a :class:`ddpkit.UserError`);
``max_restarts=K`` restarts all workers up to K times first. Ctrl-C (in a
notebook, the stop button) is passed on to the workers once: a loop with a
``ddpkit.Checkpointer`` finishes its step, writes a checkpoint and stops
(press again to stop at once); ``launch`` then raises ``KeyboardInterrupt``.
SIGTERM, SIGHUP and SIGQUIT sent to the launcher (a preemption) are passed
on too: such a loop checkpoints and exits 75, which ``launch`` raises as a
LaunchError that says to call it again.

Where the workers start from
----------------------------
``multiprocessing``'s spawn and forkserver start a worker by importing
``fn`` by name, which fails for a function defined in a notebook cell or a
REPL. Where it is safe, ``launch`` forks the workers from this process
instead (``start_method="fork"``): nothing is pickled, and a worker starts
with everything the notebook has defined. A fork is unsafe, and refused in
one line naming the fix, where:

- CUDA is initialized here (a forked worker cannot use it): restart the
  kernel and call ``ddpkit.launch`` before any CUDA call;
- this process has joined a process group (``ddpkit.init()``): the workers
  would share it; call ``ddpkit.shutdown()`` first;
- another thread of the program is running (not a daemon: a notebook
  kernel's own threads are), so a worker would copy it half-way, with any
  lock it holds: let it finish first.

Wherever ``fn`` can be imported by name (a function of a module file, or of
the script being run), an unsafe fork is avoided: the workers are forked
from ddpkit's warm worker server instead, as under ``ddpkit run``
(``start_method="forkserver"``; ``fn`` and ``args`` are then pickled).

A worker is forked from a thread of the launcher's own, never from the
caller's: where the notebook ran a parallel torch operator, torch's OpenMP
thread pool belongs to the thread that ran it, and a worker forked from that
thread would hang in its first one (see
:func:`ddpkit.launchers.local._in_a_thread_of_its_own`). A worker dies with
the launcher (``PR_SET_PDEATHSIG``, through the worker server where that
is its parent): a kernel that is restarted or killed leaves no worker
behind. The first fork imports ``torch._dynamo`` here
(:data:`FORK_PRELOAD`, about 1 s once), which each worker's first optimizer
step would otherwise import again on every launch.

Output
------
Each worker writes its ``stdout`` and ``stderr`` (Python's and the file
descriptors', so C libraries' too) to files of its rank, in a folder of
this launch under ``<tmp>/ddpkit-logs-<uid>/`` (named on the first line;
:mod:`ddpkit.launchers.output`, which keeps the newest launches' folders).
As under ``ddpkit run``, a thread of the launcher shows rank 0's lines
here as they grow; every rank's whole output, a failed rank's traceback
included, is in its files. Here is the caller's ``sys.stdout`` and
``sys.stderr`` at the call: in a notebook, the cell. A forked worker
cannot write to a notebook's streams itself: they are sockets served by
threads of the kernel, which a fork does not copy.

Pipeline: (fn, args, options) -> start method -> LaunchSpec -> launch_local
(each worker: output to its files, ``fn(*args)``) -> results in rank order.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pickle
import sys
import threading
from collections.abc import Callable
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ddpkit import allocator
from ddpkit.errors import UserError, check_choice, check_positive
from ddpkit.gc_pause import import_paused
from ddpkit.launchers.failure import LaunchError
from ddpkit.launchers.local import LaunchSpec, launch_local
from ddpkit.launchers.output import default_log_dir
from ddpkit.names import EXIT_INTERRUPTED, EXIT_PREEMPTED

SHOWN = frozenset({0})
"""The ranks whose output the caller's console (a notebook's cell) shows, as under ``ddpkit run``."""

START_METHODS = ("auto", "fork", "forkserver")
"""``start_method`` of :func:`launch`: auto forks where it is safe, else uses the worker server where fn is importable."""

FORK_PRELOAD = ("torch._dynamo",)
"""Imported here before the first fork, so that forked workers inherit it: what a worker's first optimizer step
imports (about 1 s of a core), which every worker of every launch would import again otherwise."""

MAX_PORT = 65535
"""The highest TCP port."""


def launch(
    fn: Callable[..., Any],
    *args: Any,
    nproc: int = 1,
    max_restarts: int = 0,
    master_port: int = 0,
    start_method: str = "auto",
) -> list[Any]:
    """Run ``fn(*args)`` in ``nproc`` workers on this machine and return their results in rank order.

    Works from a script, a REPL and a notebook cell, with ``fn`` defined
    there (see the module's documentation for how the workers start).

    Args:
        fn: the function every worker calls; it joins the job with ``ddpkit.init()``.
        *args: its arguments, the same for every worker.
        nproc: number of workers.
        max_restarts: times all workers are started again after one fails.
        master_port: rendezvous port on 127.0.0.1; 0 asks the OS for a free one.
        start_method: auto, fork (from this process, as it is) or forkserver (from ddpkit's
            worker server: ``fn`` must be importable by name, and ``fn`` and ``args`` are pickled).

    Returns:
        ``[fn's result on rank 0, on rank 1, ...]``.

    Raises:
        UserError: a bad option, or workers that cannot start from here (the message names the fix).
        LaunchError: a worker failed (after the restarts): its rank, exit code and error; or the launcher
            got SIGTERM (a preemption) and the workers stopped after a checkpoint (exit code 75).
        KeyboardInterrupt: Ctrl-C (a notebook's stop button) stopped the workers.
    """
    __tracebackhide__ = True  # IPython and pytest show the caller's line, not this one
    check_whole_number("nproc", nproc, "e.g. nproc=2")
    check_whole_number("max_restarts", max_restarts, "e.g. max_restarts=1")
    check_whole_number("master_port", master_port, "a port from 1 to 65535, or 0 for a free one")
    check_positive("nproc", nproc)
    check_positive("max_restarts", max_restarts, allow_zero=True)
    if not 0 <= master_port <= MAX_PORT:
        raise UserError(
            f"master_port={master_port} is not valid; give a port from 1 to {MAX_PORT}, or 0 for a free one"
        )
    check_choice("start_method", start_method, START_METHODS)
    if not callable(fn):
        raise UserError(f"fn={fn!r} is not callable; pass the function each worker runs, e.g. ddpkit.launch(train)")
    allocator.setting(os.environ)  # DDPKIT_MALLOC: every worker's init would refuse a bad one
    method = choose_start_method(start_method, fn)
    if method == "fork":
        import_paused(*FORK_PRELOAD)  # once per process; a no-op after
    spec = LaunchSpec(
        nproc,
        master_port=master_port,
        max_restarts=max_restarts,
        start_method=method,
        log_dir=str(default_log_dir("launch")),
        show_ranks=SHOWN,
    )
    try:
        results = launch_local(spec, _Worker(fn), *args)
    except LaunchError as e:
        if e.failure.exitcode == EXIT_INTERRUPTED:
            raise KeyboardInterrupt("ddpkit.launch: the workers were stopped (Ctrl-C)") from None
        # A UserError reads as its one line; any other failure names the rank's files.
        failure = dataclasses.replace(e.failure, output="", traceback="") if e.failure.user_error else e.failure
        if failure.exitcode == EXIT_PREEMPTED and not failure.traceback:  # SIGTERM, SIGUSR1...
            preempted = "stopped by a signal after writing a checkpoint; call ddpkit.launch again to continue"
            raise LaunchError(dataclasses.replace(failure, message=preempted)) from None
        # Raised anew: its traceback ends at this call, not inside the launcher.
        raise LaunchError(failure) from None
    return [results[rank] for rank in range(nproc)]


def check_whole_number(name: str, value: object, example: str) -> None:
    """Raise a one-line UserError unless ``value`` is an int (a bool, a float or a string is not): it names the fix.

    Checked here, in the caller: a string or a float would otherwise fail deep inside the launcher as a raw
    TypeError, and True (an int to Python) would start one worker that then fails.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(
            f"{name}={value!r} is not valid; it must be a whole number ({example}), not a {type(value).__name__}"
        )


def choose_start_method(requested: str, fn: Callable[..., Any]) -> str:
    """Return "fork" or "forkserver" for ``requested`` (one of :data:`START_METHODS`), or a UserError naming the fix.

    auto: fork where :func:`fork_hazard` finds nothing, else the worker
    server where ``fn`` is importable by name.
    """
    name = getattr(fn, "__qualname__", repr(fn))
    module_fix = f"define {name} in a module file and import it from there (the workers then start fresh)"
    if requested == "forkserver":
        if not importable(fn):
            raise UserError(
                f"start_method='forkserver' needs a function the workers can import by name, and {name} is "
                f"defined here ({getattr(fn, '__module__', '?')}); {module_fix}, or use start_method='fork'"
            )
        return "forkserver"
    hazard = fork_hazard()
    if hazard is None:
        return "fork"
    if requested == "auto" and importable(fn):
        return "forkserver"
    problem, fix = hazard
    alternative = ", or use start_method='auto'" if importable(fn) else f", or {module_fix}"
    raise UserError(f"ddpkit.launch cannot fork its workers from this process: {problem}; {fix}{alternative}")


def fork_hazard() -> tuple[str, str] | None:
    """Why forking workers from this process is unsafe, as (problem, fix), or None where it is safe."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return (
            "CUDA is initialized in it, and a forked worker cannot use CUDA",
            "restart the kernel (or the interpreter) and call ddpkit.launch before any CUDA call",
        )
    distributed = sys.modules.get("ddpkit.distributed")
    joined = distributed is not None and distributed.joined()
    if joined or (torch is not None and torch.distributed.is_available() and torch.distributed.is_initialized()):
        return (
            "it has joined a process group, which the workers would share",
            "call ddpkit.shutdown() (or torch.distributed.destroy_process_group()) first",
        )
    current, main = threading.current_thread(), threading.main_thread()
    running = [t for t in threading.enumerate() if t not in (current, main) and not t.daemon and t.is_alive()]
    if running:
        return (
            f"thread {running[0].name!r} is running, and a worker would copy it half-way, with any lock it holds",
            "let it finish first (thread.join())",
        )
    return None


def importable(fn: Callable[..., Any]) -> bool:
    """True if a fresh process can import ``fn`` by name: a module-level function of a module, or of the script run."""
    qualname = getattr(fn, "__qualname__", "")
    module = getattr(fn, "__module__", None)
    if not qualname or "<" in qualname or module is None:  # a lambda, a closure, a callable object
        return False
    if module == "__main__":  # multiprocessing imports the script again in the worker: only a real script
        main_file = getattr(sys.modules["__main__"], "__file__", None)
        try:
            source = inspect.getsourcefile(fn)
        except TypeError:
            return False
        if not main_file or not source or os.path.realpath(source) != os.path.realpath(main_file):
            return False
    try:
        pickle.dumps(fn)
    except Exception:
        return False
    return True


class _Worker:
    """What each worker runs: ``fn(*args)``, its result checked for the way back.

    A class at module level, so that the worker server can unpickle it (with ``fn`` by name).
    """

    def __init__(self, fn: Callable[..., Any]):
        self.fn = fn

    def __call__(self, *args: Any) -> Any:
        result = self.fn(*args)
        try:
            ForkingPickler.dumps(result)  # as the agent's queue will send it
        except Exception as e:
            raise UserError(
                f"{getattr(self.fn, '__qualname__', 'fn')} returned a {type(result).__name__} that cannot be "
                f"sent back to the launcher ({type(e).__name__}: {e}); return tensors, numbers, strings, "
                "or lists and dicts of them"
            ) from None
        return result
