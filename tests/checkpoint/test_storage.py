"""Storage faults: a full or read-only checkpoint folder is one line, nothing incomplete is left, no work is lost.

The file systems are real: small tmpfs mounts (root only; the tests skip with
the reason elsewhere). The first tests drive a Checkpointer in this process
(world size 1); the last runs ``ddpkit train nproc=2`` into a file system
that holds two checkpoints and a half, frees space and resumes.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from torch import nn

from ddpkit import EXIT_STORAGE, Checkpointer
from ddpkit.checkpoint.disk.format import list_checkpoints, verify_checkpoint
from ddpkit.checkpoint.disk.storage import StorageError, estimate_bytes
from ddpkit.names import EXIT_STORAGE
from tests.helpers.launch_in_process import Commands
from tests.train.checkpoint_helpers import (
    CLI_TOTAL_STEPS,
    LogRecords,
    assert_same_weights,
    final_weights,
    run_job_here,
)

PAGE = 4096


@contextlib.contextmanager
def tmpfs(folder: Path, size: int) -> Iterator[Path]:
    """A tmpfs of ``size`` bytes mounted on ``folder`` for the block; skips the test where mounting is refused."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    folder.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if mounted.returncode:
        pytest.skip(f"mount -t tmpfs was refused here: {mounted.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=True)


def remount(folder: Path, options: str) -> None:
    """``mount -o remount,OPTIONS`` of the tmpfs on ``folder``."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(folder)], check=True)


def stepped_model() -> tuple[nn.Module, torch.optim.Optimizer]:
    """A 64k-parameter model (256 kB) and an Adam that has stepped once (so its state exists)."""
    torch.manual_seed(0)
    model = nn.Linear(252, 252)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 252)).sum().backward()
    optimizer.step()
    return model, optimizer


def page_bytes(folder: Path) -> int:
    """Bytes ``folder``'s files take on a tmpfs (whole pages)."""
    return sum(-(-p.stat().st_size // PAGE) * PAGE for p in folder.iterdir())


def test_full_disk_is_one_line_with_sizes_and_leaves_no_incomplete_folder(tmp_path):
    model, optimizer = stepped_model()
    with tmpfs(tmp_path / "small", 1_000_000) as small:
        ckpt = Checkpointer(small / "ckpt", model=model, optimizer=optimizer, keep=5, preempt_signals=())
        try:
            ckpt.resume("never")
            first = ckpt.save()  # about 770 kB: fits once
            ckpt.step()
            with pytest.raises(StorageError) as failed:
                ckpt.save()
        finally:
            ckpt.close()
        message = str(failed.value)
        assert "\n" not in message
        assert f"cannot write checkpoint {small / 'ckpt' / 'step-000000001'}: No space left on device" in message
        assert " free on the file system of " in message and "a checkpoint needs about 7" in message, message
        assert f"the newest complete checkpoint {first} is untouched" in message, message
        assert "then continue with resume=auto" in message, message
        assert failed.value.exit_status == EXIT_STORAGE == 74
        assert [info.path for info in list_checkpoints(small / "ckpt")] == [first]  # nothing incomplete left
        assert not [p for p in first.iterdir() if p.name.startswith(".")]  # nor a temporary file
        verify_checkpoint(first)


def test_read_only_folder_names_the_fix(tmp_path):
    model, optimizer = stepped_model()
    with tmpfs(tmp_path / "ro", 4_000_000) as folder:
        (folder / "ckpt").mkdir()
        remount(folder, "ro")
        ckpt = Checkpointer(folder / "ckpt", model=model, optimizer=optimizer, preempt_signals=())
        try:
            with pytest.raises(
                StorageError,
                match=r"Read-only file system .*; no complete checkpoint exists yet; "
                r"make .*ckpt writable by this user",
            ):
                ckpt.save()
        finally:
            ckpt.close()


def test_warn_mode_goes_on_and_retries_at_the_next_save(tmp_path):
    model, optimizer = stepped_model()
    with tmpfs(tmp_path / "small", 1_000_000) as small, LogRecords() as logs:
        ckpt = Checkpointer(
            small / "ckpt", model=model, optimizer=optimizer, keep=1, preempt_signals=(), on_write_error="warn"
        )
        try:
            ckpt.resume("never")
            first = ckpt.save()
            ckpt.step()
            assert ckpt.save() is None  # not written: a warning, and training goes on
            assert ckpt.last_path == first
            remount(small, "size=4000000")
            ckpt.step()
            second = ckpt.save()  # the next save writes, and keep=1 then removes the older one
        finally:
            ckpt.close()
        warnings = logs.warnings()
        assert any(
            "No space left on device" in w and "(training goes on: on_write_error=warn)" in w for w in warnings
        ), warnings
        assert [info.path for info in list_checkpoints(small / "ckpt")] == [second]


def test_a_folder_too_small_for_keep_plus_one_is_warned_about_before_training(tmp_path):
    model = nn.Linear(252, 252)
    optimizer = torch.optim.Adam(model.parameters())  # not stepped: its state is estimated
    expected = estimate_bytes({"model": model, "optimizer": optimizer}, world_size=1)
    assert 3 * 256_000 < expected < 3 * 256_000 + 100_000
    with tmpfs(tmp_path / "small", 2 * expected) as small, LogRecords() as logs:
        roomy = Checkpointer(small / "roomy", model=model, optimizer=optimizer, keep=1, preempt_signals=())
        roomy.start()  # what resume() and the first step() do: before any training
        roomy.close()
        assert not logs.warnings()
        tight = Checkpointer(small / "tight", model=model, optimizer=optimizer, keep=2, preempt_signals=())
        tight.start()
        tight.close()
        assert any(
            w.startswith(f"checkpoint folder {small / 'tight'} has ")
            and "keeping 2 checkpoint(s)" in w
            and "a save will fail for lack of space" in w
            for w in logs.warnings()
        ), logs.warnings()


@pytest.mark.slow
def test_full_disk_under_ddpkit_train_stops_with_74_and_resume_after_freeing_is_bit_equal(tmp_path):
    reference, run, small = tmp_path / "reference", tmp_path / "run", tmp_path / "small"
    reference.mkdir()
    run.mkdir()
    with Commands() as commands:
        out = run_job_here(commands, reference, "checkpoint.keep=2")
        assert out.returncode == 0, out.stderr
        newest = [info for info in list_checkpoints(reference / "checkpoints") if info.manifest][-1]
        size = page_bytes(newest.path)
        # Two checkpoints and a half: with keep=2 the third save (global step 12) has no room.
        with tmpfs(small, size * 5 // 2):
            words = ("checkpoint.keep=2", f"checkpoint.dir={small}")
            out = run_job_here(commands, run, *words)
            assert out.returncode == EXIT_STORAGE, out.stderr
            errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "Traceback" not in out.stderr, out.stderr
            assert f"cannot write checkpoint {small}/step-000000012: No space left on device (" in errors[0], errors
            assert f"the newest complete checkpoint {small}/step-000000008 is untouched" in errors[0], errors
            assert "continue with: ddpkit train" in out.stderr and "resume=auto" in out.stderr, out.stderr
            assert [info.global_step for info in list_checkpoints(small)] == [4, 8]  # none incomplete
            remount(small, f"size={8 * size}")  # space freed
            out = run_job_here(commands, run, *words, "resume=auto")
            assert out.returncode == 0, out.stderr
            assert f"resumed from {small}/step-000000008" in out.stderr, out.stderr
            newest = [info for info in list_checkpoints(small) if info.manifest][-1]
            assert newest.global_step == CLI_TOTAL_STEPS
            assert_same_weights(
                verify_checkpoint(newest.path)["model.pt"], final_weights(reference), "resumed after a full disk"
            )


def test_a_failed_rewrite_of_a_saved_step_does_not_name_one_folder_removed_and_untouched(tmp_path):
    import errno

    from ddpkit.checkpoint.disk.format import checkpoint_name, write_checkpoint
    from ddpkit.checkpoint.disk.storage import explain_write_error

    write_checkpoint(tmp_path, checkpoint_name(5), {"model.pt": {"w": torch.ones(2)}}, {}, {"global_step": 5})
    line = explain_write_error(
        tmp_path, checkpoint_name(5), OSError(errno.ENOSPC, "No space left on device"), needed=10_000
    )
    assert f"the incomplete new copy of {checkpoint_name(5)} was removed" in line
    assert f"the complete {checkpoint_name(5)} written earlier is untouched" in line
    assert line.count(checkpoint_name(5)) == 3 and "\n" not in line  # the attempted path, removed, untouched
    # The file system has room for it now (a quota, or another writer that filled it and freed it since).
    assert "free space there (or raise your quota), keep fewer checkpoints" in line and "at least 0 B" not in line


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_full_disk_under_a_sharded_write_is_named_not_torch_saves_unexpected_pos(tmp_path):
    from ddpkit.checkpoint.sharded.state import ShardedState

    model, optimizer = stepped_model()  # 256 kB of weights, 512 kB of Adam's state: a single rank's shards
    shards = ShardedState(model, optimizer, rank=0, world_size=1)
    with tmpfs(tmp_path / "small", 300_000) as small:
        shards.save(small, "step-000000001", 0o600, lambda: 800_000)
        with pytest.raises(StorageError) as failed:
            shards.staged()
    message = str(failed.value)
    assert message.startswith(f"cannot write checkpoint {small / 'step-000000001'}: No space left on device ("), message
    assert "unexpected pos" not in message and "\n" not in message
    assert failed.value.exit_status == EXIT_STORAGE


def test_a_storage_error_declares_its_exit_status_and_others_keep_the_callers():
    from ddpkit.errors import UserError, exit_status

    assert StorageError.exit_status == EXIT_STORAGE  # declared on the class, read as an attribute
    assert exit_status(StorageError("no space left"), 2) == EXIT_STORAGE
    assert exit_status(UserError("bad option"), 2) == 2  # a user error without its own: the caller's usual
    assert exit_status(RuntimeError("a bug"), 1) == 1
