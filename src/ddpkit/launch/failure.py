"""One report for a failed job: the root-cause rank, its exit code and its traceback.

Workers do not print their tracebacks (N ranks would interleave N walls of
text). :func:`run_reporting_failure` records the exception in the error file
torch's elastic agent gives each worker and exits non-zero; the launcher then
reads the failures, takes the first by time as the root cause (the others
usually fail *because* it did, for instance in a collective), and prints one
report. Errors ddpkit raises for bad input (``ValueError`` and
``FileNotFoundError`` families) are reported as their one-line message; any
other exception with its traceback.
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

USER_ERRORS = (ValueError, FileNotFoundError)


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

    def report(self) -> str:
        """The text shown to the user: one line, plus the traceback when it helps."""
        line = f"error: worker rank {self.rank} failed (exit code {self.exitcode}): {self.message}"
        return line + ("\n" + self.traceback.rstrip() if self.traceback else "")


class LaunchError(RuntimeError):
    """The job failed; ``failure`` names the root-cause rank."""

    def __init__(self, failure: WorkerFailure):
        super().__init__(failure.report())
        self.failure = failure


def run_reporting_failure(fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)``; on an exception, record it for the launcher and exit 1.

    Without an error file to write (not under an elastic agent), the error is
    printed once to stderr instead.
    """
    try:
        return fn(*args)
    except Exception as e:  # the launcher reports it; SystemExit and KeyboardInterrupt pass
        _record(e)
        sys.exit(1)


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
    user_error = isinstance(error, USER_ERRORS)
    message = f"{type(error).__name__}: {error}" if not user_error else str(error)
    stack = "" if user_error else traceback.format_exc()
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        rank = os.environ.get("RANK", "0")
        print(f"error: rank {rank}: {message}" + (f"\n{stack.rstrip()}" if stack else ""), file=sys.stderr)
        return
    now = time.time()
    data = {
        "message": {"message": message, "extraInfo": {"py_callstack": stack, "timestamp": str(int(now))}},
        "ddpkit": {"time": now},
    }
    with open(path, "w") as f:
        json.dump(data, f)


def root_cause(failures: dict[int, Any]) -> WorkerFailure:
    """The first failure by time among torch elastic's ``ProcessFailure`` records."""

    def failed_at(item: tuple[int, Any]) -> float:
        data = item[1].error_file_data or {}
        return data.get("ddpkit", {}).get("time", float(item[1].timestamp))

    rank, failure = min(failures.items(), key=failed_at)
    message = failure.message
    stack = ""
    if isinstance(message, dict):
        stack = message.get("extraInfo", {}).get("py_callstack", "")
        message = message.get("message", "")
    if not failure.error_file_data or not message or "To enable traceback" in str(message):
        signal = failure.signal_name()
        message = f"killed by {signal}" if failure.exitcode < 0 else "exited without an error message (see its output above)"
    return WorkerFailure(rank, failure.exitcode, str(message), stack)
