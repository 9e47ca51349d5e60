"""One report for a failed job: the root-cause rank, its exit code and its traceback.

Workers do not print their tracebacks (N ranks would interleave N walls of
text). :func:`run_reporting_failure` records the exception in the error file
torch's elastic agent gives each worker and exits non-zero; the launcher then
reads the failures, takes the first by time as the root cause (the others
usually fail *because* it did, for instance in a collective), and prints one
report. Workers of ddpkit's own launcher also record into a folder the
launcher names (``DDPKIT_FAILURE_DIR``): the agent's spawn-based workers
report only the first failed process it happens to find, which may be a
peer that failed because of the root cause. Errors ddpkit raises for bad input
(:class:`ddpkit.errors.UserError`) are reported as their one-line message;
any other exception, a ValueError from torch or the user's model included,
with its traceback.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpkit import stacks
from ddpkit.errors import UserError, exit_status

FAILURE_DIR_VARIABLE = "DDPKIT_FAILURE_DIR"
"""Environment variable naming the folder where ddpkit's launcher collects its workers' errors."""

PEER_LOST_MARKERS = ("Connection closed by peer", "Connection reset by peer", "exited during the collective")
"""Error texts (gloo's, ddpkit.comm.shm's) of a worker that failed only because a peer vanished."""

PEER_LOST_GRACE_SECONDS = 1.0
"""How long such a worker waits before exiting, so that the launcher sees the vanished peer's death first."""


@dataclass(frozen=True)
class WorkerFailure:
    """The root cause of a failed job."""

    rank: int
    """Global rank of the first worker that failed."""
    exitcode: int
    """Its exit code (negative: killed by that signal)."""
    message: str
    """The one-line error message."""
    traceback: str
    """The traceback, empty for errors in the user's input or signals."""
    output: str = ""
    """Where the rank's whole stdout and stderr are (its log files), empty where they are not in files."""
    user_error: bool = False
    """The rank raised a :class:`ddpkit.errors.UserError`: ``message`` is the whole report."""

    def report(self) -> str:
        """The text shown to the user: one line, plus the traceback when it helps, and where its output is."""
        line = f"error: worker rank {self.rank} failed (exit code {self.exitcode}): {self.message}"
        line += "\n" + self.traceback.rstrip() if self.traceback else ""
        return line + (f"\nddpkit: rank {self.rank}'s whole output: {self.output}" if self.output else "")


class LaunchError(RuntimeError):
    """The job failed; ``failure`` names the root-cause rank."""

    def __init__(self, failure: WorkerFailure):
        super().__init__(failure.report())
        self.failure = failure


def run_reporting_failure(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)``; on an exception, record it for the launcher and exit 1 (or the error's ``exit_status``).

    Without an error file to write (not under an elastic agent), the error is
    printed once to stderr instead.
    """
    try:
        return fn(*args)
    except Exception as e:  # the launcher reports it; SystemExit and KeyboardInterrupt pass
        _record(e)
        sys.exit(exit_status(e, 1))  # e.g. a StorageError's: the disk, not the code, failed


def record_for_launcher(error: Exception) -> bool:
    """Write ``error`` into the error file of an elastic agent (torchrun), if this process has one.

    Returns:
        True if an error file was written (the launcher will report it).
    """
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return False
    _record(error)
    return True


def _record(error: Exception) -> None:
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path and os.path.exists(path):
        return  # recorded where it happened (ddpkit train's loop); a second record would carry a later time
    user_error = isinstance(error, UserError)
    message = str(error) if user_error else "".join(traceback.format_exception_only(error)).strip()
    stack = "" if user_error else "".join(traceback.format_exception(type(error), error, _user_frames(error)))
    rank = os.environ.get("RANK", "0")
    if not path:
        print(f"error: rank {rank}: {message}" + (f"\n{stack.rstrip()}" if stack else ""), file=sys.stderr)
        return
    now = time.time()
    if stacks.is_timeout(message) and (where := stacks.dump_peers(int(os.environ.get("WORLD_SIZE", "1")))):
        message = f"{message}; {where}"  # a wait timed out: where the others were
    data: dict[str, dict[str, Any]] = {
        "message": {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": str(int(now))}},
        "ddpkit": {"time": now, "exit_status": exit_status(error, 1), "user_error": user_error},
    }
    peer_lost = any(marker in message for marker in PEER_LOST_MARKERS)
    data["ddpkit"]["peer_lost"] = peer_lost
    with open(path, "w") as f:
        json.dump(data, f)
    folder = os.environ.get(FAILURE_DIR_VARIABLE)
    if folder and rank.isdigit():
        with open(os.path.join(folder, f"rank-{rank}.json"), "w") as f:
            json.dump({"rank": int(rank), **data}, f)
    if peer_lost:  # a consequence, not the cause: let the launcher find the cause first
        time.sleep(PEER_LOST_GRACE_SECONDS)


_LAUNCHER_FILES = (
    os.path.dirname(os.path.abspath(__file__)) + os.sep,  # ddpkit.launch: the worker's own start
    "<frozen runpy>",
    os.path.join(os.path.dirname(os.path.abspath(traceback.__file__)), "runpy.py"),
)
"""Where the frames a worker's traceback starts with come from before the user's code: not worth showing."""


def _user_frames(error: BaseException) -> Any:
    """``error``'s traceback from its first frame outside the launcher (run_script, runpy, the worker's wrapper).

    The whole traceback where every frame is the launcher's: the error is ddpkit's own, and all of it matters.
    """
    first = tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_LAUNCHER_FILES):
        tb = tb.tb_next
    return tb if tb is not None else first


def append_to_output(failure: WorkerFailure, stderr: str | os.PathLike[str]) -> None:
    """Add ``failure``'s message and traceback to the end of its rank's stderr file ``stderr``.

    A worker leaves its traceback to the launcher (one report, not one per rank on the console), so its own
    files would not hold it; the launcher adds it once their lines are shown, so that the file it names as
    the rank's whole output is whole.
    """
    text = failure.traceback.rstrip() if failure.traceback else f"error: {failure.message}"
    try:
        with open(stderr, "a", encoding="utf-8", errors="backslashreplace") as f:
            f.write(f"{text}\n")
    except OSError:  # the folder is gone (removed by hand): the console report has it all
        pass


def recorded_failures(folder: str) -> list[WorkerFailure]:
    """Every failure the workers recorded into ``folder`` (:data:`FAILURE_DIR_VARIABLE`), by rank."""
    return [_describe(rank, failure) for rank, failure in sorted(_recorded_failures(folder).items())]


def root_cause(failures: dict[int, Any], failure_dir: str | None = None) -> WorkerFailure:
    """The first failure by time among torch elastic's ``ProcessFailure`` records and the errors in ``failure_dir``.

    A rank found only in ``failure_dir`` recorded its error and exited with
    status 1 (see :func:`run_reporting_failure`), but the agent stopped
    looking after another rank's failure. Ranks that failed because a peer
    vanished (connection closed, peer exited) count only when no other
    failure is known.
    """
    candidates = {**_recorded_failures(failure_dir), **failures} if failure_dir else dict(failures)
    # A rank that failed because a peer vanished comes after any other, whatever its time.
    rank, failure = min(candidates.items(), key=lambda item: (_peer_lost(item[1]), _failed_at(item[1])))
    return _describe(rank, failure)


@dataclass(frozen=True)
class _RecordedFailure:
    """A worker's error read from the launcher's failure folder (the fields of a ProcessFailure used here)."""

    error_file_data: dict[str, Any]
    exitcode: int = 1
    timestamp: float = 0.0

    @property
    def message(self) -> Any:
        return self.error_file_data["message"]


def _recorded_failures(folder: str) -> dict[int, _RecordedFailure]:
    found = {}
    for name in sorted(os.listdir(folder)):
        try:
            with open(os.path.join(folder, name)) as f:
                data = json.load(f)
            found[int(data["rank"])] = _RecordedFailure(data, exitcode=int(data["ddpkit"].get("exit_status", 1)))
        except (OSError, ValueError, KeyError):  # half-written by a worker that was killed: skip it
            continue
    return found


def _peer_lost(failure: Any) -> bool:
    return bool((failure.error_file_data or {}).get("ddpkit", {}).get("peer_lost", False))


def _failed_at(failure: Any) -> float:
    data = failure.error_file_data or {}
    return float(data.get("ddpkit", {}).get("time", failure.timestamp))


def _describe(rank: int, failure: Any) -> WorkerFailure:
    message = failure.message
    stack = ""
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        message = message.get("message", "")
    if not failure.error_file_data or not message or "To enable traceback" in str(message):
        signal = failure.signal_name()
        message = (
            f"killed by {signal}" if failure.exitcode < 0 else "exited without an error message (see its output above)"
        )
    user_error = bool((failure.error_file_data or {}).get("ddpkit", {}).get("user_error", False))
    return WorkerFailure(rank, failure.exitcode, str(message), stack, user_error=user_error)
