"""OpenMPI and MPICH/Hydra variables: recorded from real launchers, a live mpirun, and plain dicts."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.mpi import MPICHVariables, OpenMPIVariables
from ddpkit.env.ports import port_from_job_id
from tests.env._recorded import recorded


def openmpi_env(**overrides: str) -> dict[str, str]:
    """Rank 5 of mpirun -np 8 over 2 nodes, 4 per node, as OpenMPI 4 sets it."""
    env = {
        "OMPI_COMM_WORLD_RANK": "5",
        "OMPI_COMM_WORLD_SIZE": "8",
        "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
        "OMPI_COMM_WORLD_NODE_RANK": "1",
        "OMPI_MCA_orte_num_nodes": "2",
        "OMPI_MCA_ess_base_jobid": "2146435073",
        "PMIX_NAMESPACE": "2146435073",
        "PMIX_RANK": "5",
        "MASTER_ADDR": "node01",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_recorded_openmpi_ranks_resolve_consistently():
    for rank in (0, 1):
        env = recorded(f"openmpi_rank{rank}")
        assert OpenMPIVariables.from_env(env) == JobEnvironment(
            source="openmpi",
            rank=rank,
            local_rank=rank,
            world_size=2,
            local_world_size=2,
            node_rank=0,  # although OMPI_COMM_WORLD_NODE_RANK=1 on rank 1
            num_nodes=1,
            master_addr="127.0.0.1",
            master_port=port_from_job_id(env["PMIX_NAMESPACE"]),
        )


def test_multi_node_openmpi_with_master_addr():
    assert OpenMPIVariables.from_env(openmpi_env()) == JobEnvironment(
        source="openmpi",
        rank=5,
        local_rank=1,
        world_size=8,
        local_world_size=4,
        node_rank=1,
        num_nodes=2,
        master_addr="node01",
        master_port=port_from_job_id("2146435073"),
    )


def test_job_id_fallback_and_master_port_override():
    env = openmpi_env(PMIX_NAMESPACE="<unset>", OMPI_MCA_ess_base_jobid="77")
    assert OpenMPIVariables.from_env(env).master_port == port_from_job_id("77")
    assert OpenMPIVariables.from_env(openmpi_env(MASTER_PORT="4242")).master_port == 4242


def test_without_num_nodes_variable_nodes_are_assumed_even():
    resolved = OpenMPIVariables.from_env(openmpi_env(OMPI_MCA_orte_num_nodes="<unset>"))
    assert (resolved.node_rank, resolved.num_nodes) == (1, 2)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"MASTER_ADDR": "<unset>"},
            "^MASTER_ADDR is unset and openmpi does not tell where rank 0 runs in this 2-node job; "
            "pass it to every rank: mpirun -x MASTER_ADDR=<host of rank 0>$",
        ),
        (
            {"PMIX_NAMESPACE": "<unset>", "OMPI_MCA_ess_base_jobid": "<unset>"},
            "^MASTER_PORT is unset and openmpi exports no job id to derive it from; "
            "pass it to every rank: mpirun -x MASTER_PORT=29500$",
        ),
        (
            # --map-by node: rank 5 is the third process of node 1.
            {"OMPI_COMM_WORLD_LOCAL_RANK": "2"},
            "^OMPI_COMM_WORLD_RANK=5 has OMPI_COMM_WORLD_LOCAL_RANK=2, so ranks are not placed in "
            "consecutive blocks of OMPI_COMM_WORLD_LOCAL_SIZE=4 per node; place them with "
            "mpirun --map-by ppr:N:node$",
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "7", "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_COMM_WORLD_RANK": "4"},
            "^OMPI_COMM_WORLD_LOCAL_SIZE=3 processes on this node do not divide OMPI_COMM_WORLD_SIZE=7 "
            r"evenly over OMPI_MCA_orte_num_nodes=2 nodes; start the same number of processes on every "
            r"node \(mpirun --map-by ppr:N:node\)$",
        ),
        (
            {"OMPI_COMM_WORLD_SIZE": "7", "OMPI_COMM_WORLD_LOCAL_SIZE": "3", "OMPI_MCA_orte_num_nodes": "<unset>"},
            "^OMPI_COMM_WORLD_LOCAL_SIZE=3 processes on this node do not divide OMPI_COMM_WORLD_SIZE=7 "
            "evenly over OMPI_COMM_WORLD_SIZE // OMPI_COMM_WORLD_LOCAL_SIZE=2 nodes",
        ),
        (
            {"OMPI_COMM_WORLD_RANK": "8"},
            "^OMPI_COMM_WORLD_RANK=8 is not below OMPI_COMM_WORLD_SIZE=8; start the job with mpirun$",
        ),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "4"},
            "^OMPI_COMM_WORLD_LOCAL_RANK=4 is not below OMPI_COMM_WORLD_LOCAL_SIZE=4",
        ),
        (
            {"OMPI_COMM_WORLD_LOCAL_SIZE": "<unset>"},
            "^OMPI_COMM_WORLD_LOCAL_SIZE is unset; start the job with mpirun$",
        ),
        ({"OMPI_COMM_WORLD_SIZE": "eight"}, "^OMPI_COMM_WORLD_SIZE='eight' is not an integer"),
    ],
)
def test_inconsistent_openmpi_variables_name_the_variable_and_the_fix(overrides, message):
    with pytest.raises(InconsistentEnvironment, match=message):
        OpenMPIVariables.from_env(openmpi_env(**overrides))


def test_recorded_mpich_needs_master_port():
    env = recorded("mpich_rank1")
    assert MPICHVariables.detect(env)
    with pytest.raises(
        InconsistentEnvironment,
        match="^MASTER_PORT is unset and mpich exports no job id to derive it from; "
        "pass it to every rank: mpiexec -genv MASTER_PORT 29500$",
    ):
        MPICHVariables.from_env(env)
    assert MPICHVariables.from_env({**env, "MASTER_PORT": "29500"}) == JobEnvironment(
        source="mpich",
        rank=1,
        local_rank=1,
        world_size=2,
        local_world_size=2,
        node_rank=0,
        num_nodes=1,
        master_addr="127.0.0.1",
        master_port=29500,
    )


def test_multi_node_mpich_needs_master_addr():
    env = {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "MASTER_PORT": "1"}
    message = "pass it to every rank: mpiexec -genv MASTER_ADDR <host of rank 0>$"
    with pytest.raises(InconsistentEnvironment, match=message):
        MPICHVariables.from_env(env)
    resolved = MPICHVariables.from_env({**env, "MASTER_ADDR": "n1"})
    assert (resolved.node_rank, resolved.num_nodes, resolved.master_addr) == (1, 2, "n1")


def test_srun_pmi2_is_not_mpich():
    # srun --mpi=pmi2 sets PMI_RANK and PMI_SIZE but not Hydra's MPI_LOCALRANKID.
    assert not MPICHVariables.detect({"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "5"})
    assert not OpenMPIVariables.detect(recorded("mpich_rank0"))
    assert not MPICHVariables.detect(recorded("openmpi_rank0"))


# One write per rank (os.write of the whole line, atomic on a pipe): print() may write the text and
# its newline apart (unbuffered output), and the two ranks' lines then interleave.
_PRINT_ENVIRONMENT = (
    "import dataclasses, json, os; from ddpkit.env.detect import detect_environment; "
    "os.write(1, (json.dumps(dataclasses.asdict(detect_environment(os.environ))) + '\\n').encode())"
)


@pytest.mark.cluster
def test_real_mpirun_ranks_resolve_consistently():
    assert shutil.which("mpirun"), "openmpi-bin is required: apt-get install openmpi-bin"
    result = subprocess.run(
        ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-c", _PRINT_ENVIRONMENT],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    resolved = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda e: e["rank"])
    assert [(e["rank"], e["local_rank"]) for e in resolved] == [(0, 0), (1, 1)]
    for e in resolved:
        assert e["source"] == "openmpi"
        assert (e["world_size"], e["local_world_size"], e["node_rank"], e["num_nodes"]) == (2, 2, 0, 1)
        assert e["master_addr"] == "127.0.0.1"
        assert 10000 <= e["master_port"] < 30000
    assert resolved[0]["master_port"] == resolved[1]["master_port"]
