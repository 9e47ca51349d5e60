"""A worker's process title: what ``ps``, ``top``, ``pgrep -f`` and ``py-spy`` see of it.

A worker of ``ddpkit run`` is a fork of the worker server, so its command
line is the server's (``python -c 'from multiprocessing.forkserver import
main; ...'``): ``pgrep -f train.py`` finds only the launcher. Each worker
rewrites it as ``ddpkit rank 1/2: train.py --lr 0.1``, and its name (the
15 characters ``top`` and ``pgrep`` without ``-f`` show) as ``r1:train.py``.

How: Linux gives the addresses of a process's argument strings in
``/proc/self/stat`` (fields 48 and 49, ``arg_start`` and ``arg_end``), and
``/proc/self/cmdline`` reads that memory; the title is written over it,
within its length (the server's command line is several hundred bytes long),
and the name is set with ``prctl(PR_SET_NAME)``. CPython keeps its own copy
of the arguments from start-up, so nothing reads the old strings again; the
PyPI package setproctitle writes the same memory (after moving the
environment to make room). Elsewhere than Linux nothing changes.
"""

from __future__ import annotations

import ctypes

PR_SET_NAME = 15
"""prctl option that names the calling thread (the main thread's name is the process's)."""
NAME_BYTES = 15
"""The longest name the kernel keeps (16 with its NUL)."""


def set_process_title(title: str, name: str) -> bool:
    """Make ``title`` this process's command line (truncated to the space there is) and ``name`` its name.

    Returns:
        True if the command line was rewritten.
    """
    _set_name(name)
    try:
        with open("/proc/self/stat", "rb") as f:
            # The fields after the name, which may hold spaces and parentheses: state (field 3) first.
            fields = f.read().rpartition(b")")[2].split()
        start, end = int(fields[48 - 3]), int(fields[49 - 3])
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if size < 2:
        return False
    data = title.encode(errors="replace")[: size - 1]
    # The rest zeroed, its last byte included: the kernel then reads the area as it is (the title, then NULs).
    ctypes.memmove(start, data + b"\0" * (size - len(data)), size)
    return True


def _set_name(name: str) -> None:
    try:
        prctl = ctypes.CDLL(None).prctl  # the C library the interpreter is linked with (no search)
    except (OSError, AttributeError):  # no prctl here (not Linux)
        return
    prctl(PR_SET_NAME, ctypes.c_char_p(name.encode(errors="replace")[:NAME_BYTES]), 0, 0, 0)
