"""``ddpkit train`` as a SageMaker entry point, started as the toolkit starts it: ``python train.py --key value ...``.

The job's /opt/ml is a temporary folder (SAGEMAKER_BASE_DIR); the variables
and arguments are those the real sagemaker-training toolkit computes for it
(tests/env/test_sagemaker.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpkit.checkpoint.publishing.export import load_exported
from ddpkit.commands.dispatch import main
from ddpkit.env.ports import free_port
from tests.cli_runner import PYTHONPATH
from tests.env.test_sagemaker import toolkit_environment, write_job

ENTRY_POINT = """\
import sys

import ddpkit.commands.dispatch

if __name__ == "__main__":  # the workers ddpkit starts import this file again
    sys.argv[1:1] = ["train"]  # SageMaker runs: python train.py --epochs 5 --lr 0.01 ...
    ddpkit.commands.dispatch.run()
"""
"""The entry_point script of the README's estimator."""
HYPERPARAMETERS = {
    "model": "mlp",
    "dataset": "synthetic",
    "synthetic_samples": 256,
    "batch_size": 64,
    "epochs": 1,
    "progress": False,
}
STEPS_PER_EPOCH = 256 // 64

pytestmark = pytest.mark.slow  # each test starts ddpkit (and torch) in fresh processes


def start_entry_point(base: Path, environ: dict[str, str], args: list[str]) -> subprocess.Popen:
    """Start the entry point in the job's code folder, as the toolkit does, with these variables."""
    code = base / "code"
    code.mkdir(exist_ok=True)
    (code / "train.py").write_text(ENTRY_POINT)
    return subprocess.Popen(
        [sys.executable, "train.py", *args],
        cwd=code,
        text=True,
        env={**environ, "PYTHONPATH": PYTHONPATH, "OMP_NUM_THREADS": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def run_entry_point(base: Path, environ: dict[str, str], args: list[str]) -> str:
    """Run the entry point to its end; its output. Fails the test on a non-zero exit."""
    process = start_entry_point(base, environ, args)
    try:
        output, _ = process.communicate(timeout=240)
    finally:
        process.kill()
    assert process.returncode == 0, output
    return output


def test_trains_into_sagemakers_folders_and_resumes_from_the_checkpoints(tmp_path):
    base = write_job(tmp_path, ["algo-1"], "algo-1", HYPERPARAMETERS)
    environ, args = toolkit_environment(base)
    assert "--epochs" in args  # the hyperparameters arrive as --key value

    output = run_entry_point(base, environ, args)
    checkpoints = _checkpoint_names(base / "checkpoints")
    assert checkpoints, output  # /opt/ml/checkpoints: what SageMaker syncs to checkpoint_s3_uri
    summary = json.loads((base / "output/data/summary.json").read_text())
    assert summary["global_steps"] == STEPS_PER_EPOCH and summary["config"]["data_dir"] == str(
        base / "input/data/training"
    )
    assert (base / "output/data/metrics.jsonl").is_file()
    model, info = load_exported(base / "model")  # SM_MODEL_DIR, uploaded as model.tar.gz
    assert info["source"]["global_step"] == STEPS_PER_EPOCH and info["model"]["name"] == "mlp"

    # A restarted job (managed spot) finds its checkpoints back; here it also trains one epoch more.
    output = run_entry_point(base, environ, args + ["--epochs", "2"])
    assert "resumed from" in output and f"global step {STEPS_PER_EPOCH}" in output, output
    summary = json.loads((base / "output/data/summary.json").read_text())
    assert summary["global_steps"] == 2 * STEPS_PER_EPOCH
    _, info = load_exported(base / "model")
    assert info["source"]["global_step"] == 2 * STEPS_PER_EPOCH


def test_one_worker_per_gpu_and_the_export_is_of_the_last_step_when_no_checkpoint_has_it(tmp_path):
    # The toolkit counts this machine's GPUs (none): the count is raised to 2, and the two
    # workers that `ddpkit train` starts for them run on the CPU.
    # No epoch-end nor best checkpoints: the export writes a checkpoint of the final step first.
    hyperparameters = {**HYPERPARAMETERS, "checkpoint.on_epoch_end": False, "checkpoint.best_metric": ""}
    base = write_job(tmp_path, ["algo-1"], "algo-1", hyperparameters)
    environ, args = toolkit_environment(base)
    output = run_entry_point(base, {**environ, "SM_NUM_GPUS": "2"}, args)
    summary = json.loads((base / "output/data/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == STEPS_PER_EPOCH, output
    assert _checkpoint_names(base / "checkpoints") == [f"step-{STEPS_PER_EPOCH:09d}"], output
    _, info = load_exported(base / "model")
    assert info["source"]["global_step"] == STEPS_PER_EPOCH


def test_a_bad_hyperparameter_is_one_line(tmp_path, monkeypatch, capsys):
    base = write_job(tmp_path, ["algo-1"], "algo-1", {**HYPERPARAMETERS, "epoch": 3})
    environ, args = toolkit_environment(base)
    # In this process, with the job's variables alone, in its code folder: what the entry point runs
    # (`ddpkit train` with the toolkit's arguments); the tests above start it, tests/test_cli.py checks
    # the command's exit path.
    for name in list(os.environ):
        monkeypatch.delenv(name)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    (base / "code").mkdir(exist_ok=True)
    monkeypatch.chdir(base / "code")
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("error: unknown config key 'epoch' (did you mean 'epochs'?)"), err


_TOOLKIT_TORCHRUN = """
import json
from sagemaker_training import environment, torch_distributed
env = environment.Environment()
runner = torch_distributed.TorchDistributedRunner(
    "train.py", env.to_cmd_args(), env.to_env_vars(), 2, env.master_hostname, env.hosts, env.current_host,
    env.network_interface_name)
print(json.dumps(runner._create_command()))
"""


def test_under_the_toolkits_torchrun(tmp_path):
    # distribution={"torch_distributed": {"enabled": True}} on a host of 2 GPUs: the toolkit's own
    # torchrun command (torchrun --nnodes 1 --nproc_per_node 2 train.py --key value ...), run here
    # on the CPU, with a free port for its rendezvous (PET_MASTER_PORT is torchrun's --master_port).
    base = write_job(tmp_path, ["algo-1"], "algo-1", HYPERPARAMETERS)
    environ, _ = toolkit_environment(base)  # its import made the code folder
    (base / "code" / "train.py").write_text(ENTRY_POINT)
    made = subprocess.run(
        [sys.executable, "-c", _TOOLKIT_TORCHRUN], env=environ, capture_output=True, text=True, timeout=120
    )
    assert made.returncode == 0, made.stderr
    command = json.loads(made.stdout.strip().splitlines()[-1])
    assert command[:5] == ["torchrun", "--nnodes", "1", "--nproc_per_node", "2"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", *command[1:]]
    environ = {
        **environ,
        "SM_NUM_GPUS": "2",
        "PET_MASTER_PORT": str(free_port()),
        "PYTHONPATH": PYTHONPATH,
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(torchrun, cwd=base / "code", env=environ, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "torchrun: world_size 2" in done.stdout + done.stderr
    summary = json.loads((base / "output/data/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == STEPS_PER_EPOCH
    _, info = load_exported(base / "model")
    assert info["source"]["global_step"] == STEPS_PER_EPOCH


def test_two_hosts_one_process_each(tmp_path):
    # Two containers of one job on this machine: each host has its own /opt/ml, and the
    # host names are loopback names so that the first host, the master, is reachable.
    hosts = ["127.0.0.1", "localhost"]
    port = str(free_port())
    jobs = []
    for host in hosts:
        base = write_job(tmp_path / host, hosts, host, HYPERPARAMETERS)
        environ, args = toolkit_environment(base)
        jobs.append((base, {**environ, "MASTER_PORT": port}, args))
    processes = [start_entry_point(*job) for job in jobs]
    try:
        outputs = [p.communicate(timeout=240)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert [p.returncode for p in processes] == [0, 0], outputs
    first, second = (job[0] for job in jobs)
    assert "sagemaker: world_size 2 on 2 node(s), master 127.0.0.1" in outputs[0]
    summary = json.loads((first / "output/data/summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_steps"] == STEPS_PER_EPOCH
    load_exported(first / "model")  # rank 0's host exports; the other's model folder stays empty
    assert not any((second / "model").iterdir())


def _checkpoint_names(folder: Path) -> list[str]:
    """The checkpoint folders of ``folder`` (the run's lock files, .ddpkit.lock*, aside)."""
    return sorted(p.name for p in folder.iterdir() if not p.name.startswith(".ddpkit.lock"))
