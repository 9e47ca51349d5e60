"""``logger=tensorboard``: the metrics.jsonl numbers as TensorBoard events, read back with tensorboard's reader."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ddpkit.commands.dispatch import main
from ddpkit.keyvalue import ConfigError
from ddpkit.train.config import parse_train_config
from tests.helpers.launch_in_process import Commands

RUN = [
    "dataset=synthetic",
    "synthetic_samples=768",
    "epochs=2",
    "log_every=4",
    "progress=false",
    "checkpoint.enabled=false",
    "device=cpu",
    "logger=tensorboard",
]


def _lines(run: Path) -> list[dict]:
    return [json.loads(row) for row in (run / "metrics.jsonl").read_text().splitlines()]


def _events(run: Path) -> EventAccumulator:
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    return events


def _assert_events_equal_lines(run: Path) -> None:
    lines = _lines(run)
    expected: dict[str, list[tuple[int, float, float]]] = {}
    for line in lines:
        prefix = {"train": "train", "eval": line.get("split")}.get(line["event"])
        for key in ("loss", "samples_per_s", "lr", "accuracy", "epoch"):
            if prefix and key in line:
                expected.setdefault(f"{prefix}/{key}", []).append((line["global_step"], line[key], line["time"]))
    assert {"train/loss", "train/samples_per_s", "train/lr", "test/loss", "test/accuracy"} <= set(expected)
    events = _events(run)
    assert sorted(events.Tags()["scalars"]) == sorted(expected)
    for tag, points in expected.items():
        read = [(event.step, event.value, event.wall_time) for event in events.Scalars(tag)]
        assert [step for step, _, _ in read] == [step for step, _, _ in points], tag
        for (_, value, wall_time), (_, want, want_time) in zip(read, points):
            assert value == pytest.approx(want, rel=1e-6), tag  # stored as float32
            # The tracker stamps its values when the line is handed to it, just after the line is written.
            assert wall_time == pytest.approx(want_time, abs=0.05), tag


@pytest.fixture(scope="module")
def one_worker_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("tb") / "run"
    assert main(["train", "nproc=1", *RUN, f"output_dir={run}"]) == 0
    return run


def test_scalars_equal_the_metrics_lines(one_worker_run):
    _assert_events_equal_lines(one_worker_run)
    assert [line["global_step"] for line in _lines(one_worker_run) if line["event"] == "eval"] == [12, 24]


def test_config_and_summary_as_text(one_worker_run):
    events = _events(one_worker_run)
    assert {"config/text_summary", "summary/text_summary"} <= set(events.Tags()["tensors"])
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(config) == json.loads((one_worker_run / "summary.json").read_text())["config"]
    summary = events.Tensors("summary/text_summary")[0]
    assert summary.step == 24 and '"world_size": 1' in summary.tensor_proto.string_val[0].decode()


@pytest.mark.slow
def test_two_workers_rank_zero_writes_once(tmp_path):
    with Commands() as commands:  # in this process, the workers forked from a worker server as the command's are
        out = commands.run("train", "nproc=2", *RUN, "output_dir=run", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(list((tmp_path / "run" / "tensorboard").iterdir())) == 1  # one events file: rank 0's
    _assert_events_equal_lines(tmp_path / "run")


def test_unknown_logger_is_refused():
    with pytest.raises(
        ConfigError,
        match=r"^logger='neptune' is not valid; choose one of: jsonl, csv, mlflow, "
        r"tensorboard, wandb$",
    ):
        parse_train_config(["logger=neptune"])


def test_without_tensorboard_fails_before_any_worker(tmp_path, monkeypatch, capsys):
    # As without the tensorboard extra: `import tensorboard` fails (and torch.utils.tensorboard, which imports it,
    # is imported afresh). In-process: tests/test_cli.py checks the command's exit path.
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    for name in [name for name in sys.modules if name.startswith("torch.utils.tensorboard")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.chdir(tmp_path)
    assert main(["train", "nproc=2", *RUN, "output_dir=run"]) == 2
    assert capsys.readouterr().err == (
        "error: logger=tensorboard needs the tensorboard package, which is not "
        "installed; pip install 'ddpkit[tensorboard]', or use logger=jsonl\n"
    )
    assert not (tmp_path / "run").exists()  # no worker started, nothing written
