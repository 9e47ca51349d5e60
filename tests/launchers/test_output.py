"""ddpkit.launchers.output: the console's copy of the workers' files, and the files torch's agent is given.

Level 1: files in a temp folder, the consoles StringIO (a terminal where the test says so); the real launches
are in tests/launchers/test_run.py.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from ddpkit.errors import UserError
from ddpkit.keyvalue import ConfigError
from ddpkit.launchers.console import CLEAR_TO_END_OF_LINE, ConsoleTee
from ddpkit.launchers.options import shown_ranks
from ddpkit.launchers.output import (
    RankLogs,
    claim_log_dir,
    hidden_stderr_note,
    last_lines,
    log_files,
    prune_log_root,
)
from ddpkit.log import PREFIXED_VARIABLE, TERMINAL_VARIABLE


class Console(io.StringIO):
    """A console that is a terminal, or not."""

    def __init__(self, terminal: bool) -> None:
        super().__init__()
        self.terminal = terminal

    def isatty(self) -> bool:
        return self.terminal


def _tee(tmp_path: Path, shown: frozenset[int] | None, world_size: int, terminal: bool) -> tuple[ConsoleTee, list]:
    stdout, stderr = Console(terminal), Console(terminal)
    tee = ConsoleTee(shown, stdout, stderr)
    files = []
    for rank in range(world_size):
        out, err = log_files(tmp_path, rank)
        tee.follow(rank, world_size, out, err)
        files.append((out.open("wb", buffering=0), err.open("wb", buffering=0)))
    return tee, files, stdout, stderr


def test_lines_are_shown_whole_as_they_end_and_a_redrawn_line_as_it_ended(tmp_path):
    tee, files, stdout, stderr = _tee(tmp_path, None, 2, terminal=False)
    files[0][0].write(b"first line\nsecond li")
    files[1][1].write(b"\r10%\r50%\r100%\n")
    tee.poll()
    assert stdout.getvalue() == "[rank 0/2] first line\n"  # not a terminal: an unfinished line waits for its end
    assert stderr.getvalue() == "[rank 1/2] 100%\n"
    files[0][0].write(b"ne\nno newline at the end")
    tee.finish()
    assert stdout.getvalue() == "[rank 0/2] first line\n[rank 0/2] second line\n[rank 0/2] no newline at the end\n"


def test_on_a_terminal_an_unfinished_line_is_redrawn_in_place(tmp_path):
    tee, files, stdout, stderr = _tee(tmp_path, frozenset({0}), 2, terminal=True)
    bar = files[0][1]
    bar.write(b"\r 10%|#")
    tee.poll()
    bar.write(b"\r 20%|##")
    tee.poll()
    bar.write(b"\r100%|###\n")
    tee.poll()
    # One rank shown: no prefix. The bar is drawn, redrawn over itself, and ended.
    assert stderr.getvalue() == (f" 10%|#\r 20%|##{CLEAR_TO_END_OF_LINE}\r100%|###{CLEAR_TO_END_OF_LINE}\n"), repr(
        stderr.getvalue()
    )
    files[1][0].write(b"rank 1 is not shown\n")
    tee.finish()
    assert stdout.getvalue() == ""


def test_another_ranks_line_ends_an_unfinished_one_first(tmp_path):
    tee, files, stdout, stderr = _tee(tmp_path, None, 2, terminal=True)
    files[0][1].write(b"\r 10%")
    tee.poll()
    files[1][1].write(b"rank 1 speaks\n")
    tee.poll()
    tee.finish()
    assert stderr.getvalue() == "[rank 0/2]  10%\n[rank 1/2] rank 1 speaks\n", repr(stderr.getvalue())


def test_hidden_ranks_that_wrote_to_stderr_are_named_with_their_files(tmp_path):
    tee, files, _, _ = _tee(tmp_path, frozenset({0}), 3, terminal=False)
    files[2][1].write(b"a warning\n")
    tee.finish()
    assert hidden_stderr_note(tee) == (
        "ddpkit: rank 2 also wrote to stderr, not shown here (the console shows rank 0; show_ranks=all shows every "
        f"rank): {tmp_path / 'rank-2.stderr.log'}"
    )


def test_last_lines_are_what_a_terminal_shows(tmp_path):
    path = tmp_path / "err.log"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(30)) + b"\r 50%\r100%\n")
    assert last_lines(path, 3) == "line 28\nline 29\n100%"
    assert last_lines(tmp_path / "missing.log") == ""


def test_torchs_agent_gets_every_rank_its_files_and_variables(tmp_path):
    tee = ConsoleTee(frozenset({1, 3}), Console(False), Console(True))
    specs = RankLogs(str(tmp_path / "logs"), str(tmp_path / "errors"), tee)
    for restart in (0, 1):
        envs = {
            local_rank: {"RANK": str(2 + local_rank), "WORLD_SIZE": "4", "TORCHELASTIC_RESTART_COUNT": str(restart)}
            for local_rank in range(2)
        }
        dest = specs.reify(envs)
        folder = tmp_path / "logs" if restart == 0 else tmp_path / "logs" / "restart-1"
        # The workers write their files themselves (write_to_files): torch redirects nothing.
        assert dest.stdouts == dest.stderrs == {0: "", 1: ""}
        assert tee.files_of(2) == (folder / "rank-2.stdout.log", folder / "rank-2.stderr.log")
        assert tee.files_of(3) == (folder / "rank-3.stdout.log", folder / "rank-3.stderr.log")
        assert dest.tee_stdouts == {} and dest.tee_stderrs == {}  # the console copy is ddpkit's, not TailLog's
        assert (
            envs[0]["TORCHELASTIC_ERROR_FILE"]
            == dest.error_files[0]
            == str(tmp_path / "errors" / f"restart-{restart}-rank-2.json")
        )
        # Rank 2 is not shown: its lines keep the logger's own prefix, and it has no terminal.
        assert PREFIXED_VARIABLE not in envs[0] and TERMINAL_VARIABLE not in envs[0]
        assert envs[1][PREFIXED_VARIABLE] == "1" and envs[1][TERMINAL_VARIABLE] == "1"


@pytest.mark.parametrize("text,ranks", [("0", {0}), ("all", None), ("ALL", None), ("0, 2", {0, 2}), ("3", {3})])
def test_show_ranks_names_ranks_or_all(text, ranks):
    assert shown_ranks(text) == (None if ranks is None else frozenset(ranks))


@pytest.mark.parametrize("text", ["", "rank0", "-1", "0;1", "some"])
def test_show_ranks_refuses_anything_else_in_one_line(text):
    with pytest.raises(ConfigError, match=rf"show_ranks='{text}' is not valid; use show_ranks=all, one rank"):
        shown_ranks(text)


@pytest.mark.parametrize(
    "title,name",
    [
        ("/home/me/train.py --lr 0.1", "train.py"),
        ("-m pkg.train --lr 0.1", "pkg.train"),
        ("ddpkit train nproc=2 model=cnn", "ddpkit-train"),
    ],
)
def test_a_workers_name_is_its_program_short(title, name):
    from ddpkit.launchers.worker_env import program_name

    assert program_name(title) == name


def test_a_launch_into_a_taken_folder_gets_a_new_one_and_leaves_the_other_launchs_files(tmp_path):
    # Two runs into one output_dir that start in the same second ask for the same logs/<second>: the second
    # must neither truncate nor delete the first's rank files (torch's redirect truncates a file that exists).
    first = claim_log_dir(tmp_path / "logs" / "20261129-010203")
    stdout, _ = log_files(first, 0)
    stdout.write_text("the live launch's line\n")
    second = claim_log_dir(tmp_path / "logs" / "20261129-010203")
    third = claim_log_dir(tmp_path / "logs" / "20261129-010203")
    assert (first.name, second.name, third.name) == ("20261129-010203", "20261129-010203-2", "20261129-010203-3")
    RankLogs(str(second), str(tmp_path / "errors"), ConsoleTee(None, Console(False), Console(False))).reify(
        {0: {"RANK": "0", "WORLD_SIZE": "1", "TORCHELASTIC_RESTART_COUNT": "0"}}
    )
    assert stdout.read_text() == "the live launch's line\n"


def test_a_log_folder_that_cannot_be_created_is_one_line(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match=r"cannot create the log folder .*file/logs \(.*\); choose a folder"):
        claim_log_dir(tmp_path / "file" / "logs")


def test_the_default_log_root_keeps_the_newest_launches_and_the_running_ones(tmp_path):
    dead = 2**22 + 1  # above the default pid_max: no such process
    folders = [tmp_path / f"train-20261129-0100{second:02d}-{dead}" for second in range(6)]
    live = tmp_path / f"run-20261128-000000-{os.getpid()}"  # old, but its launcher runs: its newest is kept
    earlier = tmp_path / f"run-20261127-000000-{os.getpid()}"  # the same launcher's earlier launch
    theirs = tmp_path / "notes"  # not a launch's: never removed
    for age, folder in enumerate([*reversed(folders), live, earlier, theirs]):
        folder.mkdir()
        (folder / "rank-0.stdout.log").write_text("x\n")
        os.utime(folder, (1_000_000 - age, 1_000_000 - age))
    removed = prune_log_root(tmp_path, keep=2, protect=folders[0])
    assert sorted(removed) == sorted([*folders[1:4], earlier])
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted(
        [folders[0].name, folders[4].name, folders[5].name, live.name, theirs.name]
    )


def test_a_progress_bar_ends_before_the_line_printed_after_it(tmp_path):
    terminal = Console(True)  # stdout and stderr on one terminal
    tee = ConsoleTee(frozenset({0}), terminal, terminal)
    stdout, stderr = log_files(tmp_path, 0)
    tee.follow(0, 2, stdout, stderr)
    with stdout.open("wb", buffering=0) as out, stderr.open("wb", buffering=0) as err:
        err.write(b"\r 50%")
        tee.poll()
        err.write(b"\r100%\n")  # the bar's end, then a print, within one interval
        out.write(b"after the bar\n")
        tee.finish()
    assert terminal.getvalue() == f" 50%\r100%{CLEAR_TO_END_OF_LINE}\nafter the bar\n", repr(terminal.getvalue())
