"""``ddpkit plot``: a PNG of real runs' curves; bad input is one line and exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from ddpkit.commands.dispatch import main
from ddpkit.train.plot import label_runs, read_run
from tests.cli_runner import REPO

RUN = [
    "train",
    "nproc=1",
    "dataset=synthetic",
    "synthetic_samples=768",
    "epochs=2",
    "log_every=4",
    "progress=false",
    "checkpoint.enabled=false",
    "device=cpu",
]
DPI, PANEL_INCHES = 110, (5.0, 4.0)
RUN_COLORS = ((31, 119, 180), (255, 127, 14))  # matplotlib's C0 and C1: the first and second run


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two real 2-epoch runs (12 steps each) that differ only in their learning rate."""
    root = tmp_path_factory.mktemp("runs")
    for name, lr in (("slow", "0.001"), ("fast", "0.01")):
        assert main([*RUN, f"lr={lr}", f"output_dir={root / name}"]) == 0
    return root / "slow", root / "fast"


def _pixels_of(image: Image.Image, color: tuple[int, int, int]) -> int:
    return sum(count for count, pixel in image.convert("RGB").getcolors(maxcolors=1 << 20) if pixel == color)


def test_two_runs_one_png(two_runs, tmp_path, capsys):
    output = tmp_path / "out" / "compare.png"
    assert main(["plot", *map(str, two_runs), f"output={output}"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {output} (2 run(s)")
    with Image.open(output) as image:
        assert image.format == "PNG"
        assert image.size == (3 * PANEL_INCHES[0] * DPI, PANEL_INCHES[1] * DPI)  # three panels in a row
        assert len(image.convert("RGB").getcolors(maxcolors=1 << 20)) > 50, "a blank image"
        for color in RUN_COLORS:  # both runs drawn, each in its own color
            assert _pixels_of(image, color) > 100


def test_legend_names_the_runs_by_what_differs(two_runs):
    runs = label_runs([read_run(folder) for folder in two_runs])
    assert [run.label for run in runs] == ["slow (lr=0.001)", "fast (lr=0.01)"]


def test_curves_are_the_metrics_lines(two_runs):
    run = read_run(two_runs[0])
    lines = [json.loads(row) for row in (two_runs[0] / "metrics.jsonl").read_text().splitlines()]
    assert run.train == [line for line in lines if line["event"] == "train"]
    assert [line["global_step"] for line in run.train] == [4, 8, 12, 16, 20, 24]
    assert [(line["epoch"], line["global_step"]) for line in run.test] == [(1, 12), (2, 24)]
    assert run.steps_per_epoch() == 12
    assert run.settings["world_size"] == 1 and run.settings["lr"] == 0.001


def test_one_run_through_latest_link_and_epoch_axis(two_runs, tmp_path):
    latest = tmp_path / "latest"
    latest.symlink_to(two_runs[1], target_is_directory=True)
    assert main(["plot", str(latest), "x=epoch", "panels=test"]) == 0
    with Image.open(latest / "metrics.png") as image:  # one run: its own folder
        assert image.size == (PANEL_INCHES[0] * DPI, PANEL_INCHES[1] * DPI)
        assert _pixels_of(image, RUN_COLORS[0]) > 100
    assert label_runs([read_run(latest)])[0].label == "fast"  # the folder the link points to
    (latest / "metrics.png").unlink()
    assert main(["plot", str(two_runs[0] / "metrics.jsonl"), f"output={tmp_path / 'a.png'}"]) == 0
    assert (tmp_path / "a.png").stat().st_size > 0


def test_resumed_run_counts_the_later_line(tmp_path):
    rows = [
        {"event": "train", "epoch": 0, "global_step": step, "loss": loss, "samples_per_s": 1.0, "lr": 0.1}
        for step, loss in ((1, 3.0), (2, 2.0), (2, 1.5), (3, 1.0))
    ]  # resumed at step 1: step 2 again
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows) + '{"event": "tr')
    run = read_run(tmp_path)  # the cut last line of a killed run is left out
    assert [(line["global_step"], line["loss"]) for line in run.train] == [(1, 3.0), (2, 1.5), (3, 1.0)]
    assert run.settings == {} and label_runs([run])[0].label == tmp_path.name


@pytest.mark.parametrize(
    "make,words,message",
    [
        (None, ["nowhere"], "error: nowhere does not exist; pass a run folder"),
        ("folder", ["run"], "error: run holds no metrics.jsonl (ddpkit train writes one into its output_dir)"),
        ("empty", ["run"], "error: run/metrics.jsonl is empty: the run has not written a line yet"),
        ("garbled", ["run"], "error: line 1 of run/metrics.jsonl is not JSON"),
        ("empty", [], "error: ddpkit plot needs a run folder"),
        ("empty", ["run", "x=time"], "error: x='time' is not valid; choose one of: step, epoch"),
        ("empty", ["run", "panels=loss,acc"], "error: panels='acc' is not valid; choose one of: loss, test,"),
    ],
)
def test_bad_input_is_one_line(tmp_path, monkeypatch, capsys, make, words, message):
    monkeypatch.chdir(tmp_path)
    if make:
        (tmp_path / "run").mkdir()
    if make == "empty":
        (tmp_path / "run" / "metrics.jsonl").write_text("")
    if make == "garbled":
        (tmp_path / "run" / "metrics.jsonl").write_text("epoch 1: loss 0.5\n")
    assert main(["plot", *words]) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1, err
    assert not list(tmp_path.rglob("*.png"))


def test_without_matplotlib_names_the_extra(two_runs, tmp_path):
    # A Python where `import matplotlib` fails, as without the plot extra.
    code = (
        "import sys; sys.modules['matplotlib'] = None; from ddpkit.commands.dispatch import main; "
        f"sys.exit(main(['plot', {str(two_runs[0])!r}, 'output=out.png']))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": str(REPO / "src")},
    )
    assert out.returncode == 2
    assert out.stderr == (
        "error: ddpkit plot needs matplotlib, which is not installed; pip install 'ddpkit[plot]'\n"
    ), out.stderr
    assert not (tmp_path / "out.png").exists()
