"""Two hosts made of network namespaces: torchrun on each trains W1 (its first steps) and runs the doctor.

    namespace A  10.77.0.1 <--- veth ---> 10.77.0.2  namespace B
    torchrun --node-rank 0                 torchrun --node-rank 1

No GLOO_SOCKET_IFNAME reaches the workers: ddpkit must choose the veth
interface (the one that routes to the master) by itself. Left to itself,
gloo binds to the address the host name resolves to (127.0.0.1 here) and
connectFullMesh fails.

torchrun's own rendezvous needs two flags here, and on real clusters whose
nodes have several addresses:

- ``--rdzv-backend c10d``: the agent hosts the rendezvous store only if the
  endpoint's host matches its host name or the host name's addresses; the
  veth address 10.77.0.1 does not, so nobody hosts it and every agent times
  out. ``--rdzv-conf is_host=true`` on the endpoint's node (false on the
  others) says who hosts it.
- The agent that becomes rank 0 of the rendezvous names the master for the
  workers by ``--local-addr``, else by socket.getfqdn(), which is
  "localhost" here: the other host's workers would connect to themselves.
  ``--local-addr <this node's address>`` on every node fixes it.

The static form (``--master-addr 10.77.0.1 --master-port P --node-rank R``)
needs neither: node rank 0 hosts the store, on every address, and the
workers get --master-addr as MASTER_ADDR. ``ddpkit run``/``ddpkit train``
with ``nnodes=2`` use that form, with node 0's store on 10.77.0.1 only: a
test lists every listening socket of both hosts while they run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from ddpkit.env.ports import free_port
from tests.cli_runner import PYTHONPATH
from tests.cluster.short_w1 import W1_SHORT, W1_SHORT_ACCURACY_FLOOR, W1_SHORT_STEPS
from tests.helpers.netns import Host, TwoHosts, netns_hosts  # noqa: F401  (netns_hosts is a fixture)

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

TORCHRUN = str(Path(sys.executable).with_name("torchrun"))

# Both "hosts" share this machine's cores, but each sees all of them: by default a lone
# worker per host would run one torch thread per core, twice the cores in all, and
# oversubscribed threads spin-wait on each other (one epoch of W1: ~200 s instead of ~5 s).
SHARED_CORES = ("threads=1",)

LOOPBACK = {"127.0.0.1", "::1"}
WATCHED_SCRIPT = """
import time
import torch, torch.distributed as dist
import ddpkit
ctx = ddpkit.init()
value = torch.ones(1)
dist.all_reduce(value)
time.sleep(2)  # long enough for the test to see every socket
print(f"rank {ctx.rank} sum {value.item():g}", flush=True)
"""


@dataclass(frozen=True)
class NodeResult:
    """How the torchrun of one host ended."""

    returncode: int
    stdout: str
    stderr: str


def worker_environment(**extra: str) -> dict[str, str]:
    """This environment without any launcher or interface variable, plus extra."""
    drop = ("GLOO_SOCKET_IFNAME", "MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    launchers = ("SLURM_", "OMPI_", "TORCHELASTIC_")
    env = {k: v for k, v in os.environ.items() if k not in drop and not k.startswith(launchers)}
    return {**env, "PYTHONPATH": PYTHONPATH, **extra}


def rendezvous_flags(host: Host, node_rank: int, master: Host, port: int, form: str) -> list[str]:
    """torchrun's flags for one node: the static form, or c10d with the two fixes of the module docstring."""
    if form == "static":
        return ["--node-rank", str(node_rank), "--master-addr", master.address, "--master-port", str(port)]
    return [
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"{master.address}:{port}",
        "--rdzv-id",
        "multinode",
        "--rdzv-conf",
        f"is_host={'true' if host is master else 'false'}",
        "--local-addr",
        host.address,
    ]


def run_on_two_hosts(
    hosts: TwoHosts,
    nproc_per_node: int,
    words: Sequence[str],
    cwd: Path,
    *,
    form: str = "static",
    timeout: float = 600,
    env: dict[str, str] | None = None,
    local_addr: bool = True,
) -> tuple[NodeResult, NodeResult]:
    """``torchrun ... -m ddpkit WORDS`` in both namespaces at once; wait for both (killed at timeout).

    env is both nodes' environment (default: worker_environment()); local_addr=False leaves
    --local-addr out of the c10d form.
    """
    # Any port is free in a namespace this test just created; this one is merely unlikely to be special.
    port = free_port()
    argvs = []
    for node_rank, host in enumerate((hosts.a, hosts.b)):
        flags = rendezvous_flags(host, node_rank, hosts.a, port, form)
        if not local_addr:
            flags = flags[:-2]
        argvs.append(
            [TORCHRUN, "--nnodes", "2", "--nproc-per-node", str(nproc_per_node), *flags, "-m", "ddpkit", *words]
        )
    return run_both(hosts, argvs, cwd, timeout=timeout, env=worker_environment() if env is None else env)


def run_both(
    hosts: TwoHosts, argvs: Sequence[Sequence[str]], cwd: Path, *, timeout: float, env: dict[str, str]
) -> tuple[NodeResult, NodeResult]:
    """``argvs[0]`` in namespace A and ``argvs[1]`` in B at once; wait for both (killed at timeout)."""
    procs = []
    for host, argv in zip((hosts.a, hosts.b), argvs):
        # A session per node: on timeout the whole tree goes (the launcher and its workers).
        procs.append(
            subprocess.Popen(
                host.command(list(argv)),
                cwd=cwd,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(NodeResult(proc.returncode, stdout, stderr))
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return results[0], results[1]


def test_no_interface_variable_reaches_the_workers():
    # The premise of this module: ddpkit alone chooses gloo's interface.
    assert "GLOO_SOCKET_IFNAME" not in worker_environment()


@pytest.mark.timeout(600)
def test_two_hosts_two_workers_each_train_w1(netns_hosts: TwoHosts, tmp_path, fashion_mnist):
    # Four workers on two cores, each with a quarter of every global batch. The static form here; the c10d form
    # (with the module docstring's two flags) forms the same 2x2 process group in
    # test_doctor_reports_both_hosts_with_two_workers_each, through the same ddpkit.init.
    a, b = run_on_two_hosts(
        netns_hosts, 2, ["train", "progress=false", *W1_SHORT, *SHARED_CORES], tmp_path, form="static"
    )

    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    assert f"[rank 0/4] torchrun: world_size 4 on 2 node(s), master {netns_hosts.a.address}:" in a.stderr
    summary = json.loads((tmp_path / "runs" / "latest" / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_steps"] == W1_SHORT_STEPS
    assert summary["test"]["accuracy"] >= W1_SHORT_ACCURACY_FLOOR, summary["test"]
    assert re.search(r"\[rank 0/4\] done: mlp on fashion-mnist, 4 worker\(s\), test accuracy", a.stderr)


@pytest.mark.timeout(600)
def test_ddpkit_train_with_nnodes_on_two_hosts(netns_hosts: TwoHosts, tmp_path, fashion_mnist):
    # No torchrun: `ddpkit train nnodes=2 node_rank=R master_addr=A master_port=P` on each host, as in two
    # containers. Both hosts share this folder; only node 0 makes a run folder, and every rank writes into it.
    port = free_port()
    argvs = [
        [
            sys.executable,
            "-m",
            "ddpkit",
            "train",
            "nproc=2",
            "nnodes=2",
            f"node_rank={node_rank}",
            f"master_addr={netns_hosts.a.address}",
            f"master_port={port}",
            "progress=false",
            *W1_SHORT,
            *SHARED_CORES,
        ]
        for node_rank in (0, 1)
    ]
    a, b = run_both(netns_hosts, argvs, tmp_path, timeout=540, env=worker_environment())

    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    assert f"[rank 0/4] ddpkit launcher: world_size 4 on 2 node(s), master {netns_hosts.a.address}:{port}" in a.stderr
    runs = list((tmp_path / "runs" / "mlp-fashion-mnist").iterdir())
    assert len(runs) == 1, runs
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["world_size"] == 4 and summary["global_steps"] == W1_SHORT_STEPS
    assert summary["test"]["accuracy"] >= W1_SHORT_ACCURACY_FLOOR, summary["test"]
    assert b.stderr.count("[rank") == 0, b.stderr[-2000:]  # rank 0 speaks, on node 0


def doctor_report(result: NodeResult) -> dict:
    """Rank 0's JSON report from the stdout of the node it ran on."""
    return json.loads(result.stdout)


@pytest.mark.timeout(300)
def test_doctor_reports_both_hosts_with_two_workers_each(netns_hosts: TwoHosts, tmp_path):
    a, b = run_on_two_hosts(
        netns_hosts,
        2,
        ["doctor", "json=true", "bandwidth_mib=1", "latency_iterations=5"],
        tmp_path,
        form="c10d",
        timeout=240,
    )

    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    # Only rank 0 prints the report; it runs on whichever node the c10d rendezvous made first.
    assert (a.stdout == "") != (b.stdout == ""), a.stdout + b.stdout
    first, second = (netns_hosts.a, netns_hosts.b) if a.stdout else (netns_hosts.b, netns_hosts.a)
    report = doctor_report(a if a.stdout else b)
    assert report["ok"] is True, report["problem"]
    env = report["environment"]
    assert (env["world_size"], env["num_nodes"], env["master_addr"]) == (4, 2, first.address)
    assert report["network"] == {
        "interface": first.interface,
        "address": first.address,
        "reason": "route to the master",
    }
    assert [(c["name"], c["ok"]) for c in report["checks"]] == [
        ("reach master", True),
        ("roll call", True),
        ("join process group", True),
        ("all_reduce", True),
    ]
    assert report["checks"][1]["detail"] == "4 of 4 workers arrived, on 2 host(s)"
    workers = [(w["rank"], w["node_rank"], w["interface"], w["address"]) for w in report["workers"]]
    assert workers == [
        (0, 0, first.interface, first.address),
        (1, 0, first.interface, first.address),
        (2, 1, second.interface, second.address),
        (3, 1, second.interface, second.address),
    ]
    stacks = [w["stack"] for w in report["workers"]]  # two network namespaces, one per host
    assert stacks[0] == stacks[1] != stacks[2] == stacks[3]
    assert [p["rank"] for p in report["peers"]] == [1, 2, 3]
    assert all(0 < p["latency_us"] < 1e6 and p["bandwidth_gbps"] > 0 for p in report["peers"]), report["peers"]


@pytest.mark.timeout(300)
def test_doctor_diagnoses_gloo_bound_to_loopback(netns_hosts: TwoHosts, tmp_path):
    env = worker_environment(GLOO_SOCKET_IFNAME="lo")
    a, b = run_on_two_hosts(netns_hosts, 1, ["doctor", "json=true", "timeout=20"], tmp_path, env=env, timeout=240)

    assert a.returncode != 0 and b.returncode != 0
    report = doctor_report(a)
    assert report["network"] == {"interface": "lo", "address": "127.0.0.1", "reason": "GLOO_SOCKET_IFNAME"}
    assert [c["name"] for c in report["checks"] if not c["ok"]] == ["roll call"]
    assert report["problem"].startswith(
        "rank 0 binds gloo to 127.0.0.1 (lo), a loopback address, but rank 1 on another host cannot connect to it"
    )
    assert "set GLOO_SOCKET_IFNAME to the interface whose address the other hosts reach" in report["problem"]
    # Rank 1 gets the same diagnosis from rank 0 and stops too, rather than hang in gloo.
    assert f"[rank 1/2] problem: {report['problem']}" in b.stderr


@pytest.mark.timeout(300)
def test_doctor_explains_c10d_rendezvous_without_local_addr(netns_hosts: TwoHosts, tmp_path):
    # Without --local-addr the workers learn MASTER_ADDR=localhost (see the module docstring). Nothing listens
    # there on rank 1's host and rank 1 never arrives on rank 0's: both give up after the timeout.
    a, b = run_on_two_hosts(
        netns_hosts, 1, ["doctor", "timeout=5"], tmp_path, form="c10d", local_addr=False, timeout=240
    )

    assert a.returncode != 0 and b.returncode != 0
    stderr = a.stderr + b.stderr
    problems = re.findall(r"\[rank 1/2\] problem: (.*)", stderr)
    assert len(problems) == 1, a.stderr[-3000:] + b.stderr[-3000:]
    problem = problems[0]
    assert problem.startswith("rank 1/2 cannot reach the master at localhost:")
    assert "MASTER_ADDR=localhost is a loopback address, but the job spans 2 nodes" in problem
    assert "pass --local-addr <this node's address> on every node" in problem
    assert "problem: rank 1 of 2 did not arrive at localhost:" in a.stdout + b.stdout


def watch_both(
    hosts: TwoHosts, argvs: Sequence[Sequence[str]], cwd: Path, *, timeout: float, env: dict[str, str]
) -> tuple[tuple[NodeResult, NodeResult], tuple[set, set]]:
    """Like :func:`run_both`; also the (address, port) of every listening TCP socket each host's process tree opened.

    psutil reads sockets from the namespace of the process that asks: each process's own
    /proc/PID/net/tcp and tcp6 are read instead, which show its namespace's.
    """
    procs, outputs = [], []
    for index, (host, argv) in enumerate(zip((hosts.a, hosts.b), argvs)):
        # Files, not pipes: nobody reads a pipe while the test polls, and a full one would stop the job.
        out, err = (open(cwd / f"node{index}.{name}", "w+") for name in ("out", "err"))
        outputs.append((out, err))
        procs.append(
            subprocess.Popen(
                host.command(list(argv)), cwd=cwd, env=env, stdout=out, stderr=err, text=True, start_new_session=True
            )
        )
    listening: tuple[set, set] = (set(), set())
    deadline = time.monotonic() + timeout
    try:
        while any(proc.poll() is None for proc in procs) and time.monotonic() < deadline:
            for proc, found in zip(procs, listening):
                for pid in _tree(proc.pid):
                    found |= _listening_in_namespace(pid)
            time.sleep(0.02)
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    results = []
    for proc, (out, err) in zip(procs, outputs):
        out.seek(0), err.seek(0)
        results.append(NodeResult(proc.returncode, out.read(), err.read()))
        out.close(), err.close()
    return (results[0], results[1]), listening


def _tree(pid: int) -> list[int]:
    try:
        return [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def _listening_in_namespace(pid: int) -> set[tuple[str, int]]:
    """(address, port) of the listening TCP sockets process ``pid`` holds, read in its own network namespace."""
    try:
        inodes = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        found = set()
        for name, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
            with open(f"/proc/{pid}/net/{name}") as table:
                for line in table.read().splitlines()[1:]:
                    fields = line.split()
                    if fields[3] == "0A" and f"socket:[{fields[9]}]" in inodes:  # 0A: TCP_LISTEN
                        address, port = fields[1].split(":")
                        found.add((_kernel_address(address, family), int(port, 16)))
        return found
    except OSError:  # the process ended meanwhile
        return set()


def _kernel_address(text: str, family: int) -> str:
    """An address as /proc/net/tcp* prints it: 32-bit words in hex, each in the host's byte order."""
    words = [bytes.fromhex(text[i : i + 8]) for i in range(0, len(text), 8)]
    return socket.inet_ntop(family, b"".join(word[::-1] if sys.byteorder == "little" else word for word in words))


@pytest.mark.timeout(300)
def test_a_two_node_run_listens_on_the_chosen_interface_or_loopback_only(netns_hosts: TwoHosts, tmp_path):
    # `ddpkit run nnodes=2` on each host, two workers each, a script that joins the group through ddpkit.init.
    (tmp_path / "script.py").write_text(WATCHED_SCRIPT)
    port = free_port()
    argvs = [
        [sys.executable, "-m", "ddpkit", "run", "nproc=2", "nnodes=2", f"node_rank={node_rank}", "show_ranks=all"]
        + [f"master_addr={netns_hosts.a.address}", f"master_port={port}", "script.py"]
        for node_rank in (0, 1)
    ]
    (a, b), listening = watch_both(netns_hosts, argvs, tmp_path, timeout=240, env=worker_environment())

    assert a.returncode == 0 and b.returncode == 0, a.stderr[-3000:] + b.stderr[-3000:]
    assert sorted(re.findall(r"rank \d sum 4", a.stdout + b.stdout)) == [f"rank {r} sum 4" for r in range(4)]
    assert (netns_hosts.a.address, port) in listening[0], listening  # node 0's store
    for host, found in zip(netns_hosts, listening):
        addresses = {address for address, _ in found}
        assert len(found) >= 2, found  # at least each worker's gloo pair
        assert addresses <= {host.address, *LOOPBACK}, f"{host.netns} listens beyond {host.address}: {found}"
