"""The fault matrix: nothing is lost when two runs share a folder, a copy is half done, a folder cannot be
read, the newest checkpoint is corrupt, an option is NaN, or the loss turns to NaN.

Each case runs the real command (in this process for one worker, in subprocesses where two runs must
overlap), checks that the user sees one line (never a traceback), and that ``resume=auto`` afterwards
continues from the newest verified state, bit for bit where the uninterrupted run can be compared.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint.disk.folder_lock import HOLDER_FILE, LOCK_FILE
from ddpkit.checkpoint.disk.format import MANIFEST, checkpoint_name, list_checkpoints, verify_checkpoint
from ddpkit.commands.dispatch import main
from ddpkit.log import setup_logging
from ddpkit.names import EXIT_DIVERGED, EXIT_USER_ERROR
from tests.cli_runner import PYTHONPATH
from tests.train import fault_helpers

WORDS = ["train", "dataset=synthetic", "synthetic_samples=512", "batch_size=32", "epochs=3", "progress=false"]
"""16 steps an epoch: checkpoints step-16, step-32 (best-* follows the accuracy), step-48."""


@pytest.fixture(autouse=True)
def _log_to_this_tests_stderr(capsys):
    """ddpkit's log lines go to the stderr pytest captures for this test (a command that logs without setting
    up logging, ``ddpkit export``, would write to the stream of the test that set it up last)."""
    setup_logging(0, 1)


def _said(capsys) -> str:
    return capsys.readouterr().err


def _main(words: list[str]) -> int:
    threads = torch.get_num_threads()
    try:
        return main(words)
    finally:
        torch.set_num_threads(threads)  # (threads=0 shares this machine's cores; the tests go on with their own)


def _start(tmp_path: Path, words: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpkit", *words],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, process.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _seeds(folder: Path) -> set[int]:
    """The seed of the config stored in every checkpoint of a run folder."""
    root = folder / "checkpoints"
    infos = list_checkpoints(root) + list_checkpoints(root, prefix="best-")
    return {info.manifest["config"]["seed"] for info in infos}


def _one_error_line(err: str) -> str:
    # Worker lines, and the launcher's own notes of where each rank's output is kept, are not the error.
    lines = [line for line in err.splitlines() if not line.startswith(("[rank", "ddpkit: "))]
    assert "Traceback" not in err, err
    assert len(lines) == 1, err
    return lines[0]


# -- two runs, one folder --------------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["first holds", "second holds"])
def test_a_second_run_into_a_folder_in_use_stops_before_writing_and_names_the_holder(tmp_path, order):
    """Whichever run takes the folder first keeps it; the other stops with one line, having written nothing."""
    held, release = tmp_path / "same" / HOLDER_FILE, tmp_path / "release"
    holder_words = [*WORDS, "model=tests.train.fault_helpers:held_mlp", "output_dir=same", "seed=1"]
    other_words = [*WORDS, "model=tests.train.fault_helpers:held_mlp", "output_dir=same", "seed=2"]
    if order == "first holds":
        holder = _start(tmp_path, holder_words, DDPKIT_TEST_HOLD_UNTIL=str(release))
        _wait_for(held, holder)
        other = _start(tmp_path, other_words)
    else:  # the run started first reaches the folder only after the one started later holds it
        other = _start(tmp_path, other_words, DDPKIT_TEST_WAIT_FOR=str(held))
        holder = _start(tmp_path, holder_words, DDPKIT_TEST_HOLD_UNTIL=str(release))
    try:
        _, err = other.communicate(timeout=240)
    finally:
        release.touch()
    holder_out, holder_err = holder.communicate(timeout=240)
    assert holder.returncode == 0, holder_err
    assert other.returncode == EXIT_USER_ERROR, err
    line = _one_error_line(err)
    assert line.startswith(f"error: same is in use by another run (host {os.uname().nodename}, pid {holder.pid}, "), (
        line
    )
    assert "ddpkit train" in line and "seed=1" in line  # the holder's command
    assert line.endswith(
        f"write to another folder (output_dir=...); if that run is gone (its node died), delete same/{LOCK_FILE}"
    ), line
    # The holder's work is whole and nothing of the other run is in the folder.
    assert _seeds(tmp_path / "same") == {1}
    events = [json.loads(line) for line in (tmp_path / "same" / "metrics.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("start") == 1
    assert json.loads((tmp_path / "same" / "summary.json").read_text())["config"]["seed"] == 1
    for info in list_checkpoints(tmp_path / "same" / "checkpoints"):
        verify_checkpoint(info.path)
    assert not held.exists()  # the lock's holder record goes with the run


def test_a_launch_of_several_workers_into_a_folder_in_use_is_refused_before_they_start(tmp_path):
    """nproc=2: the launcher finds the lock held before it starts a worker (the folder already holds the other
    run's files), reports one line with exit status 2 and does not offer to continue from the other run's
    checkpoints."""
    held, release = tmp_path / "same" / HOLDER_FILE, tmp_path / "release"
    words = [*WORDS, "model=tests.train.fault_helpers:held_mlp", "output_dir=same"]
    holder = _start(tmp_path, [*words, "seed=1"], DDPKIT_TEST_HOLD_UNTIL=str(release))
    try:
        _wait_for(held, holder)
        other = _start(tmp_path, [*words, "seed=2", "nproc=2"])
        _, err = other.communicate(timeout=240)
    finally:
        release.touch()
    assert holder.wait(timeout=240) == 0
    assert other.returncode == EXIT_USER_ERROR, err
    line = _one_error_line(err)
    assert line.startswith("error: same is in use by another run (host "), line
    assert "continue with" not in err
    assert _seeds(tmp_path / "same") == {1}


def test_a_run_resumes_its_own_folder_after_it_ended(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert _main([*WORDS, "output_dir=run", "epochs=1"]) == 0
    assert _main([*WORDS, "output_dir=run", "resume=auto"]) == 0
    assert "resumed from run/checkpoints/step-000000016" in _said(capsys)


# -- what a resume finds ---------------------------------------------------------------------------------


@pytest.fixture
def uninterrupted(tmp_path_factory):
    """An uninterrupted 4-epoch run, and the 3-epoch run the faults are made in (a copy per test)."""
    base = tmp_path_factory.mktemp("runs")
    cwd = os.getcwd()
    os.chdir(base)
    try:
        assert _main([*WORDS, "output_dir=three"]) == 0
        assert _main([*WORDS, "output_dir=four", "epochs=4"]) == 0
    finally:
        os.chdir(cwd)
    return base


def _copy(uninterrupted: Path, tmp_path: Path) -> Path:
    shutil.copytree(uninterrupted / "three", tmp_path / "run", symlinks=True)
    return tmp_path / "run" / "checkpoints"


def _final_weights(folder: Path) -> dict:
    return verify_checkpoint(folder / "checkpoints" / checkpoint_name(64))["model.pt"]


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_folder_without_a_manifest_is_set_aside_never_deleted_and_the_best_one_resumes(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    root = _copy(uninterrupted, tmp_path)
    best = [info.path.name for info in list_checkpoints(root, prefix="best-")]
    for info in list_checkpoints(root):  # a copy of every step-* still in progress: no manifest yet
        (info.path / MANIFEST).unlink()
    newest = list_checkpoints(root)[-1].path
    weights = (newest / "model.pt").read_bytes()
    monkeypatch.chdir(tmp_path)
    assert _main([*WORDS, "output_dir=run", "epochs=4", "resume=auto"]) == 0
    err = _said(capsys)
    assert f"resume=auto: no complete step-* checkpoint is newer than {best[0]}; resuming from the best" in err
    aside = newest.with_name(newest.name + ".incomplete")
    assert f"set run/checkpoints/{newest.name} aside as {aside.name}: it has no manifest" in err, err
    assert (aside / "model.pt").read_bytes() == weights  # nothing that may be data was deleted
    # The best checkpoint was the epoch-2 one here only if the accuracy says so; wherever it was, the
    # run continued from it exactly.
    _assert_bit_equal(_final_weights(tmp_path / "run"), _final_weights(uninterrupted / "four"))


def _unreadable(command: list[str]) -> list[str]:
    """``command`` run so that a folder of mode 000 cannot be read, also by root (who reads anything): without
    the capabilities that let root pass file permissions (util-linux's setpriv)."""
    if os.geteuid() != 0:
        return command
    assert shutil.which("setpriv"), "the tests run as root: setpriv (util-linux) drops root's read capability"
    return ["setpriv", "--bounding-set=-dac_override,-dac_read_search", *command]


def test_an_unreadable_checkpoint_is_one_line_in_the_listing_and_set_aside_by_resume(uninterrupted, tmp_path):
    root = _copy(uninterrupted, tmp_path)
    newest = list_checkpoints(root)[-1].path
    newest.chmod(0)
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"}
    try:
        listing = subprocess.run(
            _unreadable([sys.executable, "-m", "ddpkit", "checkpoints", "run"]),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert listing.returncode == 1, listing.stderr
        assert "Traceback" not in listing.stderr + listing.stdout
        rows = {line.split()[0]: line for line in listing.stdout.splitlines()[2:]}
        assert (
            f"UNREADABLE: checkpoint {root.relative_to(tmp_path) / newest.name} cannot be read (Permission denied)"
            in rows[newest.name]
        )
        assert rows[checkpoint_name(32)].endswith("ok, newest")
        assert listing.stderr.strip() == (
            f"ddpkit: the newest checkpoint {newest.name} is not usable (UNREADABLE); "
            f"resume=auto would continue from {checkpoint_name(32)}"
        )
        resumed = subprocess.run(
            _unreadable([sys.executable, "-m", "ddpkit", *WORDS, "output_dir=run", "epochs=4", "resume=auto"]),
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        assert resumed.returncode == 0, resumed.stderr
        assert "Traceback" not in resumed.stderr
        assert (
            f"newest checkpoint run/checkpoints/{newest.name} is unreadable; using the previous good one"
            in resumed.stderr
        )
        assert f"set run/checkpoints/{newest.name} aside as {newest.name}.unreadable" in resumed.stderr
    finally:
        for folder in root.iterdir():
            folder.chmod(0o700)
    _assert_bit_equal(_final_weights(tmp_path / "run"), _final_weights(uninterrupted / "four"))


def test_a_corrupt_newest_checkpoint_is_never_called_newest_nor_exported_nor_taken_by_init_from(
    uninterrupted, tmp_path, monkeypatch, capsys
):
    root = _copy(uninterrupted, tmp_path)
    newest = list_checkpoints(root)[-1].path
    data = bytearray((newest / "optimizer.pt").read_bytes())  # model.pt intact: only a full check finds it
    data[len(data) // 2] ^= 1
    (newest / "optimizer.pt").write_bytes(bytes(data))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()

    assert _main(["checkpoints", "run"]) == 1
    out, err = capsys.readouterr()
    rows = {line.split()[0]: line for line in out.splitlines()[2:]}
    assert "CORRUPT" in rows[newest.name] and "newest" not in rows[newest.name]
    assert rows[checkpoint_name(32)].endswith("ok, newest")
    assert f"the newest checkpoint {newest.name} is not usable (CORRUPT)" in err

    assert _main(["export", f"run/checkpoints/{newest.name}", "out1"]) == EXIT_USER_ERROR
    assert _one_error_line(capsys.readouterr().err).startswith(
        f"error: run/checkpoints/{newest.name}/optimizer.pt is damaged: its SHA-256 does not match"
    )
    capsys.readouterr()
    assert _main(["export", "run", "out2"]) == 0
    said = _said(capsys)
    assert f"skipping a newer checkpoint than {checkpoint_name(32)}: " in said and "optimizer.pt is damaged" in said
    assert json.loads((tmp_path / "out2" / "model.json").read_text())["source"]["global_step"] == 32

    capsys.readouterr()
    assert _main([*WORDS, "output_dir=new", "epochs=1", "init_from=run"]) == 0
    said = _said(capsys)
    assert f"skipping a newer checkpoint than {checkpoint_name(32)}: " in said and "init_from run: loaded" in said

    assert _main([*WORDS, "output_dir=run", "epochs=4", "resume=auto"]) == 0
    _assert_bit_equal(_final_weights(tmp_path / "run"), _final_weights(uninterrupted / "four"))


# -- bad input -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "words, message",
    [
        (["lr=nan"], "error: lr=nan is not valid; it must be a finite number (not nan or inf)"),
        (["timeout=nan"], "error: timeout=nan is not valid; it must be a finite number (not nan or inf)"),
        (["lr=inf"], "error: lr=inf is not valid; it must be a finite number (not nan or inf)"),
        (
            ["checkpoint.every_seconds=nan"],
            "error: checkpoint.every_seconds=nan is not valid; it must be a finite number (not nan or inf)",
        ),
        (
            ["model=tests.train.fault_helpers:not_a_module"],
            "error: model=tests.train.fault_helpers:not_a_module returned a dict, not a torch.nn.Module; make the "
            "function return the model itself",
        ),
        (["output_dir=a_file"], "error: output_dir a_file is not a folder; choose a folder (output_dir=...)"),
        (["output_dir=a_file/run"], "error: output_dir a_file/run is not a folder (its parent a_file is a file)"),
    ],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, words, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a_file").write_text("not a folder")
    assert _main([*WORDS, *words]) == EXIT_USER_ERROR
    assert _one_error_line(capsys.readouterr().err).startswith(message)


def test_an_unwritable_output_dir_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "locked").mkdir()
    (tmp_path / "locked").chmod(0o500)
    try:
        command = _unreadable([sys.executable, "-m", "ddpkit", *WORDS, "output_dir=locked/run"])
        done = subprocess.run(
            command,
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": PYTHONPATH},
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        (tmp_path / "locked").chmod(0o700)
    assert done.returncode == EXIT_USER_ERROR, done.stderr
    assert _one_error_line(done.stderr) == (
        "error: cannot create output_dir locked/run (Permission denied); choose a folder this user can write "
        "(output_dir=...)"
    )


# -- a diverging run -------------------------------------------------------------------------------------


def test_a_diverging_run_stops_with_one_line_and_keeps_the_last_good_checkpoints(tmp_path, monkeypatch, capsys):
    """NaN losses from step 40 (epoch 3): step-16 and step-32 (keep=2) stay, no checkpoint of NaN weights is
    written, the run exits EXIT_DIVERGED naming step-32, and resume=auto continues from it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPKIT_TEST_NAN_FROM_STEP", "40")
    fault_helpers.reset_steps()
    words = [*WORDS, "loss=tests.train.fault_helpers:nan_from_step", "output_dir=run", "checkpoint.keep=2"]
    assert _main(words) == EXIT_DIVERGED
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: the weights hold NaN or infinity (") or line.startswith(
        "error: the training loss became nan"
    ), line
    assert line.endswith(
        f"the last good checkpoint, run/checkpoints/{checkpoint_name(32)}, is kept; continue from it with "
        "resume=auto lr=..."
    ), line
    root = tmp_path / "run" / "checkpoints"
    assert [info.path.name for info in list_checkpoints(root)] == [checkpoint_name(16), checkpoint_name(32)]
    for info in list_checkpoints(root):
        weights = verify_checkpoint(info.path)["model.pt"]
        assert all(torch.isfinite(t).all() for t in weights.values())
    monkeypatch.delenv("DDPKIT_TEST_NAN_FROM_STEP")
    assert _main([*words, "resume=auto"]) == 0
    assert f"resumed from run/checkpoints/{checkpoint_name(32)}" in _said(capsys)


def test_a_loss_that_turns_nan_between_checkpoints_is_caught_at_the_log_window(tmp_path, monkeypatch, capsys):
    """log_every=4, no checkpoint due before step 16: the window's running loss stops the run at step 8."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DDPKIT_TEST_NAN_FROM_STEP", "6")
    fault_helpers.reset_steps()
    words = [*WORDS, "loss=tests.train.fault_helpers:nan_from_step", "output_dir=run", "log_every=4"]
    assert _main(words) == EXIT_DIVERGED
    line = _one_error_line(capsys.readouterr().err)
    assert line.startswith("error: the training loss became nan between global steps 4 and 8 (epoch 1)"), line
    assert line.endswith("no checkpoint was written before; start over"), line
    assert list_checkpoints(tmp_path / "run" / "checkpoints") == []
