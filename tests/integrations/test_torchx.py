"""torchx starts ddpkit jobs through ddpkit.integrations.torchx: ``torchx run -s local_cwd PATH:train``.

The job is ``ddpkit train``'s own: stopped by a signal it checkpoints and
exits 75, killed it keeps its last checkpoint, and the same torchx command
with ``resume=auto`` ends on the weights of an uninterrupted run, bit for bit.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torchx")

from torchx.specs import macros  # noqa: E402

import ddpkit.integrations.torchx as component  # noqa: E402
from tests.cli_runner import PYTHONPATH  # noqa: E402
from tests.train.checkpoint_helpers import (  # noqa: E402
    CLI_WORDS,
    assert_same_weights,
    final_weights,
    manifests,
    reference_weights,
)

COMPONENT = Path(component.__file__)


def torchx_train(folder: Path, *words: str, env: str = "") -> subprocess.CompletedProcess:
    """``torchx run -s local_cwd ddpkit/integrations/torchx.py:train --nproc 2 CLI_WORDS... output_dir=folder``."""
    options = [w for w in CLI_WORDS if not w.startswith("nproc=")]
    command = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd", f"{COMPONENT}:train"]
    command += ["--nproc", "2", "--python", sys.executable, *(["--env", env] if env else [])]
    command += [*options, f"output_dir={folder}", *words]
    environ = {**os.environ, "PYTHONPATH": PYTHONPATH}
    return subprocess.run(command, cwd=folder, env=environ, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
def test_a_job_killed_under_torchx_resumes_to_the_uninterrupted_weights(tmp_path):
    # Rank 1 SIGKILLs itself during step 6: the job fails; its step-4 checkpoint is complete.
    killed = torchx_train(tmp_path, env="DDPKIT_TEST_SIGNAL_STEP=6,DDPKIT_TEST_SIGNAL=SIGKILL")
    assert killed.returncode != 0, killed.stderr
    assert [m["global_step"] for m in manifests(tmp_path)] == [4], killed.stderr
    again = torchx_train(tmp_path, "resume=auto")
    assert again.returncode == 0, again.stderr
    assert f"resumed from {tmp_path}/checkpoints/step-000000004" in again.stderr, again.stderr
    assert_same_weights(final_weights(tmp_path), reference_weights(), "killed at step 6 under torchx")


@pytest.mark.slow
def test_a_signal_to_ddpkits_launcher_under_torchx_checkpoints_and_exits_75(tmp_path):
    # The scheduler's preemption signal reaches the replica's process: ddpkit's launcher (exec'd by bash).
    env = "DDPKIT_TEST_SIGNAL_STEP=6,DDPKIT_TEST_SIGNAL=SIGTERM,DDPKIT_TEST_SIGNAL_TARGET=parent,DDPKIT_TEST_STEP_SLEEP=0.05"
    stopped = torchx_train(tmp_path, env=env)
    assert stopped.returncode != 0  # torchx's own status for a FAILED app; ddpkit's 75 is the role's
    assert "ddpkit: preempted by SIGTERM: the workers checkpointed and exited 75;" in stopped.stderr, stopped.stderr
    preempted = [m["global_step"] for m in manifests(tmp_path) if m["reason"] == "preempted"]
    assert len(preempted) == 1, stopped.stderr
    again = torchx_train(tmp_path, "resume=auto")
    assert again.returncode == 0, again.stderr
    assert_same_weights(final_weights(tmp_path), reference_weights(), "preempted under torchx")


def test_each_replica_is_one_node_of_a_ddpkit_job_on_the_host_of_replica_0():
    app = component.train("model=cnn", "epochs=3", nnodes=3, nproc=4, gpu=4, master_port=29600)
    (role,) = app.roles
    assert role.num_replicas == 3 and role.resource.gpu == 4 and role.port_map == {"ddpkit": 29600}
    values = macros.Values(img_root="", app_id="app", replica_id="2", rank0_env="TORCHX_RANK0_HOST", base_img_root="")
    line = values.apply(role).args[1]
    assert line == (
        "unset SLURM_STEP_ID SLURM_STEPID; exec python -m ddpkit train nproc=4 nnodes=3 node_rank=2 master_addr=${TORCHX_RANK0_HOST:=localhost} "
        "master_port=29600 model=cnn epochs=3"
    )


def test_run_starts_the_users_script_or_module_under_ddpkit_run():
    app = component.run("--lr", "0.1", script="src/my train.py", nproc=2)
    assert app.name == "my train"
    assert app.roles[0].args == [
        "-c",
        "unset SLURM_STEP_ID SLURM_STEPID; exec python -m ddpkit run nproc=2 'src/my train.py' --lr 0.1",
    ]
    assert component.run(m="pkg.train").roles[0].args == [
        "-c",
        "unset SLURM_STEP_ID SLURM_STEPID; exec python -m ddpkit run nproc=1 -m pkg.train",
    ]
    with pytest.raises(ValueError, match="give exactly one of --script SCRIPT.py and --m MODULE"):
        component.run(script="a.py", m="b")


def test_run_starts_a_users_script_as_two_workers_under_local_cwd(tmp_path):
    script = Path(__file__).parents[1] / "launchers" / "scripts" / "all_reduce.py"
    command = [sys.executable, "-m", "torchx.cli.main", "run", "-s", "local_cwd", f"{COMPONENT}:run"]
    command += ["--nproc", "2", "--python", sys.executable, "--script", str(script), "--", "--flag", "x"]
    out = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rank 0/2 sum=3 argv=['--flag', 'x']" in out.stderr, out.stderr
