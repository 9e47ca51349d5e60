"""FolderLock: one run per folder; a dead holder never blocks; one process may lock one folder twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import ddpkit
from ddpkit.checkpoint.disk.folder_lock import HOLDER_FILE, LOCK_FILE, FolderInUseError, FolderLock, read_holder
from ddpkit.errors import UserError
from ddpkit.names import EXIT_USER_ERROR
from tests.cli_runner import PYTHONPATH

HOLD = """
import sys, time
from ddpkit.checkpoint.disk.folder_lock import FolderLock
lock = FolderLock(sys.argv[1]).acquire()
print("held", flush=True)
time.sleep(120)
"""


def _holder(folder):
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(folder)],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout.readline().strip() == "held"
    return process


def test_a_second_process_is_refused_with_the_holder_named_and_a_dead_holder_blocks_nothing(tmp_path):
    holder = _holder(tmp_path / "run")
    try:
        with pytest.raises(FolderInUseError) as refused:
            FolderLock(tmp_path / "run", fix="output_dir=...").acquire()
        message = str(refused.value)
        assert message.startswith(f"{tmp_path / 'run'} is in use by another run (host {os.uname().nodename}, ")
        assert f"pid {holder.pid}, since 20" in message and " UTC: " in message
        assert message.endswith(
            f"; wait for it to end or write to another folder (output_dir=...); if that run is gone (its node "
            f"died), delete {tmp_path / 'run' / LOCK_FILE}"
        )
        assert "\n" not in message
        assert isinstance(refused.value, UserError) and refused.value.exit_status == EXIT_USER_ERROR
    finally:
        holder.send_signal(signal.SIGKILL)  # no release, no cleanup: the kernel drops the lock
        holder.wait()
    assert read_holder(tmp_path / "run")["pid"] == holder.pid  # its record is stale, and harmless
    with FolderLock(tmp_path / "run") as lock:
        assert lock.held
        assert read_holder(tmp_path / "run")["pid"] == os.getpid()
    assert not lock.held and not (tmp_path / "run" / HOLDER_FILE).exists()


def test_one_process_may_lock_a_folder_twice_and_the_last_release_frees_it(tmp_path):
    """ddpkit train's run folder and its Checkpointer's folder may be one (checkpoint.dir=output_dir)."""
    outer = FolderLock(tmp_path).acquire()
    inner = FolderLock(tmp_path).acquire()
    inner.release()
    inner.release()  # idempotent
    refused = subprocess.run(
        [sys.executable, "-c", HOLD, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "FolderInUseError" in refused.stderr  # the outer hold still counts
    outer.release()
    holder = _holder(tmp_path)  # now free
    holder.kill()
    holder.wait()


def test_the_holder_record_is_beside_the_lock_file_never_in_it(tmp_path):
    with FolderLock(tmp_path / "a"):
        record = json.loads((tmp_path / "a" / HOLDER_FILE).read_text())
        assert set(record) == {"host", "pid", "since", "command"}
        assert (tmp_path / "a" / LOCK_FILE).read_bytes() == b""


def test_the_lock_is_public():
    assert ddpkit.FolderLock is FolderLock and ddpkit.FolderInUseError is FolderInUseError


def test_a_restarted_run_waits_for_its_predecessor_s_lock(tmp_path):
    import threading
    import time

    from ddpkit.train.run_folder import lock_wait_seconds

    assert lock_wait_seconds({}) == 0 and lock_wait_seconds({"TORCHELASTIC_RESTART_COUNT": "1"}) > 10
    holder = _holder(tmp_path)  # a dying predecessor's DataLoader worker, say
    threading.Timer(1.0, holder.kill).start()
    start = time.monotonic()
    with FolderLock(tmp_path).acquire(timeout=30) as lock:
        assert lock.held and 0.5 < time.monotonic() - start < 30
    holder.wait()


def test_a_symbolic_link_at_the_lock_file_is_refused_in_one_line_and_its_target_never_created(tmp_path):
    from ddpkit.checkpoint.disk.folder_lock import LockFileError

    folder, target = tmp_path / "run", tmp_path / "elsewhere" / "victim"
    folder.mkdir()
    target.parent.mkdir()
    (folder / LOCK_FILE).symlink_to(target)
    with pytest.raises(LockFileError) as refused:
        FolderLock(folder).acquire()
    message = str(refused.value)
    assert message == (
        f"{folder / LOCK_FILE} is a symbolic link (to {target}), not a lock file; ddpkit never follows a link "
        f"there: delete it (rm {folder / LOCK_FILE}) and run again"
    )
    assert not target.exists()


UNOPENABLE = """
import os, sys
from ddpkit.checkpoint.disk.folder_lock import FolderLock, LockFileError
os.setgid(65534); os.setuid(65534)  # nobody (after the imports: the interpreter's files may be root's alone)
try:
    FolderLock(sys.argv[1]).acquire()
except LockFileError as e:
    print(e)
"""


def test_a_lock_file_this_user_cannot_open_is_named_with_its_owner_not_the_folder():
    if os.geteuid() != 0:
        pytest.skip("another user's lock file needs root to make (CI runs as root)")
    with tempfile.TemporaryDirectory() as scratch:  # not under pytest's folder: that is root's alone (0700)
        folder = Path(scratch) / "run"
        folder.mkdir()
        FolderLock(folder).acquire().release()  # root's lock file, mode 0600, left as a run leaves it
        os.chmod(scratch, 0o755)
        os.chmod(folder, 0o777)  # the folder is writable by everyone: the lock file alone is the problem
        seen = subprocess.run(
            [sys.executable, "-c", UNOPENABLE, str(folder)],
            env={**os.environ, "PYTHONPATH": PYTHONPATH},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert seen.stdout == (
        f"the lock file {folder / LOCK_FILE} cannot be opened by this user (Permission denied: it belongs to uid 0, "
        f"mode 0600); if no run is using {folder}, delete the lock file (or make it readable and writable by this "
        "user) and run again\n"
    ), seen.stderr
