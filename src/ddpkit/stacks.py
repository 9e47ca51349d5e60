"""Hangs tell where: on a timeout, the ranks still alive dump their Python stacks, and the report names them.

A rank that waits too long for its peers (a collective or a checkpoint save
that times out) knows only that someone did not come. Where that someone
was stuck is in its own process. So every rank of a multi-process job arms
:mod:`faulthandler` at ``ddpkit.init()`` on :data:`DUMP_SIGNAL`, writing all
its threads' stacks into ``rank-<r>.txt`` of a stack folder, and publishes
its host and pid in the job's store. The rank whose wait timed out then
signals every peer on its host (:func:`dump_peers`), waits for the files,
and its failure report names each peer's innermost frame and file::

    error: worker rank 0 failed (exit code 1): RuntimeError: shm all_reduce: rank 1 did not arrive
    within 20.0 s ...; rank 1 was at train.py:41 in step (time.sleep) (stack: runs/x/stacks/rank-1.txt)

faulthandler writes from its C signal handler, without the interpreter's
lock, so a rank blocked in ``time.sleep``, a socket or a C call dumps too. A
rank that is stopped (SIGSTOP, a debugger) cannot: it is named as stopped.
Peers on other hosts cannot be signalled from here; their files are named
if they exist.

The stack folder is ``$DDPKIT_STACK_DIR`` (``ddpkit train`` sets
``<output_dir>/stacks``; ``ddpkit run`` a folder it names), else
``<tmp>/ddpkit-stacks-<user id>/<run id>-<job id>-<port>``. An empty stack
file (and then an empty folder) is removed when its rank leaves the group.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import re
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

STACK_DIR_VARIABLE = "DDPKIT_STACK_DIR"
"""Environment variable naming the folder of the stack files."""
DUMP_SIGNAL = signal.SIGRTMIN + 5
"""The signal a rank dumps its stacks on (a real-time signal: no library or scheduler sends it)."""
TIMEOUT_MARKERS = ("did not arrive within", "Timed out", "timed out", "within the timeout")
"""Error texts of a wait that timed out: the rank that raised them asks its peers for their stacks."""
DUMP_WAIT_SECONDS = 1.0
"""How long the asking rank waits for the peers' files."""

_KEY = "ddpkit/stacks/{rank}"
_armed: dict[str, Any] = {}


def stack_folder(environ: Mapping[str, str]) -> Path:
    """The folder of the stack files (see the module docstring)."""
    folder = environ.get(STACK_DIR_VARIABLE)
    if folder:
        return Path(folder)
    job = "-".join(environ.get(name, "") for name in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "MASTER_PORT"))
    return Path(tempfile.gettempdir()) / f"ddpkit-stacks-{os.getuid()}" / job.strip("-")


def arm(store: Any, rank: int, environ: Mapping[str, str]) -> None:
    """Dump this process's stacks into the stack folder on DUMP_SIGNAL; publish where, in ``store``."""
    folder = stack_folder(environ)
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    path = folder / f"rank-{rank}.txt"
    file: IO[str] = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w")  # private, as checkpoints
    faulthandler.register(DUMP_SIGNAL, file=file, all_threads=True, chain=False)
    _armed.update(file=file, path=path, store=store, rank=rank)
    main = threading.main_thread().ident  # faulthandler names threads by this id: the main one is the step's
    store.set(_KEY.format(rank=rank), f"{socket.gethostname()} {os.getpid()} {main} {path}")


def disarm() -> None:
    """Stop dumping on DUMP_SIGNAL; remove this rank's stack file if nothing was dumped."""
    if not _armed:
        return
    faulthandler.unregister(DUMP_SIGNAL)
    _armed["file"].close()
    path: Path = _armed["path"]
    if path.exists() and path.stat().st_size == 0:
        path.unlink()
        with contextlib.suppress(OSError):  # not empty: another rank's file, or a dump
            path.parent.rmdir()
    _armed.clear()


def is_timeout(message: str) -> bool:
    """True when ``message`` is the error of a wait for peers that timed out."""
    return any(marker in message for marker in TIMEOUT_MARKERS)


def dump_peers(world_size: int) -> str:
    """Ask every peer on this host for its stacks; one line naming where each was. "" when not armed.

    Call it from the rank whose wait timed out, before it exits.
    """
    if not _armed:
        return ""
    peers = _peers(_armed["store"], _armed["rank"], world_size)
    here = socket.gethostname()
    stopped = []
    for rank, (host, pid, _, _) in peers.items():
        if host == here and _state(pid) == "T":
            stopped.append(rank)
            # The job fails now: let the launcher's SIGTERM reach it at once (as a shell's kill does for a
            # stopped job) instead of waiting out the launcher's grace period for a process that cannot run.
            os.kill(pid, signal.SIGCONT)
        elif host == here:
            _signal(pid)
    if len(stopped) < len(peers):
        time.sleep(DUMP_WAIT_SECONDS)
    parts = [
        f"rank {rank} (pid {peers[rank][1]}) was stopped (SIGSTOP): no stack; it was continued so that it can end"
        for rank in stopped
    ]
    parts += [_where(rank, thread, path) for rank, (_, _, thread, path) in peers.items() if rank not in stopped]
    return "; ".join(part for part in parts if part)


def _peers(store: Any, rank: int, world_size: int) -> dict[int, tuple[str, int, int, Path]]:
    """Host, pid, main thread id and stack file of every peer that armed, by rank."""
    peers = {}
    for peer in range(world_size):
        key = _KEY.format(rank=peer)
        if peer == rank or not store.check([key]):
            continue
        host, pid, thread, path = store.get(key).decode().split(" ", 3)
        peers[peer] = (host, int(pid), int(thread), Path(path))
    return peers


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (R, S, T...), "" if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _signal(pid: int) -> None:
    try:
        os.kill(pid, DUMP_SIGNAL)
    except ProcessLookupError:  # gone meanwhile: its failure is reported on its own
        pass


_FRAME = re.compile(r'^\s+File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<function>\S+)')


def innermost_frame(text: str, thread: int) -> str:
    """``file:line in function`` of the innermost frame of ``thread`` in the last dump in ``text``, or ""."""
    header = f"0x{thread:016x} (most recent call first):"
    blocks = text.split(header)
    if len(blocks) < 2:
        return ""
    for line in blocks[-1].splitlines()[1:]:
        match = _FRAME.match(line)
        if match:
            return f"{match['file']}:{match['line']} in {match['function']}"
        if line and not line.startswith(" "):  # the next thread's header: this one had no Python frame
            break
    return ""


def _where(rank: int, thread: int, path: Path) -> str:
    try:
        frame = innermost_frame(path.read_text(), thread)
    except OSError:
        return ""
    return f"rank {rank} was at {frame} (stack: {path})" if frame else ""
