"""The launcher's copy of the shown ranks' output files on its console, line by line, as they grow.

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

import dataclasses
import threading
from pathlib import Path
from typing import IO, TextIO

from ddpkit.log import rank_prefix

INTERVAL_S = 0.05
"""Seconds between two reads of the followed files."""
CLEAR_TO_END_OF_LINE = "\x1b[K"
"""What a terminal takes as "erase the rest of this line" (after an unfinished line is redrawn shorter)."""


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


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a stream without a descriptor, or closed
        return False
