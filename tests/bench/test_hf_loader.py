"""benchmarks/hf_loader.py (an HF Arrow dataset: ddpkit.DataLoader vs torch + DistributedSampler): a smoke run.

The committed result is the full run (60,000 rows); here 512 rows and one
epoch of each loader on 2 real ranks check that the script runs and writes its
JSON and Markdown.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "hf_loader.py"


@pytest.mark.slow
def test_the_hf_loader_benchmark_runs_and_writes_its_report(tmp_path):
    with Commands() as commands:
        out = commands.run(
            "run",
            "nproc=2",
            str(SCRIPT),
            "--rows",
            "512",
            "--repeats",
            "1",
            "--output",
            str(tmp_path / "hf"),
            cwd=tmp_path,
        )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    result = json.loads((tmp_path / "hf.json").read_text())
    assert result["rows"] == 512 and result["world_size"] == 2 and result["num_workers"] == 2
    assert set(result["median_samples_per_s"]) == {"ddpkit", "torch"}
    assert all(value > 0 for value in result["median_samples_per_s"].values())
    medians = result["median_samples_per_s"]
    assert abs(result["ratio_ddpkit_over_torch"] - medians["ddpkit"] / medians["torch"]) < 1e-3
    assert result["median_paired_ratio"] > 0
    assert "ratio ddpkit / torch (medians)" in (tmp_path / "hf.md").read_text()
    assert result["command"] == "ddpkit run nproc=2 benchmarks/hf_loader.py --rows 512 --repeats 1"
