"""``ddpkit doctor``: what each worker sees, and whether the workers can reach each other.

Run it the way the training runs, as every worker of the job::

    ddpkit doctor                      # this process alone: environment, devices, how to run more
    ddpkit doctor nproc=2              # 2 workers on this machine
    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d --rdzv-endpoint HOST:PORT -m ddpkit doctor
    srun --nodes 2 --ntasks-per-node 4 python -m ddpkit doctor
    mpirun -np 8 python -m ddpkit doctor

Every worker resolves its environment (``ddpkit.env``) and the network
interface gloo will use, then runs the checks in the order training depends
on them. The first check that fails ends the run with a diagnosis that says
what to check:

1. reach the master: a TCP connection to MASTER_ADDR:MASTER_PORT, retried
   until ``timeout`` (rank 0 may start later than the others). Rank 0 first
   starts the rendezvous store there, unless torchrun's agent already runs it.
2. roll call: each worker writes its host, interface and address into that
   store; rank 0 waits for all of them, names the ranks missing, and checks
   that no worker binds gloo to a loopback address that workers on another
   host cannot reach. Rank 0 shares the outcome, so every worker stops or
   goes on together.
3. join the process group with ``ddpkit.init`` (gloo connects every pair of
   workers here, over the chosen interfaces).
4. all_reduce sanity: the sum of the ranks is ``n(n-1)/2`` on every rank.
5. measure, between rank 0 and each peer in turn: latency (ping-pong of
   4 bytes; half the round trip, as OSU's benchmark reports it) and
   bandwidth (``bandwidth_mib`` MiB each way: bytes / half the round trip);
   and the latency of a 4-byte all_reduce over all workers.

Rank 0 prints the report (as JSON with ``json=true``); the other workers
print only their problems, on stderr. The exit status is 0 when every check
passed on this worker (with ``nproc``: on every worker).

::

    rank 0 (hosts the store)          rank 1..n-1
    bind MASTER_PORT, store up        connect MASTER_ADDR:MASTER_PORT (retry)
    roll call: wait for all  <------  set doctor/arrived/<rank>
    set doctor/roll  --------------->  read it: stop on a problem
    ddpkit.init  <------ gloo ------>  ddpkit.init

Where each part lives:

- ``config``: DoctorConfig, the options.
- ``results``: the typed values the checks produce (Report and its parts)
  and DoctorProblem, the failure of a check.
- ``describe``: what this worker is (network interface, devices, backend).
- ``checks``: steps 1 to 4, each returning a Check or raising DoctorProblem.
- ``measure``: step 5, latency and bandwidth.
- ``diagnoses``: the plain-words explanations of failed checks.
- ``report``: the report as text, and who prints what.
- ``run``: one worker's whole run (``examine``); ``ddpkit doctor`` is :mod:`ddpkit.commands.doctor`.
"""

from ddpkit.doctor.checks import join, open_store, reach_master, roll_call, sanity_all_reduce
from ddpkit.doctor.config import DoctorConfig
from ddpkit.doctor.describe import choose_network, describe_devices, network_stack_id, resolved_backend, run_hints
from ddpkit.doctor.diagnoses import join_diagnosis, loopback_diagnosis, missing_diagnosis, unreachable_diagnosis
from ddpkit.doctor.measure import allreduce_latency, measure_peers
from ddpkit.doctor.report import format_report
from ddpkit.doctor.results import Check, Devices, DoctorProblem, NetworkChoice, PeerLink, Report, WorkerInfo
from ddpkit.doctor.run import examine
from ddpkit.env.torchrun import uses_agent_store

__all__ = [
    "Check",
    "Devices",
    "DoctorConfig",
    "DoctorProblem",
    "NetworkChoice",
    "PeerLink",
    "Report",
    "WorkerInfo",
    "allreduce_latency",
    "choose_network",
    "describe_devices",
    "examine",
    "format_report",
    "join",
    "join_diagnosis",
    "loopback_diagnosis",
    "measure_peers",
    "missing_diagnosis",
    "network_stack_id",
    "open_store",
    "reach_master",
    "resolved_backend",
    "roll_call",
    "run_hints",
    "sanity_all_reduce",
    "unreachable_diagnosis",
    "uses_agent_store",
]
