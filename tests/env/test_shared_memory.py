"""/dev/shm: its measure, what ddpkit needs of it, and the segment size against the C library that allocates it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ddpkit.comm.shm import segment_bytes
from ddpkit.env import shared_memory
from ddpkit.env.shared_memory import FIX, SharedMemory, loader_bytes, measure, too_small
from tests.cli_runner import PYTHONPATH
from tests.helpers.small_shm import with_shm_of

MIB = 1 << 20


def test_measure_reads_the_size_and_free_space_of_a_tmpfs():
    space = measure()
    stat = os.statvfs("/dev/shm")
    assert space.path == "/dev/shm" and space.total_bytes == stat.f_blocks * stat.f_frsize
    assert 0 <= space.free_bytes <= space.total_bytes


def test_measure_of_a_missing_folder_is_none(tmp_path):
    assert measure(str(tmp_path / "nothing")) is None


def test_fits_compares_with_the_free_space():
    space = SharedMemory("/dev/shm", 64 * MIB, 60 * MIB)
    assert space.fits(60 * MIB) and not space.fits(60 * MIB + 1)


def test_a_loader_holds_its_prefetched_batches_and_the_two_the_loop_holds():
    assert loader_bytes(MIB, num_workers=2, prefetch_factor=2, num_batches=100) == 6 * MIB
    assert loader_bytes(MIB, num_workers=2, prefetch_factor=2, num_batches=3) == 3 * MIB  # a short epoch
    assert loader_bytes(MIB, num_workers=0, prefetch_factor=2, num_batches=100) == 0


def test_the_message_is_one_line_with_the_sizes_and_the_fix():
    message = too_small("the thing", 4 * MIB, SharedMemory("/dev/shm", MIB, MIB // 2))
    assert message == f"the thing needs about 4.0 MiB of shared memory but /dev/shm has 0.5 MiB free of 1.0 MiB; {FIX}"
    assert "\n" not in message and "--shm-size=1g" in FIX and "--ipc=host" in FIX


def test_the_segment_grows_with_the_ranks_up_to_its_cap():
    assert segment_bytes(1) == 0
    assert segment_bytes(2) == 4096 + 4 * MIB  # a page of header and control lines, two 1 MiB slots per rank
    assert segment_bytes(64) <= 33 * MIB  # slots shrink beyond 16 ranks so that docker's 64 MB holds it


_OPEN_RANK_0 = """
import ctypes, errno, os, sys
from ddpkit.comm.shm import _lib
from ddpkit.comm.shm.communicator import slot_bytes
lib = _lib.load().lib
handle = ctypes.c_void_p()
slot = slot_bytes({world_size})
rc = lib.ddpkit_shm_open(b"/ddpkit-test-size", 0, {world_size}, slot, min(256 << 10, slot), 5.0, 0.0,
                         ctypes.byref(handle))
lib.ddpkit_shm_unlink(b"/ddpkit-test-size")
print("ok" if rc == 0 else errno.errorcode[-rc])
"""


@pytest.mark.cluster
@pytest.mark.parametrize("world_size", [2, 5])
def test_segment_bytes_is_exactly_what_the_library_allocates(world_size):
    # In a /dev/shm of exactly segment_bytes, rank 0 creates the segment; one page less, and it cannot.
    script = _OPEN_RANK_0.format(world_size=world_size)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    results = []
    for size in (segment_bytes(world_size), segment_bytes(world_size) - 4096):
        argv = with_shm_of(size, [sys.executable, "-c", script])
        results.append(subprocess.run(argv, capture_output=True, text=True, env=env, timeout=120))
    assert [r.stdout.strip() for r in results] == ["ok", "ENOSPC"], [r.stderr[-2000:] for r in results]


def test_a_shared_memory_error_is_the_user_s_to_fix():
    assert issubclass(shared_memory.SharedMemoryError, ValueError)
