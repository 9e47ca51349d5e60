"""Ctrl-C keeps the work: the first SIGINT is a preemption (checkpoint, exit 130), the second stops at once."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time

import psutil
import pytest

from ddpkit.checkpoint.manager.preemption import EXIT_INTERRUPTED, Preempted, PreemptionSignals
from tests.cli_runner import PYTHONPATH
from tests.helpers.launch_in_process import Commands
from tests.train.checkpoint_helpers import (
    CLI_TOTAL_STEPS,
    CLI_WORDS,
    assert_same_weights,
    final_weights,
    manifests,
    reference_weights,
)

SHM_PREFIX = f"ddpkit-shm-{os.getuid()}-"


def test_first_sigint_is_recorded_and_the_second_raises_keyboard_interrupt():
    handlers = PreemptionSignals(["SIGTERM", "SIGINT"])
    handlers.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert handlers.received == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        handlers.close()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_a_sigint_checkpoint_exits_130_and_other_signals_75():
    assert Preempted("SIGINT", "ckpt").code == EXIT_INTERRUPTED == 130
    assert Preempted("SIGTERM", "ckpt").code == Preempted("SIGUSR1", "ckpt").code == 75


def _shm_segments() -> set[str]:
    return {name for name in os.listdir("/dev/shm") if name.startswith(SHM_PREFIX)}


def _train(folder, *words: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``ddpkit train`` in a session of its own (as a terminal's foreground job is), never past 240 s."""
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH, **(env or {})}
    command = [sys.executable, "-m", "ddpkit", "train", *CLI_WORDS, "allreduce=shm", *words]
    process = subprocess.Popen(
        command,
        cwd=folder,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        out, err = process.communicate(timeout=240)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    leftovers = _wait_for_session_to_end(process.pid, seconds=10)
    assert not leftovers, f"processes left in the job's session: {leftovers}"
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def _wait_for_session_to_end(session: int, seconds: float) -> list[str]:
    """The command lines of the session's processes still alive after ``seconds`` (zombies count as gone)."""
    deadline = time.monotonic() + seconds
    while True:
        alive = []
        for p in psutil.process_iter(["pid", "status", "cmdline"]):
            try:
                if os.getsid(p.pid) == session and p.info["status"] != psutil.STATUS_ZOMBIE:
                    alive.append(" ".join(p.info["cmdline"] or []))
            except OSError:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


@pytest.mark.slow
def test_ctrl_c_checkpoints_at_the_step_exits_130_and_resume_auto_ends_bit_equal(tmp_path):
    with Commands() as commands:  # the reference and the resumed run in this process, sharing one worker server
        # The uninterrupted job of the other tests, with allreduce=builtin: the shared-memory all_reduce of this
        # job adds two ranks' gradients as exactly (a + b, then the mean), so its weights are the same bits.
        reference = reference_weights(commands)

        shm_before = _shm_segments()
        # During step 6, rank 1 sends SIGINT to the launcher's process group, as the terminal does on Ctrl-C:
        # that launcher is a command of its own, in a session of its own.
        out = _train(
            tmp_path,
            env={
                "DDPKIT_TEST_SIGNAL_STEP": "6",
                "DDPKIT_TEST_SIGNAL": "SIGINT",
                "DDPKIT_TEST_SIGNAL_TARGET": "group",
                "DDPKIT_TEST_STEP_SLEEP": "0.05",
            },
        )

        assert out.returncode == EXIT_INTERRUPTED, out.stderr
        assert "Traceback" not in out.stderr, out.stderr
        assert _shm_segments() <= shm_before, "shared-memory segments left behind"
        interrupted = [m for m in manifests(_run_folder(tmp_path)) if m["reason"] == "preempted"]
        assert len(interrupted) == 1 and 6 <= interrupted[0]["global_step"] < CLI_TOTAL_STEPS, out.stderr
        step = interrupted[0]["global_step"]
        assert manifests(_run_folder(tmp_path))[-1]["global_step"] == step  # nothing trained or saved after it
        (line,) = [line for line in out.stderr.splitlines() if line.startswith("ddpkit: interrupted:")]
        assert f"global step {step}) is complete; continue with: ddpkit train " in line, line

        # The command the line names, as given (run in this process).
        words = shlex.split(line.split("continue with: ")[1])[2:]
        assert words[-2:] == [f"output_dir={_run_folder(tmp_path).relative_to(tmp_path)}", "resume=auto"], words
        again = commands.run("train", *words, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert re.search(rf"resumed from \S+step-{step:09d}", again.stderr), again.stderr
    assert_same_weights(final_weights(_run_folder(tmp_path)), reference, f"Ctrl-C at step {step}")


def _run_folder(root):
    """The one run folder ddpkit made under root/runs (runs/latest points to it)."""
    return (root / "runs" / "latest").resolve()
