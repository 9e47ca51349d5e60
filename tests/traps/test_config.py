"""Command lines as new users write them, under ``ddpkit run nproc=2`` and ``ddpkit train``: what they get.

The ``ddpkit`` commands run in this process (``Commands``), their workers forked from one worker server.
"""

from __future__ import annotations

import shutil

import pytest

from ddpkit.commands.run import run_words
from ddpkit.keyvalue import ConfigError, parse
from ddpkit.launchers.script import RunConfig
from ddpkit.train.preflight import oversubscribed
from tests.cli_runner import REPO
from tests.helpers.launch_in_process import Commands

SCRIPT = REPO / "tests" / "traps" / "scripts" / "config_ranks.py"


@pytest.mark.parametrize(
    "words, expected",
    [
        (["nproc=2", "python", "x.py", "--lr", "1"], ["nproc=2", "x.py", "--lr", "1"]),
        (["nproc=2", "python3.11", "-m", "pkg.train"], ["nproc=2", "-m", "pkg.train"]),
        (["--nproc-per-node", "2", "x.py"], ["nproc=2", "x.py"]),
        (["--nproc_per_node=4", "python", "x.py"], ["nproc=4", "x.py"]),
        (
            ["nproc=2", "x.py", "python", "--nproc-per-node", "3"],
            ["nproc=2", "x.py", "python", "--nproc-per-node", "3"],
        ),
        (["nproc=2", "python"], ["nproc=2", "python"]),  # no program after it: the usual one line names the fix
    ],
)
def test_torchrun_spellings_become_ddpkit_s_and_the_program_s_words_stay(words, expected):
    assert run_words(words) == expected


def test_more_workers_than_cores_on_a_cpu_run_is_one_warning():
    crowded = oversubscribed(8, "cpu", cores=2)
    assert crowded == (
        "nproc=8 is more than the 2 CPU core(s) this machine gives the run: the workers take turns on them and "
        "train far slower than nproc=2 would"
    )
    assert oversubscribed(2, "cpu", cores=2) is None


@pytest.mark.slow
def test_python_script_and_nproc_per_node_run_as_a_torchrun_user_writes_them(tmp_path):
    shutil.copy(SCRIPT, tmp_path / "x.py")
    with Commands() as commands:
        plain = commands.run("run", "nproc=2", "show_ranks=all", "python", "x.py", "--lr", "1", cwd=tmp_path)
        flag = commands.run("run", "--nproc-per-node", "2", "show_ranks=all", "x.py", cwd=tmp_path)
        bad = commands.run("run", "nproc=2", "epochs=5", "x.py", cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr[-2000:]
    assert sorted(line for line in plain.stdout.splitlines() if "rank" in line) == [
        "[rank 0/2] rank 0 of 2: --lr 1",
        "[rank 1/2] rank 1 of 2: --lr 1",
    ], plain.stdout
    assert flag.returncode == 0 and "rank 1 of 2: " in flag.stdout, flag.stderr[-2000:]
    assert bad.returncode == 2 and bad.stderr.startswith("error: unknown config key 'epochs'; valid keys: nproc,")


def test_a_word_that_is_no_option_shows_an_option_of_the_command_in_hand():
    with pytest.raises(
        ConfigError, match=r"^'foo' is neither key=value nor a .yaml file; write it as key=value, e.g. nproc=1$"
    ):
        parse(RunConfig, ["foo"])
