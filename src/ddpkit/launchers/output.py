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
(:class:`ConsoleTee`), prefixed ``[rank r/w]`` where it shows several ranks:
with one, its lines look as they would under ``python script.py`` (the
launcher's first line says whose they are). ddpkit's logger leaves its own
``[rank r/w]`` out of the lines the launcher prefixes
(:data:`ddpkit.log.PREFIXED_VARIABLE`), so a line has one prefix.

Why not torch's ``TailLog``, which torchrun's ``--tee`` and
``--local-ranks-filter`` use: it reads the files as text, so each carriage
return of a progress bar becomes a line of its own, and it prints a line that
is still being written in pieces, each with a prefix. ConsoleTee splits on
newlines only, shows a line redrawn with carriage returns as a terminal would
(its last part), and on a terminal redraws an unfinished line (tqdm's bar) in
place. It reads every 50 ms (TailLog every 100 ms). Files rather than pipes:
a worker's output reaches its file even when the launcher is busy or gone,
and a worker never waits on the launcher to write.
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, TextIO

from torch.distributed.elastic.multiprocessing.api import LogsDest, LogsSpecs

from ddpkit.config import describe_ranks
from ddpkit.errors import UserError
from ddpkit.log import PREFIXED_VARIABLE, TERMINAL_VARIABLE, rank_prefix

INTERVAL_S = 0.05
"""Seconds between two reads of the followed files."""
CLEAR_TO_END_OF_LINE = "\x1b[K"
"""What a terminal takes as "erase the rest of this line" (after an unfinished line is redrawn shorter)."""
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


@dataclasses.dataclass(eq=False)
class _Source:
    """One followed file: where its lines go, with which prefix, and what of it is read but not yet shown."""

    rank: int
    path: Path
    console: TextIO
    prefix: str
    terminal: bool
    """The console is a terminal: an unfinished line is shown, and redrawn in place."""
    file: IO[bytes] | None = None
    pending: bytes = b""
    """Read, but not yet ended by a newline."""
    drawn: bytes = b""
    """The unfinished line as the terminal shows it already (not to be shown again at the end)."""


class ConsoleTee:
    """Copies the shown ranks' output files to the launcher's stdout and stderr as they grow, line by line.

    Args:
        shown: the global ranks to show; None: all.
        stdout, stderr: the launcher's streams (taken when the launch starts, so a caller's redirection holds).
    """

    def __init__(self, shown: frozenset[int] | None, stdout: TextIO, stderr: TextIO) -> None:
        self.shown = shown
        self._consoles = (stdout, stderr)
        self.stderr_is_terminal = _is_terminal(stderr)
        """Where a worker's progress bar goes, so ddpkit train's rank 0 shows one (DDPKIT_TERMINAL)."""
        self._sources: list[_Source] = []
        self._hidden: list[tuple[int, Path]] = []  # (rank, stderr file) of the ranks not shown
        self._files: dict[int, tuple[Path, Path]] = {}  # the newest round's files of each rank
        self._open: _Source | None = None  # whose unfinished line the terminal shows last
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpkit-console-tee", daemon=True)

    @property
    def console_stderr(self) -> TextIO:
        """The launcher's stderr the tee writes to, for the launcher's own lines beside the ranks'."""
        return self._consoles[1]

    def is_shown(self, rank: int) -> bool:
        """Whether ``rank``'s output reaches the console."""
        return self.shown is None or rank in self.shown

    def prefixes(self, rank: int, world_size: int) -> bool:
        """Whether the console prefixes ``rank``'s lines: it is shown, beside others."""
        return self.is_shown(rank) and world_size > 1 and (self.shown is None or len(self.shown) > 1)

    def follow(self, rank: int, world_size: int, stdout: Path, stderr: Path) -> None:
        """Show ``rank``'s files from now on, if it is shown (else remember its stderr for :meth:`hidden_stderr`)."""
        with self._lock:
            self._files[rank] = (stdout, stderr)
            if not self.is_shown(rank):
                self._hidden.append((rank, stderr))
                return
            prefix = rank_prefix(rank, world_size) if self.prefixes(rank, world_size) else ""
            self._sources += [
                _Source(rank, path, console, prefix, _is_terminal(console))
                for path, console in zip((stdout, stderr), self._consoles)
            ]

    def files_of(self, rank: int) -> tuple[Path, Path] | None:
        """The stdout and stderr files of ``rank``'s newest round (after restarts, the last); None: not a rank here."""
        with self._lock:
            return self._files.get(rank)

    def start(self) -> ConsoleTee:
        """Start following (a thread of this process)."""
        self._thread.start()
        return self

    def stop(self) -> None:
        """Show what the files hold to their end, end any unfinished line, and stop following."""
        self._stop.set()
        self._thread.join()

    def hidden_stderr(self) -> list[tuple[int, Path]]:
        """(rank, file) of each rank not shown whose stderr file is not empty."""
        with self._lock:
            return [(rank, path) for rank, path in self._hidden if path.is_file() and path.stat().st_size]

    def poll(self) -> None:
        """Show what the followed files gained since the last call (the thread calls it every INTERVAL_S)."""
        with self._lock:
            sources = list(self._sources)
        # The unfinished line on the terminal first: a progress bar's end, then the print that followed it (the
        # order of two files' lines written within one interval is not known otherwise).
        sources.sort(key=lambda source: source is not self._open)
        for source in sources:
            self._pump(source)
        for console in self._consoles:
            console.flush()

    def finish(self) -> None:
        """Show what the files hold to their end, an unfinished last line as a line, and close them."""
        self.poll()
        for source in self._sources:
            if source.pending and source.pending != source.drawn:
                self._show(source, source.pending, ended=True)
                source.pending = b""
            if source.file is not None:
                source.file.close()
                source.file = None
        self._end_open_line()
        for console in self._consoles:
            console.flush()

    def _run(self) -> None:
        try:
            while not self._stop.wait(INTERVAL_S):
                self.poll()
            self.finish()  # after stop(): nothing written before it is missed
        except (OSError, ValueError):  # the console is gone (`ddpkit run ... | head`, a closed notebook stream):
            pass  # the files still hold everything

    def _pump(self, source: _Source) -> None:
        """Show the lines written to ``source`` since the last read."""
        if source.file is None:
            try:
                source.file = open(source.path, "rb")  # noqa: SIM115 (kept open while followed)
            except FileNotFoundError:  # the worker has not started yet
                return
        data = source.file.read()
        if not data:
            return
        *lines, source.pending = (source.pending + data).split(b"\n")
        for line in lines:
            self._show(source, line, ended=True)
            source.drawn = b""
        if source.pending and source.terminal:  # an unfinished line (a progress bar): show it as it is now
            self._show(source, source.pending, ended=False)
        # Of an unfinished line only its last part after a carriage return will be shown: keep no more.
        cut = source.pending.rfind(b"\r")
        if cut > 0:
            source.pending = source.pending[cut:]
        if source.pending and source.terminal:
            source.drawn = source.pending

    def _show(self, source: _Source, raw: bytes, ended: bool) -> None:
        """Write one line of ``source`` (``ended``: with its newline), as a terminal would show it."""
        # What a terminal shows of a line redrawn with carriage returns: its last part.
        text = raw.decode(errors="replace" if ended else "ignore").rstrip("\r").rpartition("\r")[2]
        # A line prefixed already (ddpkit's logger in a worker that does not know the tee prefixes) keeps one.
        prefix = "" if text.startswith(source.prefix) else source.prefix
        console = source.console
        if self._open is source:
            out = "\r" + prefix + text + CLEAR_TO_END_OF_LINE
        else:
            self._end_open_line()
            out = prefix + text
        self._open = None if ended else source
        console.write(out + ("\n" if ended else ""))

    def _end_open_line(self) -> None:
        if self._open is not None:
            self._open.console.write("\n")
            self._open.console.flush()
            self._open = None


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

    @property
    def root_log_dir(self) -> str:
        return self.log_dir

    def reify(self, envs: dict[int, dict[str, str]]) -> LogsDest:
        """The files of this round's workers (``envs``: their variables by local rank, extended here)."""
        dest = LogsDest()
        for local_rank, env in envs.items():
            rank, world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
            restart = int(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
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


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream without a descriptor, or closed
        return False


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
