"""Commands that see a /dev/shm of a chosen size: a tmpfs in a mount namespace of their own.

As a container runtime gives a container its own /dev/shm (``--shm-size``),
without a container: ``unshare --mount`` (util-linux) gives the command a
private copy of the mount table, where a small tmpfs is mounted over
/dev/shm; the machine's own /dev/shm is untouched. Needs root.
"""

from __future__ import annotations

from collections.abc import Sequence


def with_shm_of(size_bytes: int, argv: Sequence[str]) -> list[str]:
    """``argv`` run with a private /dev/shm of ``size_bytes`` (rounded up to pages by tmpfs)."""
    mount = f'mount -t tmpfs -o size={size_bytes},mode=1777 tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", mount, "small-shm", *argv]
