"""SIGKILL of the whole job while it writes a checkpoint: the previous one stays intact and resumable."""

import os
import signal
import subprocess
import sys
import time

import pytest

from ddpkit.checkpoint.format import MANIFEST, checkpoint_name, verify_checkpoint
from tests.cli_runner import PYTHONPATH

WORDS = ["train", "nproc=1", "model=tests.train.checkpoint_helpers:ballast", "dataset=synthetic",
         "synthetic_samples=256", "batch_size=16", "epochs=3", "threads=1", "progress=false"]


def _kill_during_write(folder, proc, timeout=240.0):
    """SIGKILL the job's process group once a temporary file shows up in ``folder``: mid-write."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            names = []
        if any(".tmp-" in name for name in names):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return names
        time.sleep(0.001)
    proc.kill()
    proc.wait()
    pytest.fail(f"the job ended (or timed out) before writing {folder}:\n{proc.stderr.read()}")


@pytest.mark.slow
def test_sigkill_mid_save_leaves_the_previous_checkpoint_resumable(tmp_path):
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    root = tmp_path / "runs" / "latest" / "checkpoints"
    proc = subprocess.Popen([sys.executable, "-m", "ddpkit", *WORDS], cwd=tmp_path, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        seen = _kill_during_write(root / checkpoint_name(32), proc)  # the end of epoch 2
    finally:
        proc.stderr.close()
    assert MANIFEST not in seen
    previous = root / checkpoint_name(16)
    verify_checkpoint(previous)  # complete, every checksum right, loads safely
    assert not (root / checkpoint_name(32) / MANIFEST).exists()

    out = subprocess.run([sys.executable, "-m", "ddpkit", *WORDS, "resume=auto"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    shown = "runs/latest/checkpoints/"  # as the log names them: under the relative output_dir
    assert f"removing {shown}{checkpoint_name(32)}: an interrupted checkpoint write" in out.stderr, out.stderr
    assert f"resumed from {shown}{checkpoint_name(16)} (global step 16" in out.stderr, out.stderr
    assert verify_checkpoint(root / checkpoint_name(48))["manifest"]["completed_epochs"] == 3
