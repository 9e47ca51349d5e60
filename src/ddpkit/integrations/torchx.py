"""torchx components that start ddpkit jobs: ``train`` (``ddpkit train``) and ``run`` (``ddpkit run SCRIPT``).

torchx finds a component by the path of its file; ``python -m
ddpkit.integrations.torchx`` prints this one's::

    C=$(python -m ddpkit.integrations.torchx)
    torchx run -s local_cwd $C:train --nproc 2 model=mlp dataset=fashion_mnist epochs=1
    torchx run -s slurm     $C:train --nnodes 2 --nproc 4 --gpu 4 model=cnn epochs=5
    torchx run -s kubernetes $C:run --image my/image --nnodes 2 --nproc 8 --gpu 8 --script train.py -- --lr 0.1

(An entry point in ``[torchx.components]`` would hide torchx's own builtins,
``dist.ddp`` and the rest, from every user who installs ddpkit: torchx loads
the builtins only when no package registers components.)

Each of the ``nnodes`` replicas of the one role runs ddpkit's own launcher
with ``nproc`` workers, as one node of a ``ddpkit train nnodes=N node_rank=R
master_addr=A master_port=P`` job: node R is torchx's replica id, A the host
of replica 0 as the scheduler names it (torchx's ``rank0_env``), P the
``master_port`` of the component. So whatever scheduler torchx drives, the
job is ddpkit's: its run folder, checkpoints, ``resume=``, preemption
handling and exit statuses (75 preempted, 65 diverged, 74 storage; see
``ddpkit train --help``) are those of ``ddpkit train`` itself, which is also
what each task of ``ddpkit slurm launch=srun`` runs; under Slurm
(``-s slurm``) the run folder is ``runs/<model>-<dataset>/slurm-<job id>``,
as with ``ddpkit slurm``. A job the scheduler starts again (``max_retries``:
torchx's Slurm script requeues a job that exited non-zero, 75 included)
continues from its newest checkpoint when the options say so: pass
``resume=auto`` (and, off Slurm, ``output_dir=...``, the folder every attempt
shares).

This file is read by torchx with ``exec`` into torchx's own module
namespace, so it defines nothing at the top level but the components and
names prefixed ``_ddpkit``, and its annotations are the plain types
torchx's component linter reads.
"""

import shlex

# torchx's component linter reads Optional[...] and Dict[...], not `X | None` or `dict[...]`.
from typing import Dict, Optional  # noqa: UP035

import torchx.specs as specs  # type: ignore[import-untyped]  # torchx ships no type information


def train(
    *options: str,
    nproc: int = 1,
    nnodes: int = 1,
    name: str = "ddpkit-train",
    image: str = "",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 2048,
    h: Optional[str] = None,  # noqa: UP045
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    max_retries: int = 0,
    master_port: int = 29500,
    python: str = "python",
) -> specs.AppDef:
    """Data-parallel training with ``ddpkit train``: nnodes replicas of nproc workers each.

    Args:
        options: ddpkit train's key=value options, e.g. model=mlp dataset=fashion_mnist epochs=2
        nproc: workers per node (replica); at most the node's GPUs when training on GPUs
        nnodes: nodes (replicas) of the job
        name: the job's name
        image: the image the scheduler runs (a container image; local_cwd and slurm: the current folder)
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        env: environment variables for every node, e.g. DDPKIT_X=1,OTHER=2
        max_retries: times the scheduler may start a failed job again
        master_port: TCP port of the rendezvous on node 0 (nnodes > 1)
        python: the Python executable inside the image, with ddpkit installed
    """
    return _ddpkit_app(
        ["train", *options], nproc, nnodes, name, image, cpu, gpu, memMB, h, env, max_retries, master_port, python
    )


def run(
    *script_args: str,
    script: str = "",
    m: str = "",
    nproc: int = 1,
    nnodes: int = 1,
    name: str = "",
    image: str = "",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 2048,
    h: Optional[str] = None,  # noqa: UP045
    env: Optional[Dict[str, str]] = None,  # noqa: UP006, UP045
    max_retries: int = 0,
    master_port: int = 29500,
    python: str = "python",
) -> specs.AppDef:
    """Your own training script under ``ddpkit run``: nnodes replicas of nproc workers each.

    Args:
        script_args: the script's own arguments
        script: the script every worker runs (give script or m)
        m: or a module, as python -m runs it
        nproc: workers per node (replica); at most the node's GPUs when training on GPUs
        nnodes: nodes (replicas) of the job
        name: the job's name (default: the script's or module's name)
        image: the image the scheduler runs (a container image; local_cwd and slurm: the current folder)
        cpu: CPUs per node
        gpu: GPUs per node
        memMB: memory per node in MB
        h: a registered named resource (takes precedence over cpu, gpu, memMB)
        env: environment variables for every node, e.g. DDPKIT_X=1,OTHER=2
        max_retries: times the scheduler may start a failed job again
        master_port: TCP port of the rendezvous on node 0 (nnodes > 1)
        python: the Python executable inside the image, with ddpkit installed
    """
    if bool(script) == bool(m):
        raise ValueError("give exactly one of --script SCRIPT.py and --m MODULE: the program every worker runs")
    program = [script] if script else ["-m", m]
    default_name = (script.rsplit("/", 1)[-1].removesuffix(".py") if script else m.rpartition(".")[2]) or "run"
    return _ddpkit_app(
        ["run", *program, *script_args],
        nproc,
        nnodes,
        name or default_name,
        image,
        cpu,
        gpu,
        memMB,
        h,
        env,
        max_retries,
        master_port,
        python,
    )


def _ddpkit_app(
    words: list[str],
    nproc: int,
    nnodes: int,
    name: str,
    image: str,
    cpu: int,
    gpu: int,
    memMB: int,
    h: str | None,
    env: dict[str, str] | None,
    max_retries: int,
    master_port: int,
    python: str,
) -> specs.AppDef:
    """One role of nnodes replicas, each ``python -m ddpkit COMMAND nproc=... [nnodes=... node_rank=...]``."""
    if nproc < 1 or nnodes < 1:
        raise ValueError(f"nproc={nproc} and nnodes={nnodes} must both be at least 1")
    command, rest = words[0], words[1:]
    launch = [f"nproc={nproc}"]
    if nnodes > 1:
        # The replica id and rank 0's host are filled in by torchx per replica; bash expands the variable
        # (some schedulers, AWS Batch, set it on every replica but rank 0: there it is this host).
        launch += [
            f"nnodes={nnodes}",
            _DdpkitNoQuote(f"node_rank={specs.macros.replica_id}"),
            # "$$" is torchx's escape of "$": bash reads ${TORCHX_RANK0_HOST:=localhost}, say.
            _DdpkitNoQuote(f"master_addr=$${{{specs.macros.rank0_env}:=localhost}}"),
            f"master_port={master_port}",
        ]
    line = [python, "-m", "ddpkit", command, *launch, *rest]
    return specs.AppDef(
        name=name,
        roles=[
            specs.Role(
                name=name,
                image=image,
                entrypoint="bash",
                # exec: the launcher is the replica's process, so the scheduler's signals (preemption) and
                # its exit status (75, 65, 74...) are ddpkit's own. torchx's Slurm scheduler runs a replica
                # as one task of an srun step, whose SLURM_STEP_ID would make ddpkit take the launcher for
                # a worker (of a one-task step): unset, it launches nproc workers; SLURM_JOB_ID still names
                # the run folder and SLURM_RESTART_COUNT still marks a requeued job.
                args=["-c", "unset SLURM_STEP_ID SLURM_STEPID; exec " + _ddpkit_words(line)],
                num_replicas=nnodes,
                resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
                env=dict(env or {}),
                port_map={"ddpkit": master_port},
                max_retries=max_retries,
            )
        ],
    )


def _ddpkit_words(words: list[str]) -> str:
    """A bash command line of ``words``, each quoted unless it is a :class:`_DdpkitNoQuote`."""
    return " ".join(w if isinstance(w, _DdpkitNoQuote) else shlex.quote(w) for w in words)


class _DdpkitNoQuote(str):
    """A word of the bash command line left unquoted, so that bash expands its variable."""


if __name__ == "__main__":
    print(__file__)  # for torchx run PATH:train
