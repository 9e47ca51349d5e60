"""Lightning under srun, and ``torchx run -s slurm PATH:train`` (killed, then resumed exactly), on a real one-node
Slurm cluster.

torchx's Slurm scheduler submits the job (sbatch) and runs the replica as an
srun task; ddpkit's launcher in it starts the 2 workers. ``torchx run``
itself then asks ``sacct`` for the job's state, which needs Slurm's
accounting storage (slurmdbd), which this cluster does not run: there the
command fails after a successful submission, and the test follows the job
with ``scontrol`` instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torchx")

import ddpkit.integrations.torchx as component  # noqa: E402
from tests.cli_runner import PYTHONPATH  # noqa: E402
from tests.helpers.slurm import SlurmCluster, start_slurm_cluster, unavailable_reason  # noqa: E402
from tests.train.checkpoint_helpers import (  # noqa: E402
    CLI_WORDS,
    assert_same_weights,
    final_weights,
    manifests,
    reference_weights,
)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    """A one-node cluster of this module's own, numbering its jobs apart from tests/cluster's (500, 1500, ...)."""
    reason = unavailable_reason()
    if reason:
        if os.environ.get("CI", "").lower() in {"true", "1"}:
            pytest.fail(reason)
        pytest.skip(reason)
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    with start_slurm_cluster(cpus=4, first_job_id=500 + 1000 * worker) as running:
        yield running


def submit(cluster: SlurmCluster, folder: Path, *words: str, env: str = "") -> int:
    """``torchx run -s slurm ddpkit/integrations/torchx.py:train --nproc 2 CLI_WORDS... output_dir=folder/run``, from
    ``folder`` (where Slurm writes the job's output files: a run needs a folder of its own); the job id."""
    options = [w for w in CLI_WORDS if not w.startswith("nproc=")]
    command = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "slurm", f"{component.__file__}:train"]
    command += ["--nproc", "2", "--cpu", "2", "--python", sys.executable, *(["--env", env] if env else [])]
    command += [*options, f"output_dir={folder / 'run'}", *words]
    environ = {**cluster.env, "PYTHONPATH": PYTHONPATH}
    out = subprocess.run(command, cwd=folder, env=environ, capture_output=True, text=True, timeout=120)
    handle = re.search(r"slurm://torchx/(\d+)", out.stdout)
    assert handle, f"torchx did not submit: {out.stderr}"
    # Submitted; a failure after that can only be torchx's status query (see the module docstring).
    assert out.returncode == 0 or "sacct" in out.stderr, out.stderr
    return int(handle.group(1))


def test_a_job_killed_under_torchx_on_slurm_resumes_to_the_uninterrupted_weights(cluster, tmp_path):
    killed = cluster.wait(submit(cluster, tmp_path, env="DDPKIT_TEST_SIGNAL_STEP=6,DDPKIT_TEST_SIGNAL=SIGKILL"))
    assert killed.state == "FAILED", killed
    assert [m["global_step"] for m in manifests(tmp_path / "run")] == [4], killed
    again = cluster.wait(submit(cluster, tmp_path, "resume=auto"))
    logs = "".join(p.read_text() for p in sorted(tmp_path.glob(f"slurm-{again.job_id}-*.err")))
    assert again.state == "COMPLETED", logs
    assert "ddpkit launcher: world_size 2 on 1 node(s)" in logs, logs
    assert f"resumed from {tmp_path}/run/checkpoints/step-000000004" in logs, logs
    assert_same_weights(final_weights(tmp_path / "run"), reference_weights(), "killed at step 6 under torchx on Slurm")


@pytest.mark.parametrize("script", ["lightning_trainer.py", "lightning_fabric.py"])
def test_a_lightning_script_under_srun_trains_as_two_ranks_with_ddpkits_environment(cluster, script, tmp_path):
    pytest.importorskip("lightning")
    from tests.integrations.test_lightning import SCRIPTS, assert_two_ranks_trained_alike

    out = cluster.run(
        ["srun", "--ntasks=2", "--cpus-per-task=1", sys.executable, str(SCRIPTS / script), str(tmp_path)],
        env={**cluster.env, "PYTHONPATH": PYTHONPATH},
        cwd=tmp_path,
        timeout=240,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert_two_ranks_trained_alike(tmp_path, source="slurm")
