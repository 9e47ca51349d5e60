"""glibc's allocator, kept from handing memory back to the system at every training step.

A CPU training step allocates and frees the same large buffers each time: a
convolution's activations, their gradients, a few megabytes each. glibc's
malloc serves a block above its mmap threshold with a fresh ``mmap`` and
unmaps it when freed, and gives the free top of its heap back to the system
(``brk``) once that exceeds its trim threshold. Both thresholds adapt to the
sizes it has seen, but how well depends on the process's history. Each time,
the next step touches new pages: one page fault per 4 KiB, in the kernel.

Measured (2-core VM, W2 = the MNIST CNN at batch 16, one thread, 500 steps,
in one process): a ddpkit worker took about 2,000 page faults per step and a
quarter of its time in the kernel, at 9 ms a step; the same steps in a bare
loop's process, 900 faults. With the two thresholds set as below: no page
fault in a step after the first few, 6 ms a step, and the same peak memory
(a step reuses what the one before freed).

:func:`keep_freed_memory` sets them once, in ``ddpkit.init()``: blocks up to
32 MiB (the largest mmap threshold glibc accepts) come from the heap, and up
to 256 MiB of freed heap stays with the process for reuse. It leaves the
allocator alone where the environment says ``DDPKIT_MALLOC=default``, where
it sets glibc's own ``MALLOC_*_`` tuning variables (the user chose), and
where the C library is not glibc (musl, macOS); an allocator preloaded in
glibc's place (jemalloc, tcmalloc) does not read glibc's settings.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

from ddpkit.errors import UserError

__all__ = [
    "GLIBC_VARIABLES",
    "MMAP_THRESHOLD",
    "SETTING_VARIABLE",
    "TRIM_THRESHOLD",
    "keep_freed_memory",
    "reason_to_leave_alone",
    "setting",
]

SETTING_VARIABLE = "DDPKIT_MALLOC"
"""The environment variable that chooses: ``keep`` (the default) or ``default`` (glibc's own behaviour)."""
_CHOICES = ("keep", "default")

MMAP_THRESHOLD = 32 * 1024 * 1024
"""Blocks below this size come from the heap rather than a fresh mmap (glibc's upper limit on 64-bit)."""
TRIM_THRESHOLD = 256 * 1024 * 1024
"""Free memory at the heap's top kept for reuse, up to this much, instead of being given back."""

GLIBC_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")
"""glibc's own tuning variables: where the environment sets one, the user chose, and the allocator is left alone."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt's parameter numbers (malloc.h)


def setting(environ: Mapping[str, str]) -> str:
    """``DDPKIT_MALLOC``'s choice, ``keep`` when unset; launchers call it to refuse a bad one before starting workers.

    Raises:
        UserError: a value that is not one of the choices.
    """
    choice = environ.get(SETTING_VARIABLE, "").strip().lower() or "keep"
    if choice not in _CHOICES:
        raise UserError(
            f"{SETTING_VARIABLE}={environ[SETTING_VARIABLE]!r} is unknown; choose keep (the default: memory a "
            "step frees stays in the process for the next) or default (glibc's own behaviour)"
        )
    return choice


def reason_to_leave_alone(environ: Mapping[str, str], libc: str | None) -> str | None:
    """Why the allocator is to be left as it is, or None to set it.

    Args:
        environ: the process's environment.
        libc: the C library's name and version, as ``os.confstr("CS_GNU_LIBC_VERSION")`` gives it
            (``"glibc 2.36"``), or None where there is none to read.

    Raises:
        UserError: ``DDPKIT_MALLOC`` holds a value that is not one of the choices.
    """
    if setting(environ) == "default":
        return f"{SETTING_VARIABLE}=default"
    chosen = [name for name in GLIBC_VARIABLES if name in environ]
    if chosen:
        return f"{chosen[0]} is set"
    if not libc or not libc.startswith("glibc"):
        return "the C library is not glibc"
    return None


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> bool:
    """Keep freed memory in the process for reuse, unless :func:`reason_to_leave_alone` gives a reason.

    Returns:
        True when glibc took both settings.
    """
    environ = os.environ if environ is None else environ
    if reason_to_leave_alone(environ, _libc_version()) is not None:
        return False
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # Both: setting either stops glibc adapting the other (the trim threshold alone measured slower than
    # neither, every block above the default 128 KiB then mmapped).
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def _libc_version() -> str | None:
    try:
        return os.confstr("CS_GNU_LIBC_VERSION")
    except (ValueError, OSError):  # not a name this system knows
        return None
