"""Scripts from ``ddpkit slurm`` run on a real one-node Slurm cluster.

The workers here are a small script (``--command``) that reports what each
one sees: its rank from its launcher, its arguments, the rendezvous address,
and how it handles the preemption signal. The training itself under each
launch mode is tested with the training code. One test kills a rank of a
user's own loop under torchrun inside srun, with a restart allowed
(tests.helpers.restarts).
"""

from __future__ import annotations

import random
import re
import socket
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ddpkit.launchers.sbatch import LAUNCH_MODES, SbatchSpec, render_sbatch
from tests.helpers.restarts import STEPS, launch
from tests.helpers.slurm import JobResult, SlurmCluster, SlurmError, derived_port

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

# Like a training process: reports its rank, arguments and rendezvous address; with "wait", the first run
# then waits for the preemption signal as a training loop would: the handler sets a flag, the loop
# checkpoints and exits. Writes "ready-<rank>-<run>" once its handler is installed.
WORKER = textwrap.dedent(
    """\
    import os, signal, sys, time
    env = os.environ
    rank = next(env[k] for k in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID") if k in env)
    run = int(env.get("SLURM_RESTART_COUNT", "0"))
    signals = []
    signal.signal(signal.SIGUSR1, lambda signum, frame: signals.append(signum))
    sys.stdout.write(f"rank {rank} run {run}: args {sys.argv[1:]} master {env['MASTER_ADDR']}:{env['MASTER_PORT']}\\n")
    sys.stdout.flush()
    open(f"ready-{rank}-{run}", "w").close()
    if sys.argv[1:2] == ["wait"] and run == 0:
        deadline = time.monotonic() + 120
        while not signals and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.5)  # a second delivery would show here
        if not signals:
            sys.exit("no signal came")
        sys.stdout.write(f"rank {rank} run {run}: signals {signals}: checkpoint\\n")
    """
)

RESTART_SEED = 2026
"""Draws where the SIGKILL falls in the restart test, as tests/launchers/test_restarts.py does."""

# mpirun refuses root without these; sbatch passes them on to the job.
MPI_AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "worker.py").write_text(WORKER)
    return tmp_path


def spec_for(project: Path, **fields) -> SbatchSpec:
    """A 2-worker job on the test cluster running worker.py in this venv."""
    return SbatchSpec(
        **{
            "tasks_per_node": 2,
            "venv": sys.prefix,
            "project_root": str(project),
            "output": "out-%j.txt",
            "command": ("python", "worker.py"),
            **fields,
        }
    )


def master_ports(output: str) -> set[int]:
    """The MASTER_PORT values the workers reported."""
    return {int(port) for port in re.findall(r" master \S+:(\d+)$", output, re.MULTILINE)}


def lines_of(output: str, pattern: str) -> list[str]:
    return sorted(line for line in output.splitlines() if re.match(pattern, line))


def wait_for_files(paths: list[Path], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"never appeared: {[str(p) for p in paths if not p.exists()]}"
        time.sleep(0.02)


def test_cluster_runs_a_two_task_step(slurm_cluster: SlurmCluster):
    state = slurm_cluster.run(["sinfo", "--noheader", "--Node", "--format=%N %T %c"]).stdout.split()
    assert state == [slurm_cluster.node_name, "idle", str(slurm_cluster.cpus)]

    tasks = slurm_cluster.run(["srun", "-n2", "bash", "-c", "echo $(hostname) $SLURM_PROCID/$SLURM_NTASKS"])

    assert sorted(tasks.stdout.splitlines()) == [f"{slurm_cluster.node_name} 0/2", f"{slurm_cluster.node_name} 1/2"]


def test_ddpkit_slurm_submit_stages_data_and_moves_the_port_up_when_taken(slurm_cluster: SlurmCluster, project: Path):
    data = project / "shared-data"
    data.mkdir()
    (data / "train.idx").write_text("pixels")
    argv = [
        sys.executable,
        "-m",
        "ddpkit",
        "slurm",
        "submit=true",
        "tasks_per_node=2",
        f"project_root={project}",
        "output=out-%j.txt",
        "command=python worker.py",
        f"output_script={project / 'job.sbatch'}",
        f"stage_data={data}",
        f"stage_data_to={project}/local-$SLURM_JOB_ID",
        "model=mlp",
        "--",
        "epochs=1",
    ]
    # Hold the port the next job id derives, so the script must take the one after.
    next_id = int(parse_next_job_id(slurm_cluster))
    with listening_on(derived_port(next_id)):
        submitted = slurm_cluster.run(argv)
        job_id = int(submitted.stdout)
        result = slurm_cluster.wait(job_id)

    assert job_id == next_id
    assert result.state == "COMPLETED", result.output
    assert result.info["Command"] == str(project / "job.sbatch")
    # Every worker got the same checked port: past the derived one (taken), unless something else on this
    # shared machine happened to listen on the next ones too.
    (port,) = master_ports(result.output)
    assert derived_port(job_id) < port < derived_port(job_id) + 10
    # The data was copied to the node-local folder once, and its path given to every worker.
    staged = project / f"local-{job_id}"
    assert (staged / "train.idx").read_text() == "pixels"
    assert lines_of(result.output, "rank") == [
        f"rank {r} run 0: args ['model=mlp', 'epochs=1', 'data_dir={staged}'] master {slurm_cluster.node_name}:{port}"
        for r in (0, 1)
    ]


def test_a_failing_worker_fails_the_job(slurm_cluster: SlurmCluster, project: Path):
    spec = spec_for(project, command=("python", "-c", "import os, sys; sys.exit(int(os.environ['SLURM_PROCID']) * 3)"))

    result = slurm_cluster.wait(slurm_cluster.submit(render_sbatch(spec)))

    assert result.state == "FAILED"
    assert result.exit_code == "3:0"


@pytest.fixture(scope="module")
def preempted_job_per_launch_mode(slurm_cluster: SlurmCluster, tmp_path_factory) -> dict[str, JobResult | Exception]:
    """How one job per launch mode ended, all run at once (the node has CPUs for all of them).

    Each job's two workers report, wait for the preemption signal (sent as soon as both are ready) and
    report it. A job that went wrong gives the error instead, for its own test to raise.
    """
    env = {**slurm_cluster.env, **MPI_AS_ROOT}
    jobs = {}
    for launch_mode in LAUNCH_MODES:
        project = tmp_path_factory.mktemp(f"launch-{launch_mode}")
        (project / "worker.py").write_text(WORKER)
        spec = spec_for(
            project, launch_mode=launch_mode, train_args=("wait",), preempt_signal="USR1", time="10", requeue=False
        )
        jobs[launch_mode] = (project, slurm_cluster.submit(render_sbatch(spec), env=env))
    outcomes: dict[str, JobResult | Exception] = {}
    for launch_mode, (project, job_id) in jobs.items():
        try:
            wait_for_files([project / "ready-0-0", project / "ready-1-0"])
            # What --signal=B:USR1@90 does 90 s before the time limit.
            slurm_cluster.signal_batch_shell(job_id, "USR1")
        except (AssertionError, SlurmError) as e:
            outcomes[launch_mode] = e
            slurm_cluster.run(["scancel", str(job_id)], check=False)
    for launch_mode, (_, job_id) in jobs.items():
        try:
            outcomes.setdefault(launch_mode, slurm_cluster.wait(job_id))
        except SlurmError as e:
            outcomes[launch_mode] = e
    return outcomes


@pytest.mark.parametrize("launch_mode", LAUNCH_MODES)
def test_each_launch_mode_starts_two_ranked_workers_that_each_get_the_preemption_signal(
    preempted_job_per_launch_mode: dict[str, JobResult | Exception], launch_mode: str
):
    result = preempted_job_per_launch_mode[launch_mode]
    if isinstance(result, Exception):
        raise result
    assert result.state == "COMPLETED", result.output
    assert result.restarts == 0, result.output
    # Two workers, ranked by their launcher, each with the training arguments and the same rendezvous
    # address; each got the signal once, checkpointed and exited 0.
    assert [line.split(" master ")[0] for line in lines_of(result.output, "rank")] == [
        "rank 0 run 0: args ['wait']",
        "rank 0 run 0: signals [10]: checkpoint",
        "rank 1 run 0: args ['wait']",
        "rank 1 run 0: signals [10]: checkpoint",
    ]
    assert len(set(re.findall(r" master (\S+)$", result.output, re.MULTILINE))) == 1, result.output
    assert "no signal came" not in result.output


def parse_next_job_id(cluster: SlurmCluster) -> str:
    """The id the cluster gives the next job (scontrol show config: NEXT_JOB_ID)."""
    config = cluster.run(["scontrol", "show", "config"]).stdout
    return re.search(r"^NEXT_JOB_ID\s*=\s*(\d+)", config, re.MULTILINE).group(1)


@contextmanager
def listening_on(port: int) -> Iterator[None]:
    """A TCP socket listening on every address at port while the block runs."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", port))
        sock.listen()
        yield


@pytest.mark.timeout(600)
def test_torchrun_inside_srun_restarts_a_killed_rank_and_the_run_ends_bit_equal(slurm_cluster: SlurmCluster, tmp_path):
    # tests/launchers/test_restarts.py's kill, under the launch `ddpkit slurm launch=torchrun` writes: torchrun with
    # --max-restarts 1 as the one task of an srun step. The restart happens inside the step: Slurm sees one task
    # that ran to its end.
    rng = random.Random(RESTART_SEED)
    kill_at, kill_rank = rng.randint(2, STEPS - 1), rng.randint(0, 1)
    reference = launch("ddpkit-run", tmp_path / "reference")
    assert reference.returncode == 0 and reference.weights is not None, reference.output

    out = launch("srun-torchrun", tmp_path / "srun", kill_at, kill_rank, timeout=240, environ=slurm_cluster.env)

    assert out.returncode == 0, out.output
    assert f"rank {kill_rank}: sending myself SIGKILL after step {kill_at}" in out.output
    for rank in (0, 1):
        assert f"rank {rank}: start epoch={(kill_at - 1) // 6} global_step={kill_at - 1} resumed=True" in out.output
    assert "connectFullMesh" not in out.output
    assert not out.differing(reference.weights), f"final weights differ in {out.differing(reference.weights)}"
