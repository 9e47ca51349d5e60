"""``ddpkit bench startup``: the ratios and their targets, and a real smoke run through the CLI."""

from __future__ import annotations

import json

import pytest

from ddpkit.bench.startup import DDPKIT_1, DDPKIT_2, T8, T9, TORCHRUN, StartupBenchConfig, _ratios, render_markdown
from ddpkit.keyvalue import parse
from tests.bench.in_process import run_main


def _row(name: str, wall: float, first: float | None = None) -> dict:
    row = {"name": name, "wall_s": {"median": wall, "min": wall, "max": wall, "n": 1}}
    if first is not None:
        row["first_step_s"] = {"median": first, "min": first, "max": first, "n": 1}
    return row


def test_t8_compares_first_step_with_torchruns_wall_and_t9_the_two_walls():
    ratios = _ratios([_row(DDPKIT_1, 6.0, 2.0), _row(DDPKIT_2, 5.0, 2.5), _row(TORCHRUN, 2.0)])
    assert ratios[T8] == {"value": 1.25, "target": 1.0, "met": False}
    assert ratios[T9] == {"value": pytest.approx(5.0 / 6.0), "target": 1.0, "met": True}


def test_markdown_names_the_command_and_whether_each_target_is_met():
    results = [_row(DDPKIT_1, 6.0, 2.0), _row(DDPKIT_2, 5.0, 2.5), _row(TORCHRUN, 2.0)]
    report = {
        "machine": {"date": "2026-11-24", "torch": "2.13.0", "cpu_model": "cpu", "cores": 2},
        "command_words": ["repeats=3"],
        "train_words": ["progress=false"],
        "results": results,
        "ratios": _ratios(results),
    }
    text = render_markdown(report)
    assert "Command: `ddpkit bench startup repeats=3`" in text
    assert f"| {T8} | 1.250 | <= 1.00 | not met |" in text and f"| {T9} | 0.833 | <= 1.00 | met |" in text
    assert f"| {TORCHRUN} | - | - | - | 2.00 | 2.00 | 2.00 | - |" in text


def test_no_repeats_is_refused():
    with pytest.raises(ValueError, match="repeats=0 is not valid; it must be at least 1"):
        parse(StartupBenchConfig, ["repeats=0"])


@pytest.mark.slow
def test_smoke_run_times_the_three_commands(tmp_path):
    code, _ = run_main("bench", "startup", "smoke=true", f"output_dir={tmp_path}")  # each command in its own process
    assert code == 0
    (json_path,) = tmp_path.glob("startup-*-smoke.json")
    report = json.loads(json_path.read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert set(rows) == {DDPKIT_1, DDPKIT_2, TORCHRUN}
    for name in (DDPKIT_1, DDPKIT_2):
        (sample,) = rows[name]["samples"]
        # The first step begins after the command starts and before it ends, training included.
        assert 0 < sample["first_step_s"] < sample["wall_s"] - sample["train_time_s"]
    assert rows[TORCHRUN]["wall_s"]["median"] > 0
    assert report["ratios"][T9]["value"] == pytest.approx(
        rows[DDPKIT_2]["wall_s"]["median"] / rows[DDPKIT_1]["wall_s"]["median"]
    )
    assert "| ratio (medians, same run) | value | target | met |" in json_path.with_suffix(".md").read_text()
