"""benchmarks/allocator.py (ddpkit train with DDPKIT_MALLOC=keep against default): its smoke run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli_runner import PYTHONPATH

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "allocator.py"


def test_every_configuration_runs_with_both_choices(tmp_path):
    out = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--output", str(tmp_path / "alloc")],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads((tmp_path / "alloc.json").read_text())
    assert set(report["runs"]) == {"W2, 1 worker", "W2, 2 workers", "W1, 2 workers"}
    for by_choice in report["runs"].values():
        for choice in ("keep", "default"):
            [run] = by_choice[choice]
            assert run["train_time_s"] > 0 and run["samples_per_s"] > 0
    table = (tmp_path / "alloc.md").read_text()
    assert "| W2, 2 workers (`model=cnn nproc=2" in table and "dataset=synthetic" in table
