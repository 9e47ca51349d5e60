"""A real one-node Slurm cluster for tests: munged, slurmctld and slurmd in a temp folder.

    with start_slurm_cluster() as cluster:
        cluster.run(["srun", "-n2", "hostname"])
        job_id = cluster.submit(script_text)
        result = cluster.wait(job_id)          # JobResult(state="COMPLETED", ...)

Everything lives under one temporary folder: a munge key and socket of its
own, slurm.conf, state, spool, logs and pid files; the daemons listen on
ports free when the cluster starts. The system's /etc/slurm and
/etc/munge are neither read nor changed, so clusters of concurrent test runs
on one machine do not meet. Clients find the cluster through SLURM_CONF,
which is only in ``cluster.env``: pass ``env=cluster.env`` to subprocesses
(``cluster.run`` does). Code under test that runs sbatch itself, called in
the test's own process, finds the cluster through ``cluster.patch_environ(
monkeypatch)``, which pytest undoes at the end of the test; never set
SLURM_CONF in os.environ otherwise.

The daemons daemonize (munged, slurmctld, slurmd fork and their parent
exits), so they are not children of the test process. On exit, even after a
failure, every job is cancelled, slurmctld and slurmd are shut down, and
munged and any process left from a job are killed.

Finished jobs stay visible to ``scontrol show job`` for MinJobAge (10 min);
there is no slurmdbd, hence no sacct. A requeued job may start again after
``cred_expire`` (5 s here, the least Slurm accepts; 120 s by default). Needs
root and Debian's packages slurmctld, slurmd, slurm-client and munge:
scripts/cluster-setup.sh.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

REQUIRED_PROGRAMS = ("munged", "slurmctld", "slurmd", "slurmstepd", "sbatch", "srun", "scontrol", "sinfo", "scancel")
SETUP_HINT = "run scripts/cluster-setup.sh (as root) to install Slurm and munge"

TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)
"""Job states after which a job never runs again (unless requeued by hand)."""

CRED_EXPIRE_SECONDS = 5
"""Step credential lifetime; also how long a requeued job waits before it may start again (Slurm's minimum)."""

POLL_SECONDS = 0.05
"""Pause between two looks at a job's state (one scontrol call each, a few ms)."""

_SLURM_CONF = """\
ClusterName=ddpkit
SlurmctldHost={host}
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={munge_socket},cred_expire={cred_expire}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
# Finished jobs stay in scontrol's view this long (there is no accounting database).
MinJobAge=600
FirstJobId={first_job_id}
KillWait=5
# Schedule every second rather than every 60 s: slurmctld starts batch jobs only from this loop
# (its background thread wakes once a second), so a job waits up to this long to start, and a
# requeued job this long after cred_expire.
SchedulerParameters=sched_interval=1
# The node offers the CPUs given here, even more than the machine has, so that tests can run jobs side by side.
SlurmdParameters=config_overrides
NodeName={host} CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


@dataclass(frozen=True)
class JobResult:
    """How a batch job ended, from ``scontrol show job``."""

    job_id: int
    """Slurm job id."""
    state: str
    """Final JobState, e.g. COMPLETED, FAILED, TIMEOUT."""
    exit_code: str
    """ExitCode as Slurm prints it: "status:signal", e.g. "0:0"."""
    restarts: int
    """Times the job was requeued and started again."""
    output: str
    """Content of the job's standard output file ("" if it has none)."""
    info: Mapping[str, str]
    """Every field of ``scontrol show job``."""


class SlurmError(RuntimeError):
    """The cluster did not start, a command failed, or a job did not finish in time."""


@dataclass(frozen=True)
class SlurmCluster:
    """A running one-node cluster; use it through ``env`` or its methods."""

    root: Path
    """Temporary folder holding configuration, state and logs."""
    conf: Path
    """The generated slurm.conf."""
    node_name: str
    """NodeName of the one node (this machine's hostname)."""
    cpus: int
    """CPUs the node offers to jobs."""
    env: Mapping[str, str]
    """os.environ plus SLURM_CONF and minus other SLURM_* variables: pass it to subprocesses."""

    def run(
        self,
        argv: Sequence[str],
        *,
        timeout: float = 60.0,
        check: bool = True,
        env: Mapping[str, str] | None = None,
        **kwargs,
    ) -> subprocess.CompletedProcess:
        """Run a Slurm client command (or anything) against this cluster and wait.

        Args:
            argv: The command, e.g. ["srun", "-n2", "hostname"].
            timeout: Seconds before the command is killed and SlurmError raised.
            check: Raise SlurmError with its output when it exits non-zero.
            env: Environment of the command; None for ``self.env``. A batch
                job inherits the environment of its sbatch.
            **kwargs: Passed to subprocess.run (e.g. input=, cwd=).

        Returns:
            The finished process, with text stdout and stderr captured.

        Raises:
            SlurmError: it failed (when check) or timed out.
        """
        try:
            result = subprocess.run(
                list(argv),
                env=dict(self.env if env is None else env),
                capture_output=True,
                text=True,
                timeout=timeout,
                **kwargs,
            )
        except subprocess.TimeoutExpired as e:
            raise SlurmError(f"{' '.join(argv)} did not finish in {timeout} s\n{self.logs()}") from e
        if check and result.returncode != 0:
            raise SlurmError(
                f"{' '.join(argv)} exited with {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
            )
        return result

    def patch_environ(self, monkeypatch, **extra: str) -> None:
        """Make os.environ this cluster's ``env`` plus extra for the rest of the test (pytest's monkeypatch undoes it).

        For code under test called in this process that runs Slurm's clients itself, e.g.
        ``ddpkit.commands.dispatch.main(["slurm", "submit=true", ...])``; a batch job inherits sbatch's environment.
        """
        for name in [name for name in os.environ if name.startswith("SLURM_")]:
            monkeypatch.delenv(name)
        for name, value in {"SLURM_CONF": self.env["SLURM_CONF"], **extra}.items():
            monkeypatch.setenv(name, value)

    def submit(self, script: str | Path, *sbatch_args: str, env: Mapping[str, str] | None = None) -> int:
        """Submit a batch script (its text, or a path to it) with sbatch; return the job id.

        Args:
            script: The script's text, or the Path of a script file.
            *sbatch_args: Extra sbatch options, e.g. "--time=1".
            env: Environment of sbatch, which the job inherits; None for ``self.env``.
        """
        if isinstance(script, Path):
            result = self.run(["sbatch", "--parsable", *sbatch_args, str(script)], env=env)
        else:
            result = self.run(["sbatch", "--parsable", *sbatch_args], input=script, env=env)
        return int(result.stdout.strip().split(";")[0])

    def job_info(self, job_id: int) -> dict[str, str]:
        """Fields of ``scontrol show job`` for a job still in slurmctld's memory."""
        return parse_scontrol(self.run(["scontrol", "show", "job", "--oneliner", str(job_id)]).stdout)

    def wait(self, job_id: int, timeout: float = 120.0) -> JobResult:
        """Wait until the job reaches a terminal state; return how it ended.

        A requeued job passes through PENDING again and is waited for until
        its last run ends.

        Raises:
            SlurmError: timeout passed first; the message has the job's
                fields, its output so far and the daemons' logs.
        """
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in TERMINAL_STATES:
                return JobResult(
                    job_id=job_id,
                    state=info["JobState"],
                    exit_code=info.get("ExitCode", ""),
                    restarts=int(info.get("Restarts", "0")),
                    output=_read(info.get("StdOut", "")),
                    info=info,
                )
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"job {job_id} is still {info.get('JobState')} after {timeout} s "
                    f"(reason {info.get('Reason')})\noutput so far:\n{_read(info.get('StdOut', ''))}\n{self.logs()}"
                )
            time.sleep(POLL_SECONDS)

    def wait_for_state(self, job_id: int, states: Sequence[str], timeout: float = 60.0) -> dict[str, str]:
        """Wait until the job is in one of states (e.g. RUNNING); return its fields."""
        deadline = time.monotonic() + timeout
        while True:
            info = self.job_info(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline or info.get("JobState") in TERMINAL_STATES:
                raise SlurmError(f"job {job_id} is {info.get('JobState')}, not {' or '.join(states)}\n{self.logs()}")
            time.sleep(POLL_SECONDS)

    def signal_batch_shell(self, job_id: int, signal_name: str) -> None:
        """Send a signal to the job's batch shell only, as ``--signal=B:SIG@t`` does at time t."""
        self.run(["scancel", "--batch", f"--signal={signal_name}", str(job_id)])

    def logs(self, lines: int = 20) -> str:
        """The last lines of the daemons' logs, for failure messages."""
        parts = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log"):
            path = self.root / ("munge" if name == "munged.log" else "log") / name
            text = _read(str(path)).splitlines()[-lines:]
            parts.append(f"--- {name} ---\n" + "\n".join(text))
        return "\n".join(parts)


def derived_port(job_id: int) -> int:
    """The rendezvous port of a job (ddpkit.env.ports.port_from_job_id), if nothing else listens on it."""
    return 10000 + job_id % 20000


def parse_scontrol(text: str) -> dict[str, str]:
    """Fields of one ``scontrol show ... --oneliner`` record: "A=1 B=x y C=2" -> {A: 1, B: "x y", C: 2}."""
    # A value runs until the next " Key=" (values such as Command= may hold spaces).
    pairs = re.findall(r"(?:^|\s)([A-Za-z][\w/:.]*)=(.*?)(?=\s[A-Za-z][\w/:.]*=|\s*$)", text.strip())
    return dict(pairs)


def unavailable_reason() -> str | None:
    """Why the test cluster cannot start here (not root, a program missing), or None when it can."""
    if os.geteuid() != 0:
        return f"the test cluster runs its daemons as root and munge; run the tests as root ({SETUP_HINT})"
    missing = [p for p in REQUIRED_PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        return f"missing {', '.join(missing)}: {SETUP_HINT}"
    return None


@contextmanager
def start_slurm_cluster(cpus: int = 2, start_timeout: float = 30.0, first_job_id: int = 1) -> Iterator[SlurmCluster]:
    """Start munged, slurmctld and slurmd for one node; stop them all on exit.

    Args:
        cpus: CPUs the node offers; more than the machine has is fine
            (SlurmdParameters=config_overrides), for jobs side by side.
        first_job_id: Id of the cluster's first job. Clusters running at the
            same time on one machine need ranges of their own: a job's
            rendezvous port derives from its id (:func:`derived_port`).
        start_timeout: Seconds for the node to become idle.

    Yields:
        The running cluster.

    Raises:
        SlurmError: not root, a program is missing, or the node did not
            become idle in time (the message has the daemons' logs).
    """
    reason = unavailable_reason()
    if reason:
        raise SlurmError(reason)
    root = Path(tempfile.mkdtemp(prefix="ddpkit-slurm-"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, root, ignore_errors=True)
        root.chmod(0o755)  # munged, running as munge, must reach its socket under root
        for sub in ("state", "spool", "log"):
            (root / sub).mkdir()
        munge_socket = _start_munged(root)
        stack.callback(_stop_pidfile, root / "munge" / "munged.pid")
        node = socket.gethostname()
        conf = root / "slurm.conf"
        ctld_port, d_port = _free_ports(2)
        conf.write_text(
            _SLURM_CONF.format(
                host=node,
                ctld_port=ctld_port,
                d_port=d_port,
                munge_socket=munge_socket,
                cred_expire=CRED_EXPIRE_SECONDS,
                root=root,
                cpus=cpus,
                first_job_id=first_job_id,
            )
        )
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        env["SLURM_CONF"] = str(conf)
        cluster = SlurmCluster(root=root, conf=conf, node_name=node, cpus=cpus, env=env)
        stack.callback(_stop_slurm, cluster)
        for daemon in ("slurmctld", "slurmd"):
            started = subprocess.run([_program(daemon), "-f", str(conf)], env=env, capture_output=True, text=True)
            if started.returncode != 0:
                raise SlurmError(f"{daemon} did not start: {started.stderr.strip()}\n{cluster.logs()}")
        _wait_idle(cluster, start_timeout)
        yield cluster


def _start_munged(root: Path) -> Path:
    """Start a munged of our own, as user munge, with a fresh 1 KiB key; return its socket."""
    munge_dir = root / "munge"
    munge_dir.mkdir()
    key = munge_dir / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    for path in (munge_dir, key):
        shutil.chown(path, "munge", "munge")
    munge_dir.chmod(0o755)  # munged refuses a socket in a folder others cannot search
    sock = munge_dir / "munge.socket"
    started = subprocess.run(
        [
            _program("munged"),
            f"--socket={sock}",
            f"--key-file={key}",
            f"--pid-file={munge_dir / 'munged.pid'}",
            f"--log-file={munge_dir / 'munged.log'}",
            f"--seed-file={munge_dir / 'munged.seed'}",
        ],
        user="munge",
        group="munge",
        extra_groups=[],
        capture_output=True,
        text=True,
    )
    if started.returncode != 0:
        raise SlurmError(f"munged did not start: {started.stderr.strip()}")
    return sock


def _wait_idle(cluster: SlurmCluster, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        state = cluster.run(["sinfo", "--noheader", "--Node", "--format=%T"], check=False, timeout=10)
        if state.stdout.strip() == "idle":
            return
        if time.monotonic() > deadline:
            raise SlurmError(
                f"node {cluster.node_name} is {state.stdout.strip() or state.stderr.strip()!r}, not idle, "
                f"after {timeout} s\n{cluster.logs()}"
            )
        time.sleep(POLL_SECONDS)


def _stop_slurm(cluster: SlurmCluster) -> None:
    """Cancel every job, shut the daemons down, and kill whatever of them is left."""
    daemons = [_pid(cluster.root / name) for name in ("slurmctld.pid", "slurmd.pid")]
    # Jobs' processes descend from slurmd (via slurmstepd) and outlive it: collect them first.
    leftovers = _descendants([pid for pid in daemons if pid])
    cluster.run(["scancel", "--user=root"], check=False, timeout=10)
    cluster.run(["scontrol", "shutdown"], check=False, timeout=10)
    _kill_all([pid for pid in daemons if pid] + [p.pid for p in leftovers], grace=10.0)


def _stop_pidfile(pidfile: Path) -> None:
    pid = _pid(pidfile)
    if pid:
        _kill_all([pid], grace=5.0)


def _kill_all(pids: Sequence[int], grace: float) -> None:
    """Wait up to grace seconds for the processes to exit after SIGTERM, then SIGKILL them."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    for proc in procs:
        _send(proc, signal.SIGTERM)
    alive = _wait_gone(procs, grace)
    for proc in alive:
        _send(proc, signal.SIGKILL)
    _wait_gone(alive, 5.0)


def _wait_gone(procs: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Processes still running after timeout; a zombie counts as gone (its parent reaps it)."""
    deadline = time.monotonic() + timeout
    while True:
        alive = [p for p in procs if _running(p)]
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _send(proc: psutil.Process, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except psutil.NoSuchProcess:
        pass


def _descendants(pids: Sequence[int]) -> list[psutil.Process]:
    out = []
    for pid in pids:
        try:
            out += psutil.Process(pid).children(recursive=True)
        except psutil.NoSuchProcess:
            pass
    return out


def _pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _free_ports(count: int) -> list[int]:
    """Ports free right now, all different (sockets held open until every one is chosen)."""
    with ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("", 0))
        return [s.getsockname()[1] for s in socks]


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def _read(path: str) -> str:
    try:
        return Path(path).read_text(errors="replace")
    except OSError:
        return ""
