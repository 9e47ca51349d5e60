"""SageMaker training jobs: ddpkit reads what the real sagemaker-training toolkit hands an entry point.

Each job is the /opt/ml layout SageMaker writes (resourceconfig.json,
hyperparameters.json, inputdataconfig.json) under a temporary folder, which
the toolkit reads through SAGEMAKER_BASE_DIR; the toolkit's
``Environment().to_env_vars()`` and ``to_cmd_args()``, computed in a process
of their own (the toolkit reads the folder when imported), are the entry
point's variables and arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from ddpkit.env.base import InconsistentEnvironment
from ddpkit.env.detect import detect_environment
from ddpkit.env.ports import port_from_job_id
from ddpkit.env.sagemaker import SageMakerJob, key_value_words, model_dir, train_words, with_master_addr

JOB_NAME = "ddpkit-sm-2026-11-24-07-00-00-000"
HYPERPARAMETERS = {"model": "mlp", "epochs": 1, "lr": 0.01, "checkpoint.every_steps": 2, "eval_train": False}
"""As the estimator's hyperparameters={...}: flat keys, dotted for nested config fields."""
SDK_HYPERPARAMETERS = {
    "sagemaker_program": "train.py",
    "sagemaker_submit_directory": "s3://bucket/ddpkit-sm/source/sourcedir.tar.gz",
    "sagemaker_region": "us-east-1",
    "sagemaker_job_name": JOB_NAME,
}
"""What the SageMaker Python SDK adds to every job's hyperparameters."""

_TOOLKIT = """
import json
from sagemaker_training import environment
env = environment.Environment()
print(json.dumps({"env": env.to_env_vars(), "args": env.to_cmd_args()}))
"""


def write_job(
    root: Path,
    hosts: list[str],
    current_host: str,
    hyperparameters: Mapping[str, Any],
    channels: tuple[str, ...] = ("training", "test"),
) -> Path:
    """Write SageMaker's /opt/ml layout for one host under root; returns the base folder (root/opt/ml)."""
    base = root / "opt" / "ml"
    config = base / "input" / "config"
    config.mkdir(parents=True)
    for name in channels:
        (base / "input" / "data" / name).mkdir(parents=True)
    (base / "model").mkdir()
    (base / "output" / "data").mkdir(parents=True)
    resources = {
        "current_host": current_host,
        "current_instance_type": "ml.c5.xlarge",
        "current_group_name": "homogeneousCluster",
        "hosts": hosts,
        "instance_groups": [
            {"instance_group_name": "homogeneousCluster", "instance_type": "ml.c5.xlarge", "hosts": hosts}
        ],
        "network_interface_name": "eth0",
    }
    (config / "resourceconfig.json").write_text(json.dumps(resources))
    # SageMaker stores every hyperparameter as a JSON-encoded string.
    encoded = {k: json.dumps(v) for k, v in {**hyperparameters, **SDK_HYPERPARAMETERS}.items()}
    (config / "hyperparameters.json").write_text(json.dumps(encoded))
    data_config = {
        name: {"TrainingInputMode": "File", "S3DistributionType": "FullyReplicated", "RecordWrapperType": "None"}
        for name in channels
    }
    (config / "inputdataconfig.json").write_text(json.dumps(data_config))
    return base


def toolkit_environment(base: Path) -> tuple[dict[str, str], list[str]]:
    """The variables and arguments the sagemaker-training toolkit hands the entry point of the job at base."""
    environ = {
        "PATH": os.environ["PATH"],
        "HOME": str(base),
        "SAGEMAKER_BASE_DIR": str(base),
        "TRAINING_JOB_NAME": JOB_NAME,
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    done = subprocess.run([sys.executable, "-c", _TOOLKIT], env=environ, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    handed = json.loads(done.stdout.strip().splitlines()[-1])
    return {**environ, **handed["env"]}, [str(a) for a in handed["args"]]


@pytest.fixture(scope="module")
def two_hosts(tmp_path_factory) -> dict[str, tuple[dict[str, str], list[str]]]:
    """The toolkit's variables and arguments on each host of a two-host job, by host."""
    hosts = ["algo-1", "algo-2"]
    return {
        host: toolkit_environment(write_job(tmp_path_factory.mktemp(host), hosts, host, HYPERPARAMETERS))
        for host in hosts
    }


def test_reads_what_the_toolkit_hands_over(two_hosts):
    environ, _ = two_hosts["algo-2"]
    base = Path(environ["SAGEMAKER_BASE_DIR"])
    job = SageMakerJob.from_env(environ)
    assert job.hosts == ("algo-1", "algo-2") and job.current_host == "algo-2"
    assert job.node_rank == 1 and job.master_host == "algo-1"
    assert job.channels == {"training": str(base / "input/data/training"), "test": str(base / "input/data/test")}
    assert job.training_channel == environ["SM_CHANNEL_TRAINING"]
    assert job.model_dir == environ["SM_MODEL_DIR"] == str(base / "model")
    assert job.output_data_dir == environ["SM_OUTPUT_DATA_DIR"] == str(base / "output/data")
    assert job.hyperparameters == HYPERPARAMETERS  # decoded, without the SDK's sagemaker_* ones
    assert (job.num_gpus, job.num_cpus) == (int(environ["SM_NUM_GPUS"]), int(environ["SM_NUM_CPUS"]))
    assert job.job_name == JOB_NAME
    assert job.checkpoint_dir == str(base / "checkpoints")


def test_job_name_from_the_training_env_alone(two_hosts):
    environ, _ = two_hosts["algo-1"]
    without = {k: v for k, v in environ.items() if k != "TRAINING_JOB_NAME"}
    assert SageMakerJob.from_env(without).job_name == JOB_NAME  # SM_TRAINING_ENV's job_name


def test_files_alone_give_the_same_job(two_hosts):
    # A container without the toolkit has the files, not the variables.
    environ, _ = two_hosts["algo-2"]
    files_only = {k: environ[k] for k in ("SAGEMAKER_BASE_DIR", "TRAINING_JOB_NAME")}
    from_files = SageMakerJob.from_env(files_only)
    from_variables = SageMakerJob.from_env(environ)
    # The toolkit counts GPUs with nvidia-smi, the files reader by device files: both 0 on this machine.
    assert from_files == from_variables


@pytest.mark.parametrize(("host", "rank"), [("algo-1", 0), ("algo-2", 1)])
def test_one_process_per_host_is_a_worker(two_hosts, host, rank):
    environ, _ = two_hosts[host]
    env = detect_environment(environ)
    assert env.source == "sagemaker"
    assert (env.rank, env.world_size, env.local_rank, env.local_world_size) == (rank, 2, 0, 1)
    assert (env.node_rank, env.num_nodes) == (rank, 2)
    assert (env.master_addr, env.master_port) == ("algo-1", port_from_job_id(JOB_NAME))
    assert detect_environment({**environ, "MASTER_PORT": "7777"}).master_port == 7777


def test_several_gpus_per_host_need_a_launcher(two_hosts):
    environ, _ = two_hosts["algo-1"]
    with pytest.raises(InconsistentEnvironment, match="8 GPUs.*torch_distributed"):
        detect_environment({**environ, "SM_NUM_GPUS": "8"})


def test_the_toolkits_torchrun_wins(two_hosts):
    # distribution={"torch_distributed": ...}: torchrun --nnodes 2 --nproc_per_node 4 --node_rank 1 ...
    environ, _ = two_hosts["algo-2"]
    torchrun = {
        "RANK": "6",
        "WORLD_SIZE": "8",
        "LOCAL_RANK": "2",
        "LOCAL_WORLD_SIZE": "4",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "MASTER_ADDR": "algo-1",
        "MASTER_PORT": "7777",
    }
    env = detect_environment({**environ, "SM_NUM_GPUS": "4", **torchrun})
    assert (env.source, env.rank, env.node_rank, env.master_addr) == ("torchrun", 6, 1, "algo-1")


def test_the_toolkits_mpirun_wins_with_the_first_host_as_master(two_hosts):
    # distribution={"mpi": {"enabled": True, "processes_per_host": 2}}: mpirun on algo-1 exports its
    # own SM_* variables (SM_CURRENT_HOST=algo-1) to every rank, rank 3 runs on algo-2.
    environ, _ = two_hosts["algo-1"]
    ompi = {
        "OMPI_COMM_WORLD_RANK": "3",
        "OMPI_COMM_WORLD_SIZE": "4",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
        "OMPI_MCA_orte_num_nodes": "2",
        "PMIX_NAMESPACE": "prterun-algo-1-7@1",
    }
    env = detect_environment({**environ, **ompi})
    assert (env.source, env.rank, env.node_rank, env.num_nodes) == ("openmpi", 3, 1, 2)
    assert env.master_addr == "algo-1"
    assert detect_environment({**environ, **ompi, "MASTER_ADDR": "10.0.0.5"}).master_addr == "10.0.0.5"


def test_one_host_is_a_local_machine(tmp_path):
    environ, _ = toolkit_environment(write_job(tmp_path, ["algo-1"], "algo-1", HYPERPARAMETERS))
    assert detect_environment(environ).source == "local"
    assert with_master_addr(environ) is environ
    assert "nproc=4" in train_words({**environ, "SM_NUM_GPUS": "4"})  # one worker per GPU, started here


def test_train_words(two_hosts):
    environ, _ = two_hosts["algo-1"]
    base = Path(environ["SAGEMAKER_BASE_DIR"])
    assert train_words(environ) == [
        f"output_dir={base / 'output/data'}",
        f"checkpoint.dir={base / 'checkpoints'}",
        "resume=auto",
        f"data_dir={base / 'input/data/training'}",
        "checkpoint.every_steps=2",
        "epochs=1",
        "eval_train=false",
        "lr=0.01",
        "model=mlp",
    ]
    assert model_dir(environ) == str(base / "model")


def test_empty_hyperparameters_stay_empty_strings(tmp_path):
    from ddpkit.train.config import parse_train_config

    environ, args = toolkit_environment(write_job(tmp_path, ["algo-1"], "algo-1", {"checkpoint.best_metric": ""}))
    assert parse_train_config(train_words(environ)).checkpoint.best_metric == ""
    assert parse_train_config(key_value_words(environ, args)).checkpoint.best_metric == ""


def test_the_only_channel_is_the_data(tmp_path):
    environ, _ = toolkit_environment(write_job(tmp_path / "a", ["algo-1"], "algo-1", {}, channels=("images",)))
    assert f"data_dir={tmp_path / 'a/opt/ml/input/data/images'}" in train_words(environ)
    environ, _ = toolkit_environment(write_job(tmp_path / "b", ["algo-1"], "algo-1", {}, channels=("x", "y")))
    assert not [w for w in train_words(environ) if w.startswith("data_dir=")]  # which one: the user says


def test_the_entry_points_arguments_become_words(two_hosts):
    environ, args = two_hosts["algo-1"]
    assert args[:2] == ["--checkpoint.every_steps", "2"]  # as the toolkit passes them
    words = key_value_words(environ, args + ["--batch_size=32", "seed=3", "--checkpoint.best_metric", ""])
    assert words == [
        "checkpoint.every_steps=2",
        "epochs=1",
        "eval_train=False",
        "lr=0.01",
        "model=mlp",
        "batch_size=32",
        "seed=3",
        "checkpoint.best_metric=",
    ]  # '': "" as OmegaConf reads it
    with pytest.raises(ValueError, match="--epochs has no value"):
        key_value_words(environ, ["--epochs", "--lr", "0.1"])


def test_outside_sagemaker_nothing_changes(tmp_path):
    environ = {"SAGEMAKER_BASE_DIR": str(tmp_path)}  # no resourceconfig.json there
    assert train_words(environ) == [] and model_dir(environ) == ""
    assert key_value_words(environ, ["--epochs", "1"]) == ["--epochs", "1"]  # left for the config's error
    assert detect_environment(environ).source == "local"


def test_malformed_hosts_name_the_variable(two_hosts):
    environ, _ = two_hosts["algo-1"]
    with pytest.raises(InconsistentEnvironment, match="SM_HOSTS"):
        SageMakerJob.from_env({**environ, "SM_HOSTS": "algo-1"})
    with pytest.raises(InconsistentEnvironment, match="'algo-9' is not among"):
        SageMakerJob.from_env({**environ, "SM_CURRENT_HOST": "algo-9"})
