"""benchmarks/gpu_batch_issue.py (what handing out a batch costs the loop's thread on a GPU): its CPU run.

The figures come from a GPU; here the same loop runs on the CPU, where
nothing is placed, and each source's line is checked for what it must hold.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli_runner import PYTHONPATH

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_batch_issue.py"


def test_both_sources_report_their_issue_times():
    out = subprocess.run(
        [sys.executable, str(BENCHMARK), "--device", "cpu", "--batches", "6", "--warmup", "2"],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["source"] for line in lines] == ["tensor-dataset", "workers"]
    for line in lines:
        assert 0 < line["issue_ms_median"] <= line["issue_ms_max"]
        assert line["device"] == "cpu" and line["copies_overlapped"] is None  # nothing is copied on the CPU
    assert out.stderr == ""  # no warning (global_batch_size) and no traceback
