"""Property: any words given to ``ddpkit train`` give a run or one line with exit status 2, never a traceback.

Hypothesis draws sequences of key=value words (known keys, misspelt keys,
groups, dotted keys; values of every type, YAML syntax, interpolations,
empty values), YAML files (valid, broken, missing) and options, and runs
``ddpkit.commands.dispatch.main(["train", ...])`` on them in this process, in a fresh
folder each time. Everything the command does before its workers start
runs for real: parsing, the model's recipe, the pre-flight checks, the run
folder. Only the workers are left out (500 examples must not start 500
jobs): the function the workers run, the launcher and the worker server
are replaced by ones that record the config.

Checked for every example: exit status 0 (a run: its config reached the
workers) or 2 with one line ``error: ...`` on stderr; no traceback; and
nothing written outside the run folder (and ``runs/latest``, which points
to it). Values of keys that name folders are relative names (a user may
point ``output_dir`` anywhere: that is not a fault), and those that name
modules come from a list (importing a module of random name could run it).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings, strategies as st

import ddpkit.commands.dispatch
import ddpkit.commands.train
import ddpkit.launchers.server
import ddpkit.train.run
from ddpkit.keyvalue import _example, _field_names
from ddpkit.train.config import TrainConfig

KEYS = _field_names(TrainConfig)
FOLDER_KEYS = {"output_dir", "checkpoint.dir", "data_dir", "init_from"}
MODULE_VALUES = {
    "model": ["mlp", "cnn", "cnn_bn", "autoencoder", "resnet", "no_such_module:build", "tests.test_cli_fuzz:nothing"],
    "dataset": ["synthetic", "no-such-data", "no_such_module:build"],
    "loss": ["", "no_such_module:loss"],
}
"""Values for keys that name something to import; file datasets are left out (a missing one is downloaded)."""
OTHER_KEYS = ["epoch", "nprocs", "checkpoint", "checkpoint.nope", "lr.x", "x.y.z", "", "train.epochs"]
VALUES = st.one_of(
    st.integers(-5, 10**6).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(str),
    st.sampled_from(
        [
            "true",
            "false",
            "True",
            "yes",
            "no",
            "null",
            "~",
            "[]",
            "{}",
            "[1, 2]",
            "{a: 1}",
            "{keep: x}",
            "auto",
            "never",
            "2:00:00",
            "1e3",
            "0x10",
            "",
            "'",
            '"',
            "'two'",
            "${oc.env:HOME}",
            "${x}",
            "${",
            "fp16",
            "sgd",
            "cosine",
            "SIGTERM",
            "SIGUSR1,USR2",
            "per_worker",
            "tensorboard",
        ]
    ),
    st.text(alphabet=st.characters(codec="utf-8", exclude_characters="/\x00"), max_size=12),
)
OPTIONS = ["--help", "-h", "--epochs", "-x", "--", "5", "-m", "--version"]


def _word(key: str, draw: st.DrawFn) -> str:
    if key in FOLDER_KEYS:
        return f"{key}={draw(st.sampled_from(['', 'a', 'runs/b', 'c d', 'checkpoints', 'auto']))}"
    if key in MODULE_VALUES:
        return f"{key}={draw(st.sampled_from(MODULE_VALUES[key]))}"
    if key == "resume":
        return f"resume={draw(st.sampled_from(['auto', 'never', '', 'a', 'nope/step-000000001']))}"
    return f"{key}={draw(VALUES)}"


@st.composite
def words(draw: st.DrawFn) -> list[tuple[str, object]]:
    """("word", text) for key=value words and options; ("yaml", content) for a YAML file to write."""
    kinds = st.sampled_from(
        ["default"] * 6 + ["known"] * 6 + ["other", "option", "yaml", "broken_yaml", "missing_yaml", "bare"]
    )
    drawn = []
    for kind in draw(st.lists(kinds, max_size=6)):
        if kind == "default":  # a value of the right type: the key's default
            key = draw(st.sampled_from([k for k in KEYS if k not in FOLDER_KEYS | set(MODULE_VALUES) | {"resume"}]))
            drawn.append(("word", _example(TrainConfig, key)))
        elif kind == "known":
            drawn.append(("word", _word(draw(st.sampled_from(KEYS)), draw)))
        elif kind == "other":
            drawn.append(("word", f"{draw(st.sampled_from(OTHER_KEYS))}={draw(VALUES)}"))
        elif kind == "option":
            drawn.append(("word", draw(st.sampled_from(OPTIONS))))
        elif kind == "yaml":
            pairs = draw(st.lists(st.sampled_from(KEYS), max_size=3))
            drawn.append(("yaml", "\n".join(_word(key, draw).replace("=", ": ", 1) for key in pairs)))
        elif kind == "broken_yaml":
            drawn.append(("yaml", draw(st.sampled_from(["epochs: [", "a: b: c", "- 1\n- 2", "42", "\t:"]))))
        elif kind == "missing_yaml":
            drawn.append(("word", "no-such-file.yaml"))
        else:
            drawn.append(("word", draw(st.text(max_size=8).filter(lambda w: "=" not in w and "/" not in w))))
    return drawn


class Workers:
    """What stands in for the workers: records the config each launch would have handed them."""

    def __init__(self) -> None:
        self.configs: list[TrainConfig] = []

    def run_worker(self, cfg: TrainConfig, export_dir: str = "") -> dict:
        self.configs.append(cfg)
        return {}

    def launch(self, spec, fn, cfg, export_dir) -> tuple[int, str]:
        return self.run_worker(cfg) or 0, ""  # the status, and no signal reached the launcher


@pytest.fixture
def workers(monkeypatch) -> Workers:
    stand_in = Workers()
    monkeypatch.setattr(ddpkit.train.run, "run_worker", stand_in.run_worker)
    monkeypatch.setattr(ddpkit.commands.train, "launch", stand_in.launch)
    monkeypatch.setattr(ddpkit.launchers.server, "worker_server", contextlib.nullcontext)
    return stand_in


@settings(
    max_examples=500,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(drawn=words())
def test_any_words_give_a_run_or_one_line_with_exit_2(drawn, workers, capfd):
    with tempfile.TemporaryDirectory(prefix="ddpkit-fuzz-") as folder, _inside(folder):
        argv = []
        for n, (kind, content) in enumerate(drawn):
            if kind == "yaml":
                Path(folder, f"config-{n}.yaml").write_text(str(content))
                argv.append(f"config-{n}.yaml")
            else:
                argv.append(str(content))
        written = set(_files(folder))
        workers.configs.clear()
        code = ddpkit.commands.dispatch.main(["train", *argv])
        out, err = capfd.readouterr()
        event("exit 2" if code == 2 else "a run" if workers.configs else f"exit {code}, no run")
        assert "Traceback" not in out + err, f"{argv}: {err}"
        if code == 2:
            assert err.startswith("error: ") and err.count("\n") == 1 and not out, f"{argv}: {err!r}"
            assert not workers.configs
        else:
            assert code == 0, f"{argv}: exit {code}: {err}"
            if workers.configs:  # a run (else the help was asked for)
                _check_writes(folder, written, Path(workers.configs[0].output_dir))


def nothing() -> None:
    """Not a model: returns None (model=tests.test_cli_fuzz:nothing)."""


@contextlib.contextmanager
def _inside(folder: str):
    saved = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(saved)


def _files(folder: str) -> list[Path]:
    return [Path(root, name) for root, dirs, names in os.walk(folder) for name in [*dirs, *names]]


def _check_writes(folder: str, before: set[Path], run_folder: Path) -> None:
    run_folder = Path(folder, run_folder).resolve()
    allowed = {Path(folder, "runs"), Path(folder, "runs", "latest")}
    for path in set(_files(folder)) - before:
        inside = path.resolve() == run_folder or run_folder in path.resolve().parents
        assert inside or path in allowed or path.resolve() in run_folder.parents, f"{path} written outside {run_folder}"


def test_the_drawn_words_reach_every_outcome(workers, capfd):
    """The strategy is not too tame: a YAML file it draws is read, and its words give runs and errors."""
    with tempfile.TemporaryDirectory(prefix="ddpkit-fuzz-") as folder, _inside(folder):
        Path(folder, "a.yaml").write_text(yaml.safe_dump({"epochs": 2, "checkpoint": {"keep": 3}}))
        assert ddpkit.commands.dispatch.main(["train", "a.yaml", "nproc=2", "dataset=synthetic"]) == 0
        assert workers.configs[-1].checkpoint.keep == 3 and workers.configs[-1].nproc == 2
        assert ddpkit.commands.dispatch.main(["train", "nproc=two"]) == 2
    assert "error: bad value for 'nproc': nproc must be a whole number, e.g. nproc=1" in capfd.readouterr().err
