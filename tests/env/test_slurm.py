"""Slurm variables: recorded from a real sbatch/srun/salloc, and multi-node cases on plain dicts."""

from __future__ import annotations

import pytest

from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.slurm import SlurmVariables, parse_tasks_per_node
from tests.env._recorded import recorded


def step_env(**overrides: str) -> dict[str, str]:
    """Task 6 of an srun step of 7 tasks on 4 nodes, 2 tasks on each of the first 3."""
    env = {
        "SLURM_JOB_ID": "123456",
        "SLURM_JOBID": "123456",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "6",
        "SLURM_NTASKS": "7",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "3",
        "SLURM_NNODES": "4",
        "SLURM_STEP_NUM_NODES": "4",
        "SLURM_JOB_NUM_NODES": "4",
        "SLURM_TASKS_PER_NODE": "2(x3),1",
        "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
        "SLURM_NODELIST": "gpu[07-09],cpu1",
        "SLURM_STEP_NODELIST": "gpu[07-09],cpu1",
        "SLURM_JOB_NODELIST": "gpu[07-09],cpu1",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_recorded_srun_tasks_resolve_consistently():
    ranks = [SlurmVariables.from_env(recorded(f"slurm_srun_rank{r}")) for r in (0, 1)]
    for rank, resolved in enumerate(ranks):
        assert resolved == JobEnvironment(
            source="slurm",
            rank=rank,
            local_rank=rank,
            world_size=2,
            local_world_size=2,
            node_rank=0,
            num_nodes=1,
            master_addr="vm",
            master_port=10001,  # SLURM_JOB_ID=1
        )


@pytest.mark.parametrize(
    ("name", "is_task"),
    [
        ("slurm_srun_rank0", True),
        ("slurm_srun_rank1", True),
        # SLURM_PROCID=0 and SLURM_NTASKS=2, but no SLURM_STEP_ID: the script, not a task.
        ("slurm_batch_shell", False),
        ("slurm_salloc_shell", False),
        # SLURM_STEP_ID=4294967290: salloc's interactive shell.
        ("slurm_interactive_step", False),
    ],
)
def test_detect_only_srun_tasks(name, is_task):
    assert SlurmVariables.detect(recorded(name)) is is_task


def test_multi_node_step():
    assert SlurmVariables.from_env(step_env()) == JobEnvironment(
        source="slurm",
        rank=6,
        local_rank=0,
        world_size=7,
        local_world_size=1,
        node_rank=3,
        num_nodes=4,
        master_addr="gpu07",
        master_port=10000 + 123456 % 20000,
    )


def test_step_values_win_over_the_jobs():
    # srun -N1 -n1 inside a 2-node job started with --ntasks-per-node=2: the job's
    # SLURM_NTASKS_PER_NODE leaks into the step; the step's own variables describe it.
    env = {
        "SLURM_JOB_ID": "5",
        "SLURM_STEP_ID": "3",
        "SLURM_PROCID": "0",
        "SLURM_NTASKS": "1",
        "SLURM_LOCALID": "0",
        "SLURM_NODEID": "0",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_STEP_NUM_NODES": "1",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_STEP_TASKS_PER_NODE": "1",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "SLURM_STEP_NODELIST": "n2",
    }
    resolved = SlurmVariables.from_env(env)
    assert (resolved.world_size, resolved.local_world_size, resolved.num_nodes) == (1, 1, 1)
    assert resolved.master_addr == "n2"


def test_ntasks_per_node_alone_gives_every_node_the_same_count():
    env = step_env(
        SLURM_STEP_TASKS_PER_NODE="<unset>",
        SLURM_TASKS_PER_NODE="<unset>",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NTASKS="8",
        SLURM_PROCID="7",
        SLURM_LOCALID="1",
    )
    resolved = SlurmVariables.from_env(env)
    assert (resolved.local_world_size, resolved.node_rank, resolved.num_nodes) == (2, 3, 4)


def test_nodelist_fallbacks():
    env = step_env(SLURM_STEP_NODELIST="<unset>", SLURM_NODELIST="<unset>", SLURM_JOB_NODELIST="a[3-6]")
    assert SlurmVariables.from_env(env).master_addr == "a3"


def test_master_addr_and_port_overrides():
    env = step_env(MASTER_ADDR="10.1.2.3", MASTER_PORT="4242", SLURM_JOB_ID="<unset>")
    resolved = SlurmVariables.from_env(env)
    assert (resolved.master_addr, resolved.master_port) == ("10.1.2.3", 4242)


def test_single_node_without_tasks_per_node():
    env = {
        "SLURM_STEP_ID": "0",
        "SLURM_JOB_ID": "7",
        "SLURM_PROCID": "1",
        "SLURM_NTASKS": "3",
        "SLURM_LOCALID": "1",
        "SLURM_NODEID": "0",
        "SLURM_NNODES": "1",
        "SLURM_NODELIST": "solo",
    }
    assert SlurmVariables.from_env(env).local_world_size == 3


@pytest.mark.parametrize(
    ("value", "counts"),
    [("1", [1]), ("4(x2)", [4, 4]), ("2(x3),1", [2, 2, 2, 1]), ("1,3(x2),2", [1, 3, 3, 2])],
)
def test_parse_tasks_per_node(value, counts):
    assert parse_tasks_per_node(value) == counts


@pytest.mark.parametrize("value", ["", "2(x", "2x3", "(x3)", "2(x3)1", "a", "2,,1"])
def test_parse_tasks_per_node_rejects(value):
    with pytest.raises(InconsistentEnvironment, match=r"is not a tasks-per-node list such as '2\(x3\),1'"):
        parse_tasks_per_node(value)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"SLURM_STEP_TASKS_PER_NODE": "<unset>", "SLURM_TASKS_PER_NODE": "<unset>"},
            "^SLURM_NTASKS=7 on 4 nodes but SLURM_TASKS_PER_NODE and SLURM_NTASKS_PER_NODE are unset; "
            "pass --ntasks-per-node",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "2(x4)"},
            r"^SLURM_STEP_TASKS_PER_NODE='2\(x4\)' does not spread SLURM_NTASKS=7 over SLURM_STEP_NUM_NODES=4",
        ),
        (
            {"SLURM_STEP_TASKS_PER_NODE": "2(x2),3"},
            r"does not spread SLURM_NTASKS=7 over SLURM_STEP_NUM_NODES=4 nodes",
        ),
        ({"SLURM_PROCID": "7"}, "^SLURM_PROCID=7 is not below SLURM_NTASKS=7; start the workers with srun"),
        ({"SLURM_NODEID": "4"}, "^SLURM_NODEID=4 is not below SLURM_STEP_NUM_NODES=4"),
        ({"SLURM_LOCALID": "1"}, r"^SLURM_LOCALID=1 is not below SLURM_STEP_TASKS_PER_NODE=1"),
        ({"SLURM_LOCALID": "<unset>"}, "^SLURM_LOCALID is unset; start the workers with srun"),
        ({"SLURM_NTASKS": "4x"}, "^SLURM_NTASKS='4x' is not an integer"),
        ({"SLURM_JOB_ID": "<unset>"}, "^SLURM_JOB_ID is unset"),
        (
            {"SLURM_STEP_NODELIST": "gpu[07-09"},
            r"^SLURM_STEP_NODELIST: unclosed '\[' in hostlist 'gpu\[07-09'; .*or set MASTER_ADDR",
        ),
        ({"SLURM_STEP_NODELIST": ""}, "^SLURM_STEP_NODELIST is empty; .*or set MASTER_ADDR"),
        ({"MASTER_PORT": "http"}, "^MASTER_PORT='http' is not an integer"),
    ],
)
def test_inconsistent_variables_name_the_variable_and_the_fix(overrides, message):
    with pytest.raises(InconsistentEnvironment, match=message) as raised:
        SlurmVariables.from_env(step_env(**overrides))
    assert "\n" not in str(raised.value)
