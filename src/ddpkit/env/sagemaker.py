"""Inside a SageMaker training job: the hosts, channels, folders and hyperparameters the job hands over.

SageMaker starts the training container on every host of the job with the
job's description under /opt/ml (``SAGEMAKER_BASE_DIR`` outside SageMaker, as
the sagemaker-training toolkit reads it)::

    /opt/ml/input/config/resourceconfig.json   current_host, hosts
    /opt/ml/input/config/hyperparameters.json  the estimator's hyperparameters (JSON-encoded strings)
    /opt/ml/input/config/inputdataconfig.json  the input channels: /opt/ml/input/data/<channel>
    /opt/ml/model                              uploaded to S3 as model.tar.gz at the end
    /opt/ml/output/data                        uploaded to S3 as output.tar.gz
    /opt/ml/checkpoints                        checkpoint_local_path: synced with checkpoint_s3_uri

The toolkit, in every SageMaker framework container, turns these into the
variables of the entry point, read here first: SM_HOSTS and SM_CHANNELS (JSON
lists), SM_CURRENT_HOST, SM_NUM_GPUS, SM_NUM_CPUS, SM_CHANNEL_<NAME>,
SM_MODEL_DIR, SM_OUTPUT_DATA_DIR, SM_HPS (JSON object) and SM_TRAINING_ENV
(all of it as JSON, with the job name). A container without the toolkit has
only the files, read when SM_CURRENT_HOST is unset.

As an environment source (see detect.py), a job of several hosts where
SageMaker started the entry point once per host, with no launcher inside:

- node_rank is the index of SM_CURRENT_HOST in SM_HOSTS, num_nodes its
  length. SageMaker writes the hosts sorted (algo-1, algo-2, ...); the list is
  taken in its given order, as the toolkit does for its torchrun
  (``--node_rank hosts.index(current_host)``) and its mpirun (``--host`` in
  that order, rank 0 on the first host), so ddpkit agrees with both.
- master_addr is the first host (the toolkit's ``master_hostname``),
  master_port MASTER_PORT, else derived from the job name
  (TRAINING_JOB_NAME, else SM_TRAINING_ENV's job_name; ports.port_from_job_id).
- workers per host are the host's GPUs, or 1 without GPUs. One process per
  host is one worker: with several GPUs the estimator must start one process
  per GPU (``distribution={"torch_distributed": {"enabled": True}}``), or
  its workers are torchrun's or mpirun's, detected before this source.

A job of one host is not a cluster: the local source and ``ddpkit train``'s
``nproc`` (one worker per GPU, see train_words) serve it.
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddpkit.deprecation import renamed
from ddpkit.env._vars import parse_port
from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.ports import port_from_job_id

BASE_DIR_VARIABLE = "SAGEMAKER_BASE_DIR"
"""The toolkit's variable naming the folder that stands for /opt/ml outside SageMaker."""
DEFAULT_BASE_DIR = "/opt/ml"
TRAINING_CHANNEL = "training"
"""The channel whose folder becomes ``data_dir`` (``estimator.fit({"training": "s3://..."})``)."""

_DISTRIBUTE = "pass distribution={'torch_distributed': {'enabled': True}} to the estimator"


@dataclass(frozen=True)
class SageMakerJob:
    """What a SageMaker training job tells the process on one of its hosts."""

    hosts: tuple[str, ...]
    """Container host names of the job, in SageMaker's (sorted) order: ("algo-1", "algo-2")."""
    current_host: str
    """This container's host name, one of hosts."""
    num_gpus: int
    """GPUs of this host."""
    num_cpus: int
    """CPUs of this host."""
    channels: Mapping[str, str] = field(hash=False)
    """Input channel name -> the folder holding its data."""
    model_dir: str
    """Folder whose content SageMaker uploads as the model (SM_MODEL_DIR)."""
    output_data_dir: str
    """Folder whose content SageMaker uploads as output.tar.gz (SM_OUTPUT_DATA_DIR)."""
    hyperparameters: Mapping[str, Any] = field(hash=False)
    """The estimator's hyperparameters, JSON-decoded (SM_HPS), without SageMaker's own sagemaker_* ones."""
    job_name: str
    """The training job's name; "" when unknown."""
    base_dir: str
    """The /opt/ml folder (SAGEMAKER_BASE_DIR outside SageMaker)."""

    @property
    def node_rank(self) -> int:
        """Index of current_host in hosts."""
        return self.hosts.index(self.current_host)

    @property
    def master_host(self) -> str:
        """The first host: where the toolkit's torchrun and mpirun put rank 0."""
        return self.hosts[0]

    @property
    def workers_per_host(self) -> int:
        """One worker per GPU, or 1 on a host without GPUs."""
        return max(self.num_gpus, 1)

    @property
    def checkpoint_dir(self) -> str:
        """<base_dir>/checkpoints: the estimator's checkpoint_local_path default, synced to checkpoint_s3_uri."""
        return str(Path(self.base_dir) / "checkpoints")

    @property
    def training_channel(self) -> str | None:
        """The folder of the "training" channel, else of the only channel; None otherwise."""
        if TRAINING_CHANNEL in self.channels:
            return self.channels[TRAINING_CHANNEL]
        if len(self.channels) == 1:
            return next(iter(self.channels.values()))
        return None

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> SageMakerJob:
        """Read the job from the toolkit's SM_* variables, else from the files under /opt/ml.

        Args:
            environ: The process environment, e.g. os.environ.

        Raises:
            InconsistentEnvironment: a variable or file is missing or malformed,
                or the current host is not among the hosts.
        """
        job = _from_variables(environ) if "SM_CURRENT_HOST" in environ else _from_files(environ)
        if job.current_host not in job.hosts:
            raise InconsistentEnvironment(
                f"current host {job.current_host!r} is not among the job's hosts {list(job.hosts)}; "
                "run inside a SageMaker training job, or fix resourceconfig.json"
            )
        return job


def base_dir(environ: Mapping[str, str]) -> Path:
    """The /opt/ml folder: SAGEMAKER_BASE_DIR when set (the toolkit's rule), else /opt/ml."""
    return Path(environ.get(BASE_DIR_VARIABLE, DEFAULT_BASE_DIR))


def in_sagemaker(environ: Mapping[str, str]) -> bool:
    """True inside a SageMaker training job: SM_CURRENT_HOST is set, or resourceconfig.json exists."""
    return "SM_CURRENT_HOST" in environ or _config_file(environ, "resourceconfig.json").is_file()


class SageMakerVariables:
    """A SageMaker job of several hosts, one process per host (no launcher inside the container)."""

    name = "sagemaker"

    @staticmethod
    def detect(environ: Mapping[str, str]) -> bool:
        """True inside a SageMaker training job of more than one host."""
        return in_sagemaker(environ) and len(SageMakerJob.from_env(environ).hosts) > 1

    @staticmethod
    def from_env(environ: Mapping[str, str]) -> JobEnvironment:
        """Resolve this host's process as worker node_rank of one worker per host.

        Args:
            environ: The process environment, e.g. os.environ.

        Returns:
            The resolved environment, source "sagemaker".

        Raises:
            InconsistentEnvironment: the job's description is malformed, the
                host has several GPUs for its one process, or neither
                MASTER_PORT nor the job name is there to give the port.
        """
        job = SageMakerJob.from_env(environ)
        if job.workers_per_host > 1:
            raise InconsistentEnvironment(
                f"this host has {job.num_gpus} GPUs but SageMaker started one process on it; "
                f"start one per GPU: {_DISTRIBUTE}"
            )
        port = parse_port(environ)
        if port is None:
            if not job.job_name:
                raise InconsistentEnvironment(
                    "MASTER_PORT is unset and neither TRAINING_JOB_NAME nor SM_TRAINING_ENV names the job to "
                    "derive it from; pass MASTER_PORT in the estimator's environment={...}"
                )
            port = port_from_job_id(job.job_name)
        return JobEnvironment(
            source=SageMakerVariables.name,
            rank=job.node_rank,
            local_rank=0,
            world_size=len(job.hosts),
            local_world_size=1,
            node_rank=job.node_rank,
            num_nodes=len(job.hosts),
            master_addr=job.master_host,
            master_port=port,
        )


def with_master_addr(environ: Mapping[str, str]) -> Mapping[str, str]:
    """environ, plus MASTER_ADDR = the first host when inside a SageMaker job of several hosts without it.

    The toolkit's mpirun (distribution ``mpi`` / ``pytorchddp``) places rank 0
    on the first host but exports no MASTER_ADDR, which OpenMPI's ranks need
    across hosts. Its -x also hands every rank the master's SM_CURRENT_HOST,
    so node ranks come from mpirun, never from SM_CURRENT_HOST, there.
    """
    if "MASTER_ADDR" in environ or not in_sagemaker(environ):
        return environ
    job = SageMakerJob.from_env(environ)
    if len(job.hosts) == 1:
        return environ
    return {**environ, "MASTER_ADDR": job.master_host}


def train_words(environ: Mapping[str, str]) -> list[str]:
    """The key=value words ``ddpkit train`` presets inside a SageMaker job; [] elsewhere.

    In order (later words win, and the command line's words follow them all):
    ``output_dir`` = SM_OUTPUT_DATA_DIR (metrics and summary uploaded with the
    output), ``checkpoint.dir`` = <base>/checkpoints and ``resume=auto`` (a
    managed-spot restart continues from the checkpoints SageMaker downloaded
    back), ``data_dir`` = the training channel, ``nproc`` = the GPUs of a
    one-host job, then every hyperparameter as ``key=value`` (nested objects
    as dotted keys).
    """
    if not in_sagemaker(environ):
        return []
    job = SageMakerJob.from_env(environ)
    words = [f"output_dir={job.output_data_dir}", f"checkpoint.dir={job.checkpoint_dir}", "resume=auto"]
    if job.training_channel is not None:
        words.append(f"data_dir={job.training_channel}")
    if len(job.hosts) == 1 and job.workers_per_host > 1:
        words.append(f"nproc={job.workers_per_host}")
    return words + [f"{key}={_word_value(value)}" for key, value in _flatten(job.hyperparameters)]


def model_dir(environ: Mapping[str, str]) -> str:
    """The folder the trained model is exported to inside a SageMaker job (SM_MODEL_DIR); "" elsewhere."""
    return SageMakerJob.from_env(environ).model_dir if in_sagemaker(environ) else ""


def key_value_words(environ: Mapping[str, str], args: Sequence[str]) -> list[str]:
    """args with SageMaker's ``--key value`` (and ``--key=value``) arguments as key=value words.

    SageMaker passes the hyperparameters to the entry point that way; outside
    a SageMaker job args are returned unchanged (``--key`` stays an error there).

    Raises:
        ValueError: a ``--key`` without a value.
    """
    if not in_sagemaker(environ):
        return list(args)
    words, rest = [], list(args)
    while rest:
        word = rest.pop(0)
        if not word.startswith("-") or word in ("-", "--"):
            words.append(word)
            continue
        key = word.lstrip("-")
        if "=" in key:
            words.append(key)
        elif rest and not rest[0].startswith("--"):
            words.append(f"{key}={_word_value(rest.pop(0))}")
        else:
            raise ValueError(f"{word} has no value; write it as {word} VALUE or {key}=VALUE")
    return words


def _flatten(values: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    items: list[tuple[str, Any]] = []
    for key, value in sorted(values.items()):
        if isinstance(value, Mapping):
            items += _flatten(value, f"{prefix}{key}.")
        else:
            items.append((prefix + key, value))
    return items


def _word_value(value: Any) -> str:
    # Strings stay as they are ("key=" is the empty text, as on the command line: values are read by the
    # option's type, not as YAML); the rest in JSON: true, 0.1, and lists written a,b as the command line does.
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        return ",".join(_word_value(item) for item in value)
    return json.dumps(value)


def _config_file(environ: Mapping[str, str], name: str) -> Path:
    return base_dir(environ) / "input" / "config" / name


def _json(text: str, name: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as e:
        raise InconsistentEnvironment(f"{name} is not valid JSON ({e}); run inside a SageMaker training job") from None


def _int(environ: Mapping[str, str], name: str) -> int:
    value = environ.get(name, "0")
    if not value.isdecimal():
        raise InconsistentEnvironment(f"{name}={value!r} is not a count; run inside a SageMaker training job")
    return int(value)


def _user_hyperparameters(hyperparameters: Mapping[str, Any]) -> dict[str, Any]:
    # sagemaker_program, sagemaker_submit_directory, sagemaker_region, ... are the SDK's own.
    return {k: v for k, v in hyperparameters.items() if not k.startswith("sagemaker_")}


def _from_variables(environ: Mapping[str, str]) -> SageMakerJob:
    training_env = _json(environ.get("SM_TRAINING_ENV", "{}"), "SM_TRAINING_ENV")
    names = _json(environ.get("SM_CHANNELS", "[]"), "SM_CHANNELS")
    hosts = _json(environ.get("SM_HOSTS", "[]"), "SM_HOSTS")
    if not isinstance(hosts, list) or not hosts:
        raise InconsistentEnvironment(
            f"SM_HOSTS={environ.get('SM_HOSTS')!r} is not a JSON list of hosts; run inside a SageMaker training job"
        )
    base = base_dir(environ)
    return SageMakerJob(
        hosts=tuple(str(h) for h in hosts),
        current_host=environ["SM_CURRENT_HOST"],
        num_gpus=_int(environ, "SM_NUM_GPUS"),
        num_cpus=_int(environ, "SM_NUM_CPUS"),
        channels={
            name: environ.get(f"SM_CHANNEL_{name.upper()}", str(base / "input" / "data" / name)) for name in names
        },
        model_dir=environ.get("SM_MODEL_DIR", str(base / "model")),
        output_data_dir=environ.get("SM_OUTPUT_DATA_DIR", str(base / "output" / "data")),
        hyperparameters=_user_hyperparameters(_json(environ.get("SM_HPS", "{}"), "SM_HPS")),
        job_name=environ.get("TRAINING_JOB_NAME") or str(training_env.get("job_name") or ""),
        base_dir=str(base),
    )


def _from_files(environ: Mapping[str, str]) -> SageMakerJob:
    def read(name: str) -> Any:
        path = _config_file(environ, name)
        try:
            return _json(path.read_text(), str(path))
        except OSError as e:
            raise InconsistentEnvironment(f"cannot read {path} ({e}); run inside a SageMaker training job") from None

    resources, channels = read("resourceconfig.json"), read("inputdataconfig.json")
    # hyperparameters.json holds every value as a JSON-encoded string; the toolkit decodes
    # each and keeps the string when that fails. So does this.
    hyperparameters = {}
    for key, value in read("hyperparameters.json").items():
        try:
            hyperparameters[key] = json.loads(value)
        except (TypeError, ValueError):
            hyperparameters[key] = value
    base = base_dir(environ)
    return SageMakerJob(
        hosts=tuple(resources.get("hosts", ())),
        current_host=str(resources.get("current_host", "")),
        # Without the toolkit's nvidia-smi count: the GPU device files the container was given.
        num_gpus=len(glob.glob("/dev/nvidia[0-9]*")),
        num_cpus=os.cpu_count() or 1,
        channels={name: str(base / "input" / "data" / name) for name in channels},
        model_dir=str(base / "model"),
        output_data_dir=str(base / "output" / "data"),
        hyperparameters=_user_hyperparameters(hyperparameters),
        job_name=environ.get("TRAINING_JOB_NAME", ""),
        base_dir=str(base),
    )


_RENAMED = {"SageMakerEnvironment": "SageMakerVariables"}
"""Names of the previous release, served with a DeprecationWarning until the next (see ddpkit.deprecation)."""


def __getattr__(name: str) -> Any:
    return renamed(__name__, name, _RENAMED)
