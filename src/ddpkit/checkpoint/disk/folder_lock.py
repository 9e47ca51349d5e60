"""A run owns its folder: one lock, taken before anything is written there, held for the run's life.

Two runs into one folder would interleave their metrics and prune each
other's checkpoints. :class:`FolderLock` makes the second one stop before it
writes, with one line naming the run that holds the folder::

    with FolderLock("runs/a"):          # or lock = FolderLock(...).acquire(); ...; lock.release()
        ...                             # write metrics, checkpoints, summary

    runs/a is in use by another run (host node7, pid 4121, since 2026-11-28 02:40:11 UTC: ddpkit train ...);
    wait for it to end or write to another folder (output_dir=... or checkpoint.dir=...); if that run is gone
    (its node died), delete runs/a/.ddpkit.lock

The lock is ``filelock.FileLock`` on ``<folder>/.ddpkit.lock``, taken without
waiting (timeout 0). On Linux that is ``flock(2)``: the kernel releases it when
the holding process ends, however it ends (SIGKILL, out of memory), so a dead
run never blocks a later one; on NFS the kernel maps it to a POSIX lock that
the server holds for the client's lease only, so a node that dies releases it
when its lease expires (NFSv4: about 90 s). Where a file system has no locks
at all (Lustre without ``-o flock``), filelock falls back to a marker file
that records host, pid and process start time and is broken when that
process is gone from this host.

Who holds the lock (host, pid, start time, command) is written to a file
beside it, ``.ddpkit.lock.json``, never into the lock file: filelock's marker
fallback owns the lock file's contents, and on NFS, closing *any* descriptor
of a POSIX-locked file drops the process's lock, so the holder never opens
the lock file a second time.

The lock file is never a symbolic link: one planted there is refused in one
line, never followed (locking it would create and lock its target), and a
lock file this user cannot open (another user's) is named as the problem,
with its owner and mode (:class:`LockFileError`).

Re-entrant within a process: ``ddpkit train`` locks its run folder and its
Checkpointer locks the checkpoints folder inside it, with lock files of their
own; where both name the same folder (``checkpoint.dir`` set to
``output_dir``), the second :class:`FolderLock` of one process on one folder
counts a hold on the first instead of failing on itself, and the lock goes
only when every holder has released it.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import socket
import stat
import sys
import threading
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from filelock import FileLock, Timeout

from ddpkit.checkpoint.disk.format import folder_mode
from ddpkit.errors import UserError
from ddpkit.names import EXIT_USER_ERROR

LOCK_FILE = ".ddpkit.lock"
"""The lock file inside a locked folder."""
HOLDER_FILE = ".ddpkit.lock.json"
"""Who holds the lock: host, pid, start time, command (JSON)."""


class FolderInUseError(UserError):
    """Another live run holds the folder; the message names it (host, pid, since when) and the fix."""

    exit_status = EXIT_USER_ERROR
    """The exit status of a worker refused its folder, and of the command (a launcher passes it on)."""


class LockFileError(FolderInUseError):
    """The folder's lock file cannot be used (a symbolic link, or a file this user cannot open); the message
    says which and the fix. A kind of FolderInUseError: the run stops before writing, as when a run holds it."""


_HELD: dict[str, tuple[FileLock, int]] = {}
"""This process's held locks: canonical lock path -> (the lock, number of holders)."""
_HELD_GUARD = threading.Lock()


class FolderLock:
    """The lock of one folder (created if missing); see the module docstring.

    Args:
        folder: the folder a run writes into.
        fix: how the refusal says to write elsewhere, e.g. "output_dir=..." (default: either option).
        mode: permission bits of the lock and holder files (private to the user by default, as checkpoints).
    """

    def __init__(
        self, folder: str | os.PathLike[str], fix: str = "output_dir=... or checkpoint.dir=...", mode: int = 0o600
    ):
        self.folder = Path(folder)
        self.fix = fix
        self.mode = mode
        self._key = ""

    @property
    def lock_file(self) -> Path:
        """The lock file."""
        return self.folder / LOCK_FILE

    @property
    def held(self) -> bool:
        """True between a successful :meth:`acquire` and its :meth:`release`."""
        return bool(self._key)

    def acquire(self, timeout: float = 0) -> FolderLock:
        """Take the lock now, or fail at once (or after waiting ``timeout`` seconds for it).

        Args:
            timeout: seconds to wait for a holder to go; 0 for a new run. A restarted worker waits a
                little: processes its dead predecessor forked (DataLoader workers) hold the lock until
                they notice and exit.

        Returns:
            ``self``, holding the lock.

        Raises:
            FolderInUseError: another live process holds it (the message names that run and the fix).
            LockFileError: the lock file is a symbolic link, or exists and this user cannot open it.
            OSError: the folder cannot be created or written (e.g. read-only).
        """
        if self._key:
            return self
        self.folder.mkdir(parents=True, exist_ok=True)
        self._check_lock_file()
        # The folder is resolved, never the lock file: a link planted there must not choose what is locked.
        key = os.path.join(os.path.realpath(self.folder), LOCK_FILE)
        with _HELD_GUARD:
            if key in _HELD:  # this process holds it already (see the module docstring)
                lock, count = _HELD[key]
                _HELD[key] = (lock, count + 1)
                self._key = key
                return self
            lock = FileLock(key, timeout=timeout, mode=self.mode, thread_local=False)
            try:
                lock.acquire()
            except Timeout:
                raise FolderInUseError(self._refusal()) from None
            except OSError as e:
                unusable = self._unusable(e)
                if unusable is None:
                    raise
                raise unusable from None
            _HELD[key] = (lock, 1)
            self._key = key
        try:
            _write_holder(self.folder / HOLDER_FILE, self.mode)
        except OSError:
            pass  # the lock holds without it; a refused run then names no holder
        return self

    def release(self) -> None:
        """Give the lock back (the last holder in this process releases the file lock); idempotent."""
        if not self._key:
            return
        with _HELD_GUARD:
            lock, count = _HELD[self._key]
            if count > 1:
                _HELD[self._key] = (lock, count - 1)
            else:
                del _HELD[self._key]
                try:
                    (self.folder / HOLDER_FILE).unlink(missing_ok=True)
                except OSError:
                    pass
                lock.release()
            self._key = ""

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def _check_lock_file(self) -> None:
        """Refuse a symbolic link at the lock file's path: locking it would create and lock its target."""
        if os.path.islink(self.lock_file):
            raise LockFileError(
                f"{self.lock_file} is a symbolic link (to {os.readlink(self.lock_file)}), not a lock file; ddpkit "
                f"never follows a link there: delete it (rm {self.lock_file}) and run again"
            )

    def _unusable(self, error: OSError) -> LockFileError | None:
        """The one-line error for a lock file that exists but cannot be opened (another user's, say); None
        when the lock file is not the problem (the folder cannot be written: the caller says so)."""
        try:
            facts = self.lock_file.lstat()
        except OSError:
            return None
        if error.errno not in (errno.EACCES, errno.EPERM, errno.ELOOP):
            return None
        return LockFileError(
            f"the lock file {self.lock_file} cannot be opened by this user ({error.strerror}: it belongs to uid "
            f"{facts.st_uid}, mode {stat.S_IMODE(facts.st_mode):04o}); if no run is using {self.folder}, delete "
            "the lock file (or make it readable and writable by this user) and run again"
        )

    def _refusal(self) -> str:
        holder = read_holder(self.folder)
        return (
            f"{self.folder} is in use by another run ({describe_holder(holder)}); wait for it to end or write to "
            f"another folder ({self.fix}); if that run is gone (its node died), delete {self.lock_file}"
        )


def read_holder(folder: str | os.PathLike[str]) -> dict[str, Any] | None:
    """What the holder of ``folder``'s lock recorded (host, pid, since, command), or None if unknown."""
    try:
        holder = json.loads((Path(folder) / HOLDER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) else None


def describe_holder(holder: dict[str, Any] | None) -> str:
    """The holder as the refusal names it: "host h, pid 12, since 2026-11-28 02:40:11 UTC: ddpkit train ..."."""
    if holder is None:
        return "a process that has not said who it is yet"
    since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder.get("since", 0))))
    text = f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, since {since}"
    command = str(holder.get("command", ""))
    return f"{text}: {command}" if command else text


def holder_record() -> dict[str, Any]:
    """Who this process is, as a lock's holder file records it: host, pid, start of the hold, command."""
    return {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "command": _command_line()}


def _write_holder(path: Path, mode: int) -> None:
    record = holder_record()
    temporary = path.with_name(f"{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as file:
        os.fchmod(file.fileno(), mode)  # whatever the umask
        file.write(json.dumps(record) + "\n")
    os.replace(temporary, path)


def _command_line(limit: int = 160) -> str:
    """This process's command, shortened: ``ddpkit train ...`` for the command, the script for a user's own."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(("__main__.py", "/ddpkit")):
        argv[0] = "ddpkit"
    text = shlex.join(argv)
    return text if len(text) <= limit else text[: limit - 3] + "..."


__all__ = [
    "FolderInUseError",
    "FolderLock",
    "HOLDER_FILE",
    "LOCK_FILE",
    "LockFileError",
    "describe_holder",
    "holder_record",
    "read_holder",
]


RESTART_LOCK_WAIT_S = 60.0
"""How long a restarted worker waits for its folder's lock: processes its dead predecessor forked may hold it."""


def lock_checkpoint_folder(root: Path, mode: int, restarted: bool) -> FolderLock | None:
    """Rank 0's lock of a Checkpointer's folder (a restarted worker waits for its predecessor's to go).

    The folder is created as a checkpoint write would create it (``mode``: private to the user unless
    ``readable_by`` says otherwise). None when this process cannot write it: the first save says so, in one line.

    Raises:
        FolderInUseError: another live run holds the folder.
    """
    try:
        root.mkdir(parents=True, exist_ok=True, mode=folder_mode(mode))
        lock = FolderLock(root, fix="dir=... (checkpoint.dir=...)", mode=mode)
        return lock.acquire(RESTART_LOCK_WAIT_S if restarted else 0.0)
    except OSError:
        return None
