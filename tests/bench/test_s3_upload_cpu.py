"""benchmarks/s3_upload_cpu.py (an upload's CPU seconds, client against loopback S3 server): a smoke run.

The committed result uploads 288 MiB three times; here 16 MiB twice (enough for each side's CPU time to
show in the clock's 10 ms ticks) check that the script starts its server, uploads, reads both processes'
CPU time and writes its JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cli_runner import PYTHONPATH

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "s3_upload_cpu.py"


def test_the_upload_cpu_benchmark_runs_and_writes_its_report(tmp_path):
    (tmp_path / "benchmarks").mkdir()
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--megabytes", "16", "--uploads", "2", "--name", "smoke"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": PYTHONPATH, "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr}"
    result = json.loads((tmp_path / "benchmarks" / "smoke.json").read_text())
    assert result["megabytes"] == 16 and len(result["uploads"]) == 2
    for upload in result["uploads"]:
        assert upload["wall_s"] > 0 and upload["client_cpu_s"] > 0 and upload["server_cpu_s"] > 0
    assert set(result["medians"]) == {"wall_s", "client_cpu_s", "server_cpu_s"}
