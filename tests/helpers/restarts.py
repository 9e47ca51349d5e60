"""One rank of tests/launchers/scripts/own_bn.py SIGKILLed, restarted by a launcher, compared with an uninterrupted run.

The launchers whose restarts ddpkit promises to survive, as a user types them::

    torchrun-c10d    torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d --rdzv-endpoint localhost:0
    torchrun-static  torchrun --nproc-per-node 2 --max-restarts 1 --master-port PORT   (torch's default rendezvous)
    ddpkit-run       ddpkit run nproc=2 max_restarts=1
    srun-torchrun    srun --nodes=1 --ntasks=1 --cpus-per-task=2 --kill-on-bad-exit=1 torchrun --nnodes=1
                         --nproc-per-node=2 --max-restarts=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT ...

srun-torchrun is the launch ``ddpkit slurm launch=torchrun`` writes (one
Slurm task per node, torchrun inside it), on one node: it needs a running
Slurm cluster, whose environment (``SLURM_CONF``) ``launch`` is given.
Each command runs in a fresh process with this checkout importable
(``tests.cli_runner.PYTHONPATH``) and a hard timeout, so that a hang is an
outcome, not a stuck test. tests/launchers/test_restarts.py runs each local
launcher once, tests/cluster/test_slurm_cluster.py the Slurm one;
benchmarks/restarts.py runs them many times and writes the counts.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from ddpkit.env.ports import free_port
from tests.cli_runner import PYTHONPATH

SCRIPT = Path(__file__).resolve().parents[1] / "launchers" / "scripts" / "own_bn.py"
STEPS = 12
"""Optimizer steps of the script's 2 epochs."""
LAUNCHERS = ("torchrun-c10d", "torchrun-static", "ddpkit-run")
"""Launchers that run on this machine alone."""
SLURM_LAUNCHERS = ("srun-torchrun",)
"""Launchers that need a Slurm cluster (tests.helpers.slurm)."""


def command(launcher: str, job_name: str = "ddpkit-restarts") -> list[str]:
    """The argv that starts 2 workers of the script with one restart allowed (script arguments follow).

    ``job_name`` names the Slurm job of a Slurm launcher (to cancel it by name).
    """
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1"]
    if launcher == "torchrun-c10d":
        return [*torchrun, "--rdzv-backend", "c10d", "--rdzv-endpoint", "localhost:0", str(SCRIPT)]
    if launcher == "torchrun-static":
        return [*torchrun, "--master-port", str(free_port("127.0.0.1")), str(SCRIPT)]
    if launcher == "ddpkit-run":
        # show_ranks=all: the tests read what rank 1 prints, as torchrun shows every rank.
        return [sys.executable, "-m", "ddpkit", "run", "nproc=2", "max_restarts=1", "show_ranks=all", str(SCRIPT)]
    if launcher == "srun-torchrun":
        # As the script of `ddpkit slurm launch=torchrun` has it (ddpkit.launchers.sbatch), for one node: the
        # rendezvous endpoint is the node's host name, the job's id the rendezvous id.
        srun = ["srun", "--nodes=1", "--ntasks=1", "--cpus-per-task=2", "--kill-on-bad-exit=1", "--job-name"]
        endpoint = f"{socket.gethostname()}:{free_port('0.0.0.0')}"
        rendezvous = ["--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={job_name}"]
        return [*srun, job_name, *torchrun, "--nnodes=1", *rendezvous, str(SCRIPT)]
    raise ValueError(f"unknown launcher {launcher!r}; choose one of {LAUNCHERS + SLURM_LAUNCHERS}")


@dataclass(frozen=True)
class Outcome:
    """How one launch ended."""

    returncode: int | None
    """The launcher's exit status; None when it was still running at the timeout (then killed)."""
    output: str
    """stdout then stderr."""
    weights: dict[str, torch.Tensor] | None
    """The final weights rank 0 saved; None if it saved none."""

    def differing(self, reference: dict[str, torch.Tensor]) -> list[str]:
        """Names of the tensors whose values differ from ``reference``'s (all of them when none were saved)."""
        if self.weights is None or self.weights.keys() != reference.keys():
            return sorted(reference)
        return [name for name in reference if not torch.equal(self.weights[name], reference[name])]


def launch(
    launcher: str,
    folder: Path,
    kill_at: int = 0,
    kill_rank: int = 1,
    timeout: float = 120,
    environ: Mapping[str, str] | None = None,
) -> Outcome:
    """Run the script under ``launcher`` in ``folder``; rank ``kill_rank`` SIGKILLs itself after step ``kill_at`` (0: never).

    ``environ`` is the launcher's environment (default: this process's); a Slurm launcher needs the
    cluster's (``SlurmCluster.env``). The launcher gets its own session: at the timeout the whole tree is
    killed, and a Slurm job cancelled (its processes descend from slurmd, not from srun).
    """
    folder.mkdir(parents=True, exist_ok=True)
    base = os.environ if environ is None else environ
    env = {**base, "PYTHONPATH": PYTHONPATH, "KILL_AT_STEP": str(kill_at), "KILL_RANK": str(kill_rank)}
    job_name = f"ddpkit-restarts-{os.getpid()}-{folder.name}"
    argv = [*command(launcher, job_name), "--out", str(folder / "ckpt"), "--final", str(folder / "final.pt")]
    with subprocess.Popen(
        argv, cwd=folder, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    ) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
            returncode: int | None = process.returncode
        except subprocess.TimeoutExpired:
            if launcher in SLURM_LAUNCHERS:
                subprocess.run(["scancel", f"--name={job_name}"], env=env, capture_output=True, timeout=30)
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            returncode = None
    final = folder / "final.pt"
    weights = torch.load(final, weights_only=True) if final.exists() else None
    return Outcome(returncode, stdout + stderr, weights)
