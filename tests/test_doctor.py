"""``ddpkit doctor``: the report, the diagnoses, and real runs of one and two workers."""

from __future__ import annotations

import json
import os
import re
import socket
from datetime import timedelta

import pytest
import torch

from ddpkit.commands import dispatch as cli
from ddpkit.commands.doctor import doctor_command as main
from ddpkit.doctor import (
    Check,
    Devices,
    DoctorConfig,
    DoctorProblem,
    NetworkChoice,
    PeerLink,
    Report,
    WorkerInfo,
    choose_network,
    format_report,
    join_diagnosis,
    loopback_diagnosis,
    missing_diagnosis,
    network_stack_id,
    reach_master,
)
from ddpkit.env.base import JobEnvironment
from ddpkit.env.ports import free_port
from ddpkit.keyvalue import ConfigError, parse
from tests.helpers.launch_in_process import Commands


def environment(
    rank: int = 0, world_size: int = 2, num_nodes: int = 1, master_addr: str = "10.0.0.1", master_port: int = 29500
) -> JobEnvironment:
    per_node = world_size // num_nodes
    return JobEnvironment(
        "torchrun", rank, rank % per_node, world_size, per_node, rank // per_node, num_nodes, master_addr, master_port
    )


def worker(rank: int, address: str, stack: str, interface: str = "eth0") -> WorkerInfo:
    return WorkerInfo(rank, rank, 0, f"node{rank}", interface, address, stack, 1000 + rank)


# -- options and pure pieces ---------------------------------------------------


def test_config_from_words():
    cfg = parse(DoctorConfig, ["json=true", "nproc=3", "timeout=5", "bandwidth_mib=4"])
    assert (cfg.json, cfg.nproc, cfg.timeout, cfg.bandwidth_mib) == (True, 3, 5.0, 4)


@pytest.mark.parametrize(
    "word, message",
    [
        ("nproc=0", "nproc=0 is not valid; it must be > 0"),
        ("master_port=70000", "master_port=70000 is not a TCP port"),
        ("jsn=true", "unknown config key 'jsn' (did you mean 'json'?)"),
    ],
)
def test_bad_options_name_the_problem(word, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        parse(DoctorConfig, [word])


def test_network_choice_follows_gloo_socket_ifname_then_the_route():
    chosen = choose_network({"GLOO_SOCKET_IFNAME": "lo"}, "10.0.0.1")
    assert chosen == NetworkChoice("lo", "127.0.0.1", "GLOO_SOCKET_IFNAME")
    assert choose_network({}, "127.0.0.1") == NetworkChoice("lo", "127.0.0.1", "route to the master")


def test_network_stack_id_is_stable_in_one_process():
    assert network_stack_id() == network_stack_id() != ""


def test_missing_ranks_are_named_with_what_to_check():
    present = [worker(0, "10.0.0.1", "a"), worker(1, "10.0.0.2", "b"), worker(4, "10.0.0.3", "c")]
    text = missing_diagnosis(environment(world_size=5), [2, 3], present, timeout=30)
    assert text.startswith("ranks 2-3 of 5 did not arrive at 10.0.0.1:29500 within 30s (3 arrived, from ")
    assert "check that the missing workers were started with the same world size, master address and port" in text
    assert missing_diagnosis(environment(world_size=2), [1], present[:1], 30).startswith("rank 1 of 2 did not arrive")


def test_loopback_gloo_address_is_a_problem_only_across_hosts():
    env = environment(num_nodes=2)
    across = [worker(0, "127.0.0.1", "host-a", "lo"), worker(1, "10.0.0.2", "host-b")]
    text = loopback_diagnosis(env, across)
    assert text.startswith("rank 0 binds gloo to 127.0.0.1 (lo), a loopback address, but rank 1 on another host")
    assert "GLOO_SOCKET_IFNAME" in text and "ip route get" in text
    # Two "nodes" that share one network stack reach each other over loopback.
    assert loopback_diagnosis(env, [worker(0, "127.0.0.1", "same", "lo"), worker(1, "127.0.0.1", "same", "lo")]) == ""
    assert loopback_diagnosis(env, [worker(0, "10.0.0.1", "host-a"), worker(1, "10.0.0.2", "host-b")]) == ""


def test_gloo_connection_failure_names_every_address_and_the_fix():
    # The error ddpkit.init raises when gloo's connectFullMesh fails (as seen across two hosts).
    error = (
        "rank 0/2 could not join the process group at 10.0.0.1:29500 (torchrun): Gloo connectFullMesh failed "
        "with [pair.cc:152] timed out connecting: SO_ERROR: Connection refused, remote=[10.0.0.9]:35218"
    )
    workers = [worker(0, "10.0.0.1", "a"), worker(1, "10.0.0.9", "b", interface="eth1")]
    text = join_diagnosis(environment(), error, workers)
    assert text.startswith("rank 0/2: gloo could not connect the workers to each other (rank 0/2 could not join")
    assert "rank 0 10.0.0.1 (eth0), rank 1 10.0.0.9 (eth1)" in text
    assert "Check the routes between the hosts (`ip route get <peer address>` on each)" in text
    assert text.endswith("or set GLOO_SOCKET_IFNAME to the interface that reaches the other hosts")
    # Other failures keep the error's first line.
    assert join_diagnosis(environment(rank=1), "wait timeout after 30000ms\nmore", workers) == (
        "rank 1/2 could not join the process group: wait timeout after 30000ms"
    )


def test_unreachable_master_names_address_port_and_what_to_check():
    port = free_port()  # nothing listens there: connections are refused at once
    with pytest.raises(DoctorProblem) as caught:
        reach_master(environment(rank=1, master_addr="127.0.0.1", master_port=port), timeout=0.5)
    assert caught.value.check == "reach master"
    assert str(caught.value).startswith(
        f"rank 1/2 cannot reach the master at 127.0.0.1:{port} within 0.5s: connection refused"
    )
    assert f"MASTER_PORT={port} is the same on every worker" in str(caught.value)


def test_loopback_master_of_a_multi_node_job_mentions_torchrun_local_addr():
    port = free_port()
    with pytest.raises(DoctorProblem, match="--local-addr"):
        reach_master(environment(rank=1, num_nodes=2, master_addr="localhost", master_port=port), timeout=0.3)


def test_unresolvable_master_says_to_fix_the_name():
    with pytest.raises(DoctorProblem, match="cannot resolve MASTER_ADDR='no-such-host.invalid'"):
        reach_master(environment(rank=1, master_addr="no-such-host.invalid"), timeout=5)


def test_reach_master_connects_to_a_listening_port():
    with socket.create_server(("127.0.0.1", 0)) as server:
        check = reach_master(environment(rank=1, master_addr="127.0.0.1", master_port=server.getsockname()[1]), 5)
    assert check.ok and check.name == "reach master"


def sample_report() -> Report:
    env = environment(num_nodes=2)
    report = Report(
        env,
        "node0",
        NetworkChoice("eth0", "10.0.0.1", "route to the master"),
        "gloo",
        Devices(8, 4, (), "2.13.0+cpu", True, False),
    )
    report.checks = [Check("reach master", True, "TCP connect to 10.0.0.1:29500", 0.002)]
    report.workers = [worker(0, "10.0.0.1", "a"), worker(1, "10.0.0.2", "b")]
    report.peers = [PeerLink(1, 150.0, 140.0, 300.0, 1.25, 1.0, 1.5)]
    report.allreduce_latency_us = 200.0
    return report


def test_text_report_has_environment_devices_and_peer_table():
    text = format_report(sample_report())
    assert "environment   torchrun: rank 0 of world_size 2, local rank 0 of 1, node 0 of 2" in text
    assert "master        10.0.0.1:29500" in text
    assert "interface     eth0 10.0.0.1 (routes to the master)" in text
    assert "devices       8 CPUs (4 usable), no CUDA device, torch 2.13.0+cpu" in text
    assert "ok    reach master: TCP connect to 10.0.0.1:29500 (2.0 ms)" in text
    table = text[text.index("workers") :].splitlines()
    assert table[1].split() == ["rank", "node", "host", "interface", "address", "latency", "us", "bandwidth", "GB/s"]
    assert table[3].split() == ["1", "1", "node1", "eth0", "10.0.0.2", "150", "1.25"]
    assert text.endswith("result: OK")


def test_json_report_is_plain_data():
    data = json.loads(json.dumps(sample_report().to_dict()))
    assert data["ok"] is True
    assert data["environment"]["world_size"] == 2 and data["network"]["interface"] == "eth0"
    assert data["peers"][0] == {
        "rank": 1,
        "latency_us": 150.0,
        "latency_us_min": 140.0,
        "latency_us_max": 300.0,
        "bandwidth_gbps": 1.25,
        "bandwidth_gbps_min": 1.0,
        "bandwidth_gbps_max": 1.5,
    }


# -- real runs ------------------------------------------------------------------


def test_doctor_alone_in_process_as_json(capsys):
    assert main(["json=true"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is True
    assert (report["environment"]["source"], report["environment"]["world_size"]) == ("local", 1)
    assert [(c["name"], c["ok"]) for c in report["checks"]] == [("join process group", True), ("all_reduce", True)]
    assert report["devices"]["usable_cpus"] == len(os.sched_getaffinity(0))
    assert report["peers"] == [] and len(report["hints"]) == 4


def test_doctor_alone_reports_one_process_and_how_to_run_more(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor"]) == 0  # in-process: tests/test_cli.py checks the command's exit path
    out = capsys.readouterr().out
    assert "environment   local: rank 0 of world_size 1" in out
    assert "ok    all_reduce: sum of ranks 0 == 0" in out
    for hint in (
        "ddpkit doctor nproc=2",
        "torchrun --nnodes N",
        "-m ddpkit doctor",
        "srun --nodes N --ntasks-per-node K python -m ddpkit doctor",
        "mpirun -np N python -m ddpkit doctor",
    ):
        assert hint in out
    assert out.rstrip().endswith("result: OK")


def test_doctor_bad_option_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["doctor", "timeout=-1"]) == 2  # in-process: tests/test_cli.py checks the command's exit path
    assert capsys.readouterr().err == "error: timeout=-1.0 is not valid; it must be > 0\n"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_doctor_without_cuda_refuses_cuda_before_starting_workers():
    with pytest.raises(ValueError, match="device=cuda but CUDA is not available here; use device=cpu or device=auto"):
        main(["nproc=2", "device=cuda"])


@pytest.mark.slow
def test_doctor_two_local_workers_as_json(tmp_path):
    with Commands() as commands:  # in this process, the workers forked from the worker server as the command does
        out = commands.run("doctor", "nproc=2", "json=true", "bandwidth_mib=1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["ok"] is True and report["problem"] == ""
    assert report["environment"]["world_size"] == 2 and report["environment"]["rank"] == 0
    assert [c["name"] for c in report["checks"]] == ["reach master", "roll call", "join process group", "all_reduce"]
    assert [(w["rank"], w["address"]) for w in report["workers"]] == [(0, "127.0.0.1"), (1, "127.0.0.1")]
    (peer,) = report["peers"]
    assert peer["rank"] == 1 and peer["latency_us"] > 0 and peer["bandwidth_gbps"] > 0
    assert report["allreduce_latency_us"] > 0


@pytest.fixture
def doctor_as(monkeypatch, capsys):
    """``ddpkit doctor WORDS`` in this process as rank ``rank`` of 2 with the env:// variables (master on
    127.0.0.1:``port``) and no agent store, as under srun or mpirun: its (exit status, stdout, stderr)."""

    def run(rank: int, port: int, *words: str) -> tuple[int, str, str]:
        for name in list(os.environ):
            if name.startswith(("TORCHELASTIC_", "SLURM_", "OMPI_", "PMI")):
                monkeypatch.delenv(name)
        for name, value in {
            "RANK": rank,
            "LOCAL_RANK": rank,
            "WORLD_SIZE": 2,
            "LOCAL_WORLD_SIZE": 2,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
        }.items():
            monkeypatch.setenv(name, str(value))
        capsys.readouterr()
        code = cli.main(["doctor", *words])
        out, err = capsys.readouterr()
        return code, out, err

    return run


def test_rank_zero_alone_names_the_missing_rank(doctor_as):
    port = free_port()
    code, out, _ = doctor_as(0, port, "timeout=1")  # rank 1 is waited for that long
    assert code == 1
    assert "ok    reach master: TCP connect to 127.0.0.1:" in out
    assert "FAIL  roll call" in out
    assert f"problem: rank 1 of 2 did not arrive at 127.0.0.1:{port} within 1s (1 arrived, from " in out


def test_rank_one_without_a_master_says_what_to_check(doctor_as):
    port = free_port()
    code, out, err = doctor_as(1, port, "timeout=1")  # the master is retried that long
    assert code == 1
    assert out == ""  # only rank 0 prints the report
    assert err.startswith(
        f"[rank 1/2] problem: rank 1/2 cannot reach the master at 127.0.0.1:{port} within 1s: connection refused"
    )
    assert "check that rank 0 is running" in err


def test_master_port_taken_on_rank_zero(doctor_as):
    with socket.create_server(("", 0)) as taken:
        port = taken.getsockname()[1]
        code, out, _ = doctor_as(0, port, "timeout=2", "json=true")
    assert code == 1
    report = json.loads(out)
    assert report["ok"] is False
    assert report["problem"].startswith(f"rank 0 cannot listen on port {port}: it is taken")
    assert report["checks"][-1]["name"] == "rendezvous store" and not report["checks"][-1]["ok"]


def test_rank_zero_s_store_listens_on_the_master_s_address_only_and_init_shares_it():
    import psutil

    from ddpkit.doctor.checks import open_store
    from ddpkit.process_group import job_store

    port = free_port()
    env = environment(rank=0, world_size=1, master_addr="127.0.0.1", master_port=port)
    store, _ = open_store(env, {}, timeout=5)
    listening = {
        c.laddr.ip
        for c in psutil.Process().net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert listening == {"127.0.0.1"}  # torch's own store server listens on every address ("::" or 0.0.0.0)
    store.set("roll call", "done")
    shared = job_store(env, timedelta(seconds=5))  # what ddpkit.init does next in the same process
    assert shared.get("roll call") == b"done"
