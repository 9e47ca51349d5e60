"""``ddpkit run``: any script as N workers through ddpkit's launcher, with torchrun's environment."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ddpkit.launchers.local
from ddpkit.commands.dispatch import main
from ddpkit.launchers.script import USAGE, RunConfig, ScriptTarget, parse_run_command
from ddpkit.names import EXIT_PREEMPTED
from tests.cli_runner import PYTHONPATH
from tests.helpers.launch_in_process import Commands

SCRIPTS = Path(__file__).resolve().parent / "scripts"
CONSOLE_SCRIPT = Path(sys.executable).with_name("ddpkit")
TIMEOUT = 120


def run_console_script(*words: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run the installed ``ddpkit`` console script (its sys.path[0] is its bin folder, not ``cwd``)."""
    assert CONSOLE_SCRIPT.is_file(), f"no console script beside {sys.executable}; pip install -e . first"
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run(
        [str(CONSOLE_SCRIPT), *words], cwd=cwd, env=environ, capture_output=True, text=True, timeout=TIMEOUT
    )


@pytest.mark.parametrize(
    "words,expected",
    [
        (["a.py", "nproc=2", "--lr", "0.1"], (RunConfig(), ScriptTarget(path="a.py", args=("nproc=2", "--lr", "0.1")))),
        (
            ["nproc=2", "max_restarts=1", "-m", "json.tool", "-h"],
            (RunConfig(nproc=2, max_restarts=1), ScriptTarget(module="json.tool", args=("-h",))),
        ),
        (["-mjson.tool", "x"], (RunConfig(), ScriptTarget(module="json.tool", args=("x",)))),
        (
            ["nnodes=2", "node_rank=1", "master_addr=node0", "master_port=29500", "a.py"],
            (RunConfig(nnodes="2", node_rank=1, master_addr="node0", master_port=29500), ScriptTarget(path="a.py")),
        ),
        (
            ["nnodes=1:4", "master_addr=login1", "master_port=29500", "rdzv_id=job7", "a.py"],
            (RunConfig(nnodes="1:4", master_addr="login1", master_port=29500, rdzv_id="job7"), ScriptTarget("a.py")),
        ),
    ],
)
def test_words_before_the_script_are_ddpkits(tmp_path, monkeypatch, words, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("")
    assert parse_run_command(words) == expected


@pytest.mark.parametrize(
    "words,message",
    [
        (
            ["run", "nproc=2", "missing.py", "--lr", "0.1"],
            "error: script 'missing.py' does not exist; give the path of a .py file",
        ),
        (["run", "nproc=2"], f"error: no script to run (a path ending in .py, or -m MODULE); {USAGE}"),
        (["run", "nproc=2", "-m"], f"error: -m needs a module name; {USAGE}"),
        (
            ["run", "-m", "no_such_module_here.sub"],
            "error: no module named 'no_such_module_here' in the current folder",
        ),
        (["run", "nproc=0", "a.py"], "error: nproc=0 is not valid; it must be > 0"),
        (["run", "nprocs=2", "a.py"], "error: unknown config key 'nprocs' (did you mean 'nproc'?)"),
        (["run", "folder.py"], "error: script 'folder.py' is a folder, not a Python file"),
        (["run", "nnodes=2", "master_port=29500", "a.py"], "error: nnodes=2 needs master_addr=HOST"),
        (
            ["run", "nnodes=1:2", "master_port=29500", "a.py"],
            "error: nnodes=1:2 needs master_addr=HOST, the host name or address of the host of the rendezvous store",
        ),
        (
            ["run", "nnodes=1:2", "node_rank=1", "master_addr=h", "master_port=29500", "a.py"],
            "error: node_rank=1 is not used with nnodes=1:2: the nodes of an elastic job agree on their ranks; "
            "leave node_rank out",
        ),
        (
            ["run", "nnodes=3:2", "a.py"],
            "error: nnodes=3:2 is not valid: MIN > MAX; use nnodes=MIN:MAX with MIN <= MAX (e.g. 1:4)",
        ),
        (
            ["run", "nnodes=1:2:3", "a.py"],
            "error: nnodes=1:2:3 is not valid; use nnodes=N (N nodes) or nnodes=MIN:MAX (elastic, e.g. nnodes=1:4)",
        ),
    ],
)
def test_bad_input_is_one_line_before_any_worker(tmp_path, monkeypatch, capsys, words, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("")
    (tmp_path / "folder.py").mkdir()
    monkeypatch.setattr(ddpkit.launchers.local, "launch_local", _no_launch)
    assert main(words) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err


def _no_launch(*args, **kwargs):
    raise AssertionError("bad input must be reported before any worker starts")


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict[str, subprocess.CompletedProcess]:
    """The ``ddpkit run`` commands of the tests below, by name: each one's exit status, stdout and stderr.

    They run in this process (``ddpkit.commands.dispatch.main``), their workers forked from one worker server shared by
    all of them; the command's own process is what the console-script tests below start.
    """
    folder = tmp_path_factory.mktemp("run")
    # show_ranks=all where a test reads what every rank prints (by default the console shows rank 0).
    launches = {
        "all_reduce": ["nproc=2", "show_ranks=all", str(SCRIPTS / "all_reduce.py"), "--lr", "0.1"],
        "raise": ["nproc=2", str(SCRIPTS / "fails.py"), "raise"],
        # nproc=1 also goes through the launcher (a spawned worker with RANK set), as nproc=2 does.
        "exit 3": [str(SCRIPTS / "fails.py"), "exit", "3"],
        "exit 75": [str(SCRIPTS / "fails.py"), "exit", "75"],
        "restarts": ["nproc=2", "max_restarts=1", "show_ranks=all", str(SCRIPTS / "restarts.py")],
        "os._exit": ["nproc=2", "show_ranks=all", str(SCRIPTS / "os_exit.py")],
        "output": ["nproc=2", f"log_dir={folder / 'logs'}", str(SCRIPTS / "output.py")],
        "output all": ["nproc=3", "show_ranks=all", f"log_dir={folder / 'logs-all'}", str(SCRIPTS / "output.py")],
        "hidden fails": ["nproc=2", f"log_dir={folder / 'logs-fails'}", str(SCRIPTS / "output.py"), "1"],
    }
    with Commands() as commands:
        return {name: commands.run("run", *words, cwd=folder) for name, words in launches.items()}


def test_plain_torch_distributed_script_gets_torchruns_environment_and_its_arguments(launched):
    out = launched["all_reduce"]
    assert out.returncode == 0, out.stderr  # the script ends with `raise SystemExit`: success, as for python
    lines = re.findall(
        r"^\[rank \d/2\] rank (\d)/2 sum=(\d+) argv=(\[.*?\]) name=(\S+) path0=(\S+) env=([A-Z_,]+)$",
        out.stdout,
        re.MULTILINE,
    )
    assert sorted(rank for rank, *_ in lines) == ["0", "1"], out.stdout + out.stderr
    for _, total, argv, name, path0, env in lines:
        assert total == "3" and argv == "['--lr', '0.1']" and name == "__main__"
        assert path0 == str(SCRIPTS)  # the script's folder first on sys.path, as with `python script.py`
        assert env == "LOCAL_RANK,LOCAL_WORLD_SIZE,GROUP_RANK,TORCHELASTIC_RUN_ID,TORCHELASTIC_RESTART_COUNT"


def test_module_from_the_current_folder_with_ddpkit_init_through_the_console_script():
    out = run_console_script("run", "nproc=2", "show_ranks=all", "-m", "with_ddpkit", "--x", "1", cwd=SCRIPTS)
    assert out.returncode == 0, out.stderr
    for rank in (0, 1):
        assert f"ddpkit rank {rank}/2 sum=1 argv=['--x', '1']" in out.stdout, out.stdout + out.stderr


def test_raising_rank_is_reported_once_with_its_traceback(launched):
    out = launched["raise"]
    assert out.returncode == 1
    error_lines = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    expected = "error: worker rank 1 failed (exit code 1): RuntimeError: rank 1 fails on purpose"
    assert error_lines == [expected], out.stderr
    assert out.stderr.count("Traceback (most recent call last)") == 1, out.stderr
    assert f'File "{SCRIPTS / "fails.py"}", line 11, in <module>' in out.stderr, out.stderr
    assert 'raise RuntimeError(f"rank {dist.get_rank()} fails on purpose")' in out.stderr
    assert "should not get here" not in out.stdout


@pytest.mark.parametrize(
    "status,returncode,message",
    [
        (3, 1, "error: worker rank 0 failed (exit code 3): exited without an error message"),
        (75, 75, "ddpkit: preempted: a worker exited with status 75; run the same command to continue"),
    ],
)
def test_exit_status_of_a_rank(launched, status, returncode, message):
    out = launched[f"exit {status}"]
    assert out.returncode == returncode, out.stderr
    assert message in out.stderr and "Traceback" not in out.stderr, out.stderr


def test_max_restarts_restarts_every_worker_after_a_failure(launched):
    out = launched["restarts"]
    assert out.returncode == 0, out.stderr
    assert sorted(re.findall(r"rank (\d) restart=(\d) sum=(\d+)", out.stdout)) == [("0", "1", "2"), ("1", "1", "2")]


def test_workers_ending_with_os_exit_0_finish_the_launch(launched):
    # No return value reaches torch's agent from such a worker; the launch must end, not poll forever.
    out = launched["os._exit"]
    assert out.returncode == 0, out.stderr
    assert sorted(re.findall(r"rank (\d) ends with os._exit", out.stdout)) == ["0", "1"], out.stdout


def test_the_console_shows_rank_0_as_it_printed_and_every_rank_has_its_files(launched, tmp_path_factory):
    out = launched["output"]
    assert out.returncode == 0, out.stderr
    logs = Path(out.stderr.splitlines()[1].rpartition(" is in ")[2])
    assert out.stderr.splitlines()[1] == (
        "ddpkit: the console shows rank 0's output (show_ranks=all: every rank's), each rank's whole output is in "
        + str(logs)
    ), out.stderr
    # Rank 0's lines as it wrote them (no prefix: one rank shown), its progress bar as a terminal ends it.
    title = f"ddpkit rank 0/2: {SCRIPTS / 'output.py'} | name: r0:output.py"
    assert out.stdout.splitlines() == [
        "hello from rank 0",
        f"title of rank 0: {title}",
        "rank 0 ends without a newline",
    ], out.stdout
    assert "a warning from rank 0\nrank 0 progress 100%\n" in out.stderr and "rank 1" not in out.stdout
    # Rank 1 wrote to stderr: one line says so, and where; its files hold all it wrote.
    assert (
        f"ddpkit: rank 1 also wrote to stderr, not shown here (the console shows rank 0; show_ranks=all shows "
        f"every rank): {logs / 'rank-1.stderr.log'}" in out.stderr
    ), out.stderr
    assert (logs / "rank-1.stdout.log").read_text().startswith("hello from rank 1\ntitle of rank 1: ddpkit rank 1/2: ")
    assert (logs / "rank-1.stderr.log").read_bytes().startswith(b"a warning from rank 1\n\rrank 1 progress 0%\r")


def test_show_ranks_all_prefixes_every_line_with_its_rank(launched):
    out = launched["output all"]
    assert out.returncode == 0, out.stderr
    for rank in range(3):
        assert f"[rank {rank}/3] hello from rank {rank}\n" in out.stdout, out.stdout
        assert f"[rank {rank}/3] title of rank {rank}: ddpkit rank {rank}/3: " in out.stdout, out.stdout
        assert f"[rank {rank}/3] rank {rank} ends without a newline\n" in out.stdout, out.stdout
        assert f"[rank {rank}/3] rank {rank} progress 100%\n" in out.stderr, out.stderr
    assert "progress 50%" not in out.stderr  # not a terminal: a redrawn line shows as it ended
    assert all(line.startswith("[rank ") for line in out.stdout.splitlines()), out.stdout


def test_a_hidden_rank_that_fails_is_reported_with_its_last_lines_and_its_files(launched):
    out = launched["hidden fails"]
    assert out.returncode == 1, out.stderr
    report = out.stderr[out.stderr.index("error: ") :]
    logs = Path(out.stderr.splitlines()[1].rpartition(" is in ")[2])
    assert report == (
        "error: worker rank 1 failed (exit code 3): exited without an error message\n"
        "the last lines of its stderr:\na warning from rank 1\nrank 1 progress 100%\nrank 1 stops here\n"
        f"ddpkit: rank 1's whole output: {logs / 'rank-1.stdout.log'}, {logs / 'rank-1.stderr.log'}\n"
    ), out.stderr


def test_missing_script_through_the_console_script_is_one_line(tmp_path):
    out = run_console_script("run", "nproc=2", "missing.py", cwd=tmp_path)
    assert out.returncode == 2
    assert out.stderr == (
        f"error: script 'missing.py' does not exist; give the path of a .py file "
        f"(relative paths start from the current folder {tmp_path})\n"
    )


def test_console_script_imports_model_from_the_current_folder_in_every_worker(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "from torch import nn\n\n\ndef build():\n    return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))\n"
    )
    out = run_console_script(
        "train",
        "model=mymodels:build",
        "nproc=2",
        "epochs=1",
        "dataset=synthetic",
        "synthetic_samples=256",
        "checkpoint.enabled=false",
        "progress=false",
        f"output_dir={tmp_path / 'out'}",
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "out" / "summary.json").is_file()


def test_the_worker_server_starts_importing_before_the_launcher_imports_torch(tmp_path):
    """Side by side, not one after the other: on a GPU machine importing torch takes seconds (the H200's 4.5)."""
    probe = """
import sys, multiprocessing.forkserver as forkserver
start = forkserver.ensure_running
def ensure_running():
    print("torch in the launcher when the server starts:", "torch" in sys.modules, file=sys.stderr)
    start()
forkserver.ensure_running = ensure_running
from ddpkit.commands.dispatch import main
sys.exit(main(sys.argv[1:]))
"""
    (tmp_path / "a.py").write_text("print('the script ran')\n")
    out = subprocess.run(
        [sys.executable, "-c", probe, "run", "nproc=1", "a.py"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert out.returncode == 0, out.stderr
    assert "torch in the launcher when the server starts: False" in out.stderr
    assert "the script ran" in out.stdout


# -- workers matched to GPUs -----------------------------------------------------------------------


def test_more_workers_than_gpus_is_one_line_before_any_worker(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(ddpkit.launchers.local, "launch_local", _no_launch)
    assert main(["run", "nproc=2", "a.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith("error: 2 workers on this node but 1 visible GPU: device=auto gives each worker a GPU")
    assert "nproc=1" in err and "device=cpu" in err and "CUDA_VISIBLE_DEVICES" in err


@pytest.mark.parametrize(
    ("words", "num_gpus", "expected"),
    [
        (["nproc=2", "a.py"], 0, {}),  # no GPU: the workers train on the CPU
        (["nproc=2", "a.py"], 2, {}),
        (["nproc=4", "device=cpu", "a.py"], 1, {"CUDA_VISIBLE_DEVICES": ""}),  # the workers see no GPU
    ],
)
def test_the_workers_environment_for_the_device_option(tmp_path, monkeypatch, words, num_gpus, expected):
    from ddpkit.launchers.script import worker_environ

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("")
    config, _ = parse_run_command(words)
    assert worker_environ(config, num_gpus) == expected


def test_device_cpu_hides_the_gpus_from_the_workers_only(tmp_path, monkeypatch):
    """The launcher's own environment is as it was after the launch."""
    from ddpkit.commands import run as run_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text("")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    seen = {}

    def launch(spec, fn, *args):
        seen["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES")
        return 0, ""

    monkeypatch.setattr(run_command, "launch", launch)
    assert main(["run", "device=cpu", "a.py"]) == 0
    assert seen == {"CUDA_VISIBLE_DEVICES": ""} and "CUDA_VISIBLE_DEVICES" not in os.environ


def test_sigterm_to_the_launcher_of_a_checkpointing_script_exits_75_and_the_same_command_continues(tmp_path):
    """A scheduler's SIGTERM to ``ddpkit run``: the workers checkpoint and exit 75, and so does the launcher,
    with one line that says so; the same command again resumes and finishes."""
    out = tmp_path / "ckpt"
    out.mkdir()
    command = [sys.executable, "-m", "ddpkit", "run", "nproc=2", str(SCRIPTS / "preemptible.py"), str(out)]
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH}
    launcher = subprocess.Popen(command, cwd=tmp_path, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT
        while not (out / "ready").exists() and launcher.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=TIMEOUT)
    finally:
        launcher.kill()
    stdout, stderr = stdout.decode(), stderr.decode()
    assert launcher.returncode == EXIT_PREEMPTED, stdout + stderr
    assert stderr.splitlines()[-1] == (
        "ddpkit: preempted by SIGTERM: the workers checkpointed and exited 75; run the same command again to continue"
    ), stderr
    assert "error:" not in stderr, stderr

    again = subprocess.run(command, cwd=tmp_path, env=environ, capture_output=True, text=True, timeout=TIMEOUT)
    assert again.returncode == 0, again.stderr
    assert "resumed=True" in again.stdout and "done" in again.stdout, again.stdout + again.stderr
