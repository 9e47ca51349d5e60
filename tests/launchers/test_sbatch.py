"""sbatch scripts: golden files for launch modes x environments, and validation errors.

To update the golden files after an intended change, run
``DDPKIT_UPDATE_GOLDEN=1 pytest tests/launchers/test_sbatch.py`` and review the diff.
The scripts are run for real on a Slurm cluster in tests/cluster.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from ddpkit.launchers.sbatch import SbatchSpec, render_sbatch

GOLDEN = Path(__file__).parent / "golden"

RESOURCES = dict(
    nodes=2,
    tasks_per_node=4,
    gpus_per_node=4,
    cpus_per_task=8,
    partition="gpu",
    account="proj42",
    qos="normal",
    time="2:00:00",
    project_root="/home/ada/ddp",
)

CASES = {
    "srun_venv": SbatchSpec(**RESOURCES, venv="/home/ada/venv", train_args=("model=mlp", "epochs=5")),
    "srun_apptainer_custom_command": SbatchSpec(
        nodes=1,
        tasks_per_node=2,
        env_mode="apptainer",
        apptainer_image="/images/ddp.sif",
        command=("python", "my_train.py"),
        train_args=("lr=0.1", "name=two words"),
        output="logs/%x-%j.out",
        error="logs/%x-%j.err",
    ),
    "torchrun_modules_preempt_requeue": SbatchSpec(
        **RESOURCES,
        launch_mode="torchrun",
        env_mode="modules",
        modules=("python/3.11", "cuda/12.4"),
        nccl_debug="INFO",
        nccl_debug_subsys="INIT,NET",
        preempt_signal="USR1",
        requeue=True,
        train_args=("model=cnn",),
    ),
    "torchrun_venv_staging_custom_command": SbatchSpec(
        nodes=4,
        tasks_per_node=1,
        cpus_per_task=4,
        launch_mode="torchrun",
        venv="/home/ada/venv",
        stage_data_from="/shared/datasets/fashion-mnist",
        command=("python", "my_train.py"),
        train_args=("epochs=1",),
    ),
    "mpirun_apptainer_gpu_staging": SbatchSpec(
        **RESOURCES,
        launch_mode="mpirun",
        env_mode="apptainer",
        modules=("apptainer",),
        apptainer_image="/images/ddp.sif",
        stage_data_from="/shared/fmnist",
        stage_data_to="$TMPDIR/fmnist",
        nccl_debug="WARN",
        train_args=("model=mlp",),
    ),
    "mpirun_venv_preempt": SbatchSpec(
        nodes=2,
        tasks_per_node=2,
        launch_mode="mpirun",
        venv="/home/ada/venv",
        preempt_signal="USR2",
        preempt_grace_seconds=120,
        time="1-00:00",
        requeue=True,
    ),
    "defaults": SbatchSpec(venv="/home/ada/venv"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_script_matches_golden_file(name):
    script = render_sbatch(CASES[name])
    path = GOLDEN / f"{name}.sbatch"
    if os.environ.get("DDPKIT_UPDATE_GOLDEN"):
        path.write_text(script)
    assert script == path.read_text(), f"{path} differs; see the module docstring to update it"


@pytest.mark.parametrize("name", sorted(CASES))
def test_script_is_valid_bash(name, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(CASES[name]))
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


@pytest.mark.cluster
@pytest.mark.parametrize("name", sorted(CASES))
def test_sbatch_parses_every_directive(name, tmp_path):
    assert shutil.which("sbatch"), "sbatch not found: run scripts/cluster-setup.sh"
    script = tmp_path / "job.sbatch"
    script.write_text(render_sbatch(CASES[name]))
    # sbatch parses the #SBATCH lines, then fails at once to reach this controller
    # (nothing listens on port 1, no retries): that error means every directive parsed.
    conf = tmp_path / "slurm.conf"
    conf.write_text(
        "ClusterName=none\nSlurmctldHost=localhost\nSlurmctldPort=1\nGresTypes=gpu\n"
        "MessageTimeout=1\nTCPTimeout=1\nNodeName=localhost\n"
    )
    env = {"PATH": os.environ["PATH"], "SLURM_CONF": str(conf)}
    result = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert "Unable to contact slurm controller" in result.stderr, result.stderr


def test_directives_follow_the_spec():
    script = render_sbatch(CASES["srun_venv"])
    directives = [line for line in script.splitlines() if line.startswith("#SBATCH")]
    assert directives == [
        "#SBATCH --job-name=ddpkit",
        "#SBATCH --nodes=2",
        "#SBATCH --ntasks-per-node=4",
        "#SBATCH --gpus-per-node=4",
        "#SBATCH --cpus-per-task=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --account=proj42",
        "#SBATCH --qos=normal",
        "#SBATCH --time=2:00:00",
        "#SBATCH --output=ddpkit-%j.out",
        "#SBATCH --chdir=/home/ada/ddp",
    ]


def test_train_args_are_shell_quoted():
    script = render_sbatch(SbatchSpec(venv="/v", train_args=("name=two words", "x=$HOME", "y='q'")))
    assert "python -m ddpkit train 'name=two words' 'x=$HOME' 'y='\"'\"'q'\"'\"''" in script


def test_preemption_uses_the_batch_shell_signal_and_requeues():
    script = render_sbatch(SbatchSpec(venv="/v", preempt_signal="USR1", preempt_grace_seconds=60, requeue=True))
    assert "#SBATCH --signal=B:USR1@60" in script
    assert "trap on_preempt USR1" in script
    assert 'scontrol requeue "$SLURM_JOB_ID"' in script


def test_preemption_without_requeue_does_not_requeue():
    script = render_sbatch(SbatchSpec(venv="/v", preempt_signal="USR1"))
    assert "--requeue" not in script and "scontrol requeue" not in script


def test_apptainer_adds_nv_only_with_gpus():
    cpu = render_sbatch(SbatchSpec(env_mode="apptainer", apptainer_image="/i.sif"))
    gpu = render_sbatch(SbatchSpec(env_mode="apptainer", apptainer_image="/i.sif", gpus_per_node=1, project_root="/p"))
    assert 'apptainer exec -B "$SLURM_SUBMIT_DIR" /i.sif python -m ddpkit train' in cpu
    assert "apptainer exec --nv -B /p /i.sif python -m ddpkit train" in gpu


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(nodes=0), "nodes=0 must be an integer >= 1"),
        (dict(tasks_per_node=-1), "tasks_per_node=-1 must be an integer >= 1"),
        (dict(gpus_per_node=-2), "gpus_per_node=-2 must be an integer >= 0"),
        (dict(launch_mode="pdsh"), "launch_mode='pdsh' is unknown; choose one of: srun, torchrun, mpirun"),
        (dict(env_mode="conda"), "env_mode='conda' is unknown; choose one of: venv, modules, apptainer"),
        (dict(time="2h"), "time='2h' is not a Slurm time limit; use minutes, minutes:seconds"),
        (dict(time="1:2:3:4"), "time='1:2:3:4' is not a Slurm time limit"),
        (dict(time="1:75:00"), "time='1:75:00' has a field out of range"),
        (dict(time="1-30"), "time='1-30' has a field out of range"),
        (dict(time="0"), "time='0' is zero"),
        (dict(partition="gpu a100"), "partition='gpu a100' contains whitespace or quotes"),
        (dict(output='out"%j'), "output='out\"%j' contains whitespace or quotes"),
        (dict(job_name=""), "job_name is empty"),
        (dict(venv=""), "env_mode='venv' needs venv, the virtual environment directory"),
        (dict(env_mode="modules", venv=""), "env_mode='modules' needs at least one module"),
        (dict(env_mode="apptainer", venv=""), "env_mode='apptainer' needs apptainer_image"),
        (dict(env_mode="apptainer", apptainer_image="/i.sif"), "venv is not used with env_mode='apptainer'"),
        (dict(apptainer_image="/i.sif"), "apptainer_image is set but env_mode='venv'"),
        (dict(nccl_debug="LOUD"), "nccl_debug='LOUD' is unknown; choose one of: VERSION, WARN, INFO, TRACE"),
        (dict(nccl_debug_subsys="INIT NET"), "nccl_debug_subsys='INIT NET' is not a comma-separated list"),
        (dict(stage_data_from="data"), "stage_data_from='data' must be an absolute path"),
        (dict(stage_data_from="/d", stage_data_to="/tmp/$(rm -rf ~)"), "stage_data_to='/tmp/$(rm -rf ~)' must be"),
        (dict(stage_data_from="/d", stage_data_key="data root"), "stage_data_key='data root' is not a config key"),
        (dict(preempt_signal="SIGUSR1"), "preempt_signal='SIGUSR1' is not a signal name a shell can trap"),
        (dict(preempt_signal="KILL"), "preempt_signal='KILL' is not a signal name a shell can trap"),
        (dict(preempt_signal="USR1", time="1"), "preempt_grace_seconds=90 is not shorter than time='1'"),
        (dict(preempt_grace_seconds=0), "preempt_grace_seconds=0 must be an integer in 1..65535"),
        (dict(train_args=["epochs=1"]), "train_args=['epochs=1'] must be a tuple of strings"),
        (dict(python=""), "python is empty"),
    ],
)
def test_invalid_spec_names_the_field_and_the_fix(fields, message):
    with pytest.raises(ValueError) as excinfo:
        SbatchSpec(**{"venv": "/v", **fields})
    text = str(excinfo.value)
    assert text.startswith(message)
    assert "\n" not in text


@pytest.mark.parametrize(
    "time, seconds_ok",
    [("90", True), ("1:30", True), ("2:00:00", True), ("1-0", True), ("1-12:30", True), ("3-00:00:01", True)],
)
def test_every_slurm_time_format_is_accepted(time, seconds_ok):
    assert f"#SBATCH --time={time}" in render_sbatch(SbatchSpec(venv="/v", time=time))
