"""SIGKILL of the whole job while it writes a checkpoint: the previous one stays intact and resumable."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from ddpkit.checkpoint.disk.format import MANIFEST, checkpoint_name, verify_checkpoint
from ddpkit.commands.dispatch import main
from tests.cli_runner import PYTHONPATH

WORDS = [
    "train",
    "nproc=1",
    "model=tests.train.checkpoint_helpers:killed_mid_save",
    "dataset=synthetic",
    "synthetic_samples=256",
    "batch_size=16",
    "epochs=3",
    "threads=1",
    "progress=false",
]


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_previous_checkpoint_resumable(tmp_path, monkeypatch, capsys):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    root = tmp_path / "runs" / "latest" / "checkpoints"
    # The model SIGKILLs the job from inside torch.save of the epoch-2 checkpoint (global step 32).
    first = subprocess.run(
        [sys.executable, "-m", "ddpkit", *WORDS],
        cwd=tmp_path,
        env={**env, "DDPKIT_TEST_KILL_SAVE_STEP": "32"},
        capture_output=True,
        text=True,
        timeout=240,
        start_new_session=True,
    )
    assert first.returncode == -signal.SIGKILL, first.stderr
    seen = os.listdir(root / checkpoint_name(32))
    assert any(name.startswith(".model.pt.tmp-") for name in seen) and MANIFEST not in seen, seen
    previous = root / checkpoint_name(16)
    verify_checkpoint(previous)  # complete, every checksum right, loads safely

    # The same command with resume=auto, in this process (nproc=1 trains in the command's own process).
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    threads = torch.get_num_threads()
    try:
        assert main([*WORDS, "resume=auto"]) == 0
    finally:
        torch.set_num_threads(threads)  # (threads=1 is for the job; this process goes on with its own)
    err = capsys.readouterr().err
    # resume=auto continued the run the kill interrupted (runs/latest points to it); the log names its
    # checkpoints under the relative run folder.
    shown = f"{root.resolve().relative_to(tmp_path)}/"
    # Set aside, never deleted (a folder without a manifest may also be a copy in progress).
    assert f"set {shown}{checkpoint_name(32)} aside as {checkpoint_name(32)}.incomplete: it has no manifest" in err, err
    assert (root / f"{checkpoint_name(32)}.incomplete").is_dir()
    assert f"resumed from {shown}{checkpoint_name(16)} (global step 16" in err, err
    assert verify_checkpoint(root / checkpoint_name(48))["manifest"]["completed_epochs"] == 3
