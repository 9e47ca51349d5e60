"""benchmarks/flat_grads.py (grad_sync=flat's designs, per-step cost on 2 ranks): a smoke run.

The committed result is the full run (300 rounds of 10 steps); here 2 rounds
of 3 steps on 2 real ranks check that every variant trains (the ones that
average leave the ranks with equal weights, which the script asserts) and
that the script writes its JSON and Markdown.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "flat_grads.py"
VARIANTS = {
    f"{design}, {communication}"
    for design in ("hooks+copy", "copy-at-end", "direct")
    for communication in ("shm", "none")
} | {"unsynced"}


@pytest.mark.slow
def test_the_flat_grads_benchmark_runs_and_writes_its_report(tmp_path):
    with Commands() as commands:
        out = commands.run(
            "run",
            "nproc=2",
            str(SCRIPT),
            "--blocks",
            "2",
            "--steps",
            "3",
            "--warmup",
            "2",
            "--output",
            str(tmp_path / "flat"),
            cwd=tmp_path,
        )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    result = json.loads((tmp_path / "flat.json").read_text())
    assert result["world_size"] == 2 and result["blocks"] == 2 and result["steps_per_block"] == 3
    for kind in ("wall_us_per_step", "cpu_us_per_step"):
        assert set(result[kind]) == VARIANTS
        assert all(stats["median"] > 0 for stats in result[kind].values())
        assert result[kind]["hooks+copy, shm"]["ratio"] == 1.0
    assert "| copy-at-end, shm |" in (tmp_path / "flat.md").read_text()
    assert result["command"] == "ddpkit run nproc=2 benchmarks/flat_grads.py --blocks 2 --steps 3"
