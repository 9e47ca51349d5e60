"""What the workers print: a file per rank, chosen ranks on the console (``ddpkit run``, ``train``, ``launch``).

Each worker's stdout and stderr (file descriptors 1 and 2, so Python's
prints, C++'s output and subprocesses' alike) go to files in the launch's
log folder. One path serves every launch: the launcher claims the folder
and follows the files (:func:`rank_output`), torch's elastic agent learns
each round's paths and error files from :class:`RankLogs` (torch's
``LogsSpecs`` interface), and each worker sends its own descriptors and
Python's streams there first thing (:func:`write_to_files`), not torch:
a worker forked from a notebook kernel holds the kernel's streams as
``sys.stdout``, sockets served by threads the fork did not copy, which
torch's redirection would write around::

    <log_dir>/rank-0.stdout.log   rank-0.stderr.log   rank-1.stdout.log ...
    <log_dir>/restart-1/rank-0.stdout.log ...          (after the first restart, max_restarts)

The launcher follows the files of the ranks it shows (``show_ranks``: rank 0
by default) and copies each line to its own stdout or stderr
(:class:`~ddpkit.launchers.console.ConsoleTee`), prefixed ``[rank r/w]`` where it shows several ranks:
with one, its lines look as they would under ``python script.py`` (the
launcher's first line says whose they are). ddpkit's logger leaves its own
``[rank r/w]`` out of the lines the launcher prefixes
(:data:`ddpkit.log.PREFIXED_VARIABLE`), so a line has one prefix.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import itertools
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ddpkit.errors import UserError
from ddpkit.launchers.console import ConsoleTee
from ddpkit.launchers.options import describe_ranks
from ddpkit.log import PREFIXED_VARIABLE, TERMINAL_VARIABLE

TAIL_LINES = 20
"""Lines of a hidden rank's stderr that a failure report shows, where the rank left no traceback."""
KEEP_LAUNCHES = 20
"""Launches whose output folders :func:`default_log_root` keeps (the newest; a running launch's too)."""
_LAUNCH_FOLDER = re.compile(r".+-\d{8}-\d{6}-(?P<pid>\d+)(-\d+)?")


def log_files(log_dir: str | os.PathLike[str], rank: int, restart: int = 0) -> tuple[Path, Path]:
    """The stdout and stderr files of ``rank`` in round ``restart`` (0: the first start)."""
    folder = Path(log_dir) if restart == 0 else Path(log_dir) / f"restart-{restart}"
    return folder / f"rank-{rank}.stdout.log", folder / f"rank-{rank}.stderr.log"


def default_log_root() -> Path:
    """The folder of the launches' output folders where no log_dir is given: ``<tmp>/ddpkit-logs-<uid>``."""
    return Path(tempfile.gettempdir()) / f"ddpkit-logs-{os.getuid()}"


def default_log_dir(name: str) -> Path:
    """A new folder for the output files of a launch of ``name`` (a script's), under :func:`default_log_root`."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    return default_log_root() / f"{name}-{stamp}-{os.getpid()}"


def claim_log_dir(log_dir: str | os.PathLike[str]) -> Path:
    """Create this launch's output folder and return it: ``log_dir``, or the first of ``log_dir-2``, ``-3``... free.

    Created exclusively, so that two launches never share a folder: two runs into one ``output_dir`` that
    start in the same second ask for the same ``logs/<second>``, and a launch truncates the rank files it
    starts. A folder that exists already is another launch's (or the user's) and is left as it is.

    Raises:
        UserError: the folder cannot be created (permissions, a file in the way); the message names the fix.
    """
    base = Path(log_dir)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for number in itertools.count(1):
            folder = base if number == 1 else base.with_name(f"{base.name}-{number}")
            try:
                folder.mkdir()
            except FileExistsError:
                continue
            return folder
    except OSError as e:
        raise UserError(
            f"cannot create the log folder {base} ({e.strerror or e}); choose a folder this user can write "
            "(log_dir=...)"
        ) from None
    raise AssertionError("unreachable")


def new_log_dir(log_dir: str | os.PathLike[str]) -> Path:
    """:func:`claim_log_dir`; under :func:`default_log_root`, the oldest launches' folders are then pruned."""
    folder = claim_log_dir(log_dir)
    if folder.parent == default_log_root():
        prune_log_root(folder.parent, protect=folder)
    return folder


def prune_log_root(root: Path, keep: int = KEEP_LAUNCHES, protect: Path | None = None) -> list[Path]:
    """Remove the output folders of all but the newest ``keep`` launches from ``root``, sparing live ones.

    Only folders a launch named there (:func:`default_log_dir`: ``NAME-YYYYmmdd-HHMMSS-PID``, or one of
    :func:`claim_log_dir`'s ``-N`` variants) are candidates. The newest folder of a launcher (its PID) that
    still runs is kept, since its launch may still write there, as is ``protect`` (this launch's); a process
    that launches again and again (a notebook kernel) keeps only its newest. Returns the folders removed.
    """
    try:
        entries = [path for path in root.iterdir() if path.is_dir() and _LAUNCH_FOLDER.fullmatch(path.name)]
    except OSError:
        return []
    entries.sort(key=_modified, reverse=True)
    newest_of: dict[int, Path] = {}
    for path in entries:
        newest_of.setdefault(_launcher_pid(path), path)
    removed = []
    for path in entries[keep:]:
        pid = _launcher_pid(path)
        if path == protect or (newest_of[pid] == path and _running(pid)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _launcher_pid(path: Path) -> int:
    match = _LAUNCH_FOLDER.fullmatch(path.name)
    assert match is not None, path
    return int(match.group("pid"))


def _modified(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _running(pid: int) -> bool:
    """Whether a process ``pid`` exists (a reused pid keeps a folder: the safe side)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: it exists
        return True
    return True


@dataclasses.dataclass(frozen=True)
class RankOutput:
    """The output of one launch: its folder of rank files, and the tee that shows the chosen ranks' lines."""

    folder: Path
    tee: ConsoleTee


@contextlib.contextmanager
def rank_output(log_dir: str, shown: frozenset[int] | None, stdout: TextIO, stderr: TextIO) -> Iterator[RankOutput]:
    """For one launch: its own folder (:func:`new_log_dir`), one line saying where, and the shown ranks on the console.

    ``stdout`` and ``stderr`` are the console (the caller's streams at the launch: in a notebook, the cell).
    When the block ends, the console has shown everything the followed files hold, and one line names the
    ranks not shown that wrote to stderr.
    """
    folder = new_log_dir(log_dir)  # this launch's own: another's is never touched
    tee = ConsoleTee(shown, stdout, stderr)
    print(f"ddpkit: {where(folder, shown)}", file=stderr, flush=True)
    tee.start()
    try:
        yield RankOutput(folder, tee)
    finally:
        tee.stop()
        if note := hidden_stderr_note(tee):
            print(note, file=stderr, flush=True)


@contextlib.contextmanager
def write_to_files(stdout: Path, stderr: Path) -> Iterator[None]:
    """In a worker: send its stdout and stderr (file descriptors 1 and 2, and Python's streams) to these files.

    Appended, though each round of workers has files of its own (:func:`log_files`). Logging handlers that
    wrote to the old streams (inherited through a fork) are pointed at the new ones. When the block ends, the
    streams are flushed.
    """
    previous = (sys.stdout, sys.stderr)
    streams = []
    for fd, path in ((1, stdout), (2, stderr)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        os.dup2(target, fd)
        os.close(target)
        streams.append(open(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace", closefd=False))
    sys.stdout, sys.stderr = streams
    _rebind_logging(dict(zip(previous, streams)))
    if faulthandler.is_enabled():  # (a kernel enables it on a stream of its own) a crash's stacks go to stderr
        faulthandler.enable(sys.stderr)
    try:
        yield
    finally:
        for stream in streams:
            with contextlib.suppress(OSError, ValueError):
                stream.flush()


def _rebind_logging(replacements: dict[Any, TextIO]) -> None:
    """Point the logging handlers that wrote to the replaced streams (inherited through a fork) at the new ones."""
    loggers = [
        logging.getLogger(),
        *(v for v in logging.Logger.manager.loggerDict.values() if isinstance(v, logging.Logger)),
    ]
    for logger in loggers:
        for handler in logger.handlers:
            if type(handler) is not logging.FileHandler and isinstance(handler, logging.StreamHandler):
                new = replacements.get(handler.stream)
                if new is not None:
                    handler.setStream(new)


def where(log_dir: str | os.PathLike[str], shown: frozenset[int] | None) -> str:
    """One sentence: what the console shows, and where every rank's output is."""
    others = " (show_ranks=all: every rank's)" if shown is not None else ""
    return f"the console shows {describe_ranks(shown)}'s output{others}, each rank's whole output is in {log_dir}"


class RankLogs(LogsSpecs):
    """torch's LogsSpecs for ddpkit's launcher: each rank's files of :func:`log_files`, followed by the tee.

    Each round of workers (the first, and each restart) gets its files when the agent starts it (``reify``),
    and the tee follows them; the workers write them themselves (:func:`write_to_files`), so torch is given
    no stdout or stderr path to redirect to. torch's error files (``TORCHELASTIC_ERROR_FILE``, read by the
    launcher's failure report) go into ``error_dir``.
    """

    def __init__(self, log_dir: str, error_dir: str, tee: ConsoleTee) -> None:
        super().__init__(log_dir)
        self.log_dir = log_dir
        self.error_dir = error_dir
        self.tee = tee
        self.rounds = 0
        """The rounds of workers started so far (the first, and each restart)."""

    @property
    def root_log_dir(self) -> str:
        return self.log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of this round's workers (``envs``: their variables by local rank, extended here)."""
        dest = LogsDest()
        # Counted here, not by TORCHELASTIC_RESTART_COUNT: an elastic job's agent starts a new round without
        # counting a restart when a node joins, and two rounds must not share (and show twice) one set of files.
        restart, self.rounds = self.rounds, self.rounds + 1
        for local_rank, env in envs.items():
            rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
            stdout, stderr = log_files(self.log_dir, rank, restart)
            stdout.parent.mkdir(parents=True, exist_ok=True)  # (in this launch's own folder: claim_log_dir)
            dest.stdouts[local_rank], dest.stderrs[local_rank] = "", ""  # (no redirection by torch)
            error_file = os.path.join(self.error_dir, f"restart-{restart}-rank-{rank}.json")
            dest.error_files[local_rank] = env["TORCHELASTIC_ERROR_FILE"] = error_file
            if self.tee.prefixes(rank, world_size):
                env[PREFIXED_VARIABLE] = "1"
            if self.tee.stderr_is_terminal and self.tee.is_shown(rank):
                env[TERMINAL_VARIABLE] = "1"
            self.tee.follow(rank, world_size, stdout, stderr)
        return dest


def last_lines(path: Path, count: int = TAIL_LINES) -> str:
    """The last ``count`` lines of a text file ("" if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 64 * 1024))  # the tail is enough
            lines = f.read().decode(errors="replace").rstrip("\n").split("\n")
    except OSError:
        return ""
    return "\n".join(line.rstrip("\r").rpartition("\r")[2] for line in lines[-count:])  # as a terminal shows them


def hidden_stderr_note(tee: ConsoleTee) -> str:
    """One line naming the ranks not shown that wrote to stderr, and their files ("" if none did)."""
    hidden = tee.hidden_stderr()
    if not hidden:
        return ""
    ranks = sorted({rank for rank, _ in hidden})
    files = ", ".join(str(path) for _, path in hidden)
    who = "rank" if len(ranks) == 1 else "ranks"
    return (
        f"ddpkit: {who} {', '.join(map(str, ranks))} also wrote to stderr, not shown here "
        f"(the console shows {describe_ranks(tee.shown)}; show_ranks=all shows every rank): {files}"
    )
