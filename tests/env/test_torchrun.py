"""torchrun / env:// variables, on plain dicts and from a real torchrun."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from ddpkit.env.base import InconsistentEnvironment, JobEnvironment
from ddpkit.env.torchrun import TorchrunVariables


def torchrun_env(**overrides: str) -> dict[str, str]:
    """Worker 3 of 2 nodes x 2, as torchrun sets it on the second node."""
    env = {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "1",
        "GROUP_WORLD_SIZE": "2",
        "ROLE_RANK": "3",
        "ROLE_WORLD_SIZE": "4",
        "MASTER_ADDR": "node01",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "none",
    }
    env.update(overrides)
    return {k: v for k, v in env.items() if v != "<unset>"}


def test_from_env_reads_every_variable():
    assert TorchrunVariables.from_env(torchrun_env()) == JobEnvironment(
        source="torchrun",
        rank=3,
        local_rank=1,
        world_size=4,
        local_world_size=2,
        node_rank=1,
        num_nodes=2,
        master_addr="node01",
        master_port=29500,
    )


def test_uneven_nodes_use_group_world_size():
    # Node 1 of 2 runs 1 worker, node 0 runs 2: LOCAL_WORLD_SIZE does not divide WORLD_SIZE.
    env = torchrun_env(RANK="2", WORLD_SIZE="3", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    resolved = TorchrunVariables.from_env(env)
    assert (resolved.node_rank, resolved.num_nodes, resolved.local_world_size) == (1, 2, 1)


def test_without_group_variables_nodes_are_assumed_even():
    env = torchrun_env(GROUP_RANK="<unset>", GROUP_WORLD_SIZE="<unset>", RANK="5", WORLD_SIZE="8")
    resolved = TorchrunVariables.from_env(env)
    assert (resolved.node_rank, resolved.num_nodes) == (2, 4)


def test_detect_on_rank_or_world_size():
    assert TorchrunVariables.detect(torchrun_env())
    assert TorchrunVariables.detect({"WORLD_SIZE": "2"})
    assert TorchrunVariables.detect({"RANK": "0"})
    assert not TorchrunVariables.detect({"MASTER_ADDR": "x", "MASTER_PORT": "1", "LOCAL_RANK": "0"})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"RANK": "<unset>"}, "^RANK is unset; start the job with torchrun"),
        ({"LOCAL_WORLD_SIZE": "<unset>"}, "^LOCAL_WORLD_SIZE is unset; "),
        ({"MASTER_ADDR": "<unset>"}, "^MASTER_ADDR is unset; "),
        ({"MASTER_PORT": "<unset>"}, "^MASTER_PORT is unset; "),
        ({"MASTER_PORT": "70000"}, r"^MASTER_PORT=70000 is not a TCP port; set MASTER_PORT to a TCP port in 1\.\."),
        ({"MASTER_PORT": "0"}, "^MASTER_PORT='0' must be at least 1"),
        ({"RANK": "three"}, "^RANK='three' is not an integer; "),
        ({"RANK": " 3"}, "^RANK=' 3' is not an integer; "),
        ({"RANK": "-1"}, "^RANK='-1' must be at least 0; "),
        ({"WORLD_SIZE": "0"}, "^WORLD_SIZE='0' must be at least 1; "),
        ({"RANK": "4"}, "^RANK=4 is not below WORLD_SIZE=4; "),
        ({"LOCAL_RANK": "2"}, "^LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2; "),
        ({"GROUP_RANK": "2"}, "^GROUP_RANK=2 is not below GROUP_WORLD_SIZE=2; "),
        ({"LOCAL_WORLD_SIZE": "8"}, "^LOCAL_WORLD_SIZE=8 exceeds WORLD_SIZE=4; "),
        (
            {"WORLD_SIZE": "5", "GROUP_WORLD_SIZE": "<unset>"},
            "^LOCAL_WORLD_SIZE=2 does not divide WORLD_SIZE=5 and GROUP_WORLD_SIZE is unset; set GROUP_RANK",
        ),
    ],
)
def test_inconsistent_variables_name_the_variable_and_the_fix(overrides, message):
    with pytest.raises(InconsistentEnvironment, match=message) as raised:
        TorchrunVariables.from_env(torchrun_env(**overrides))
    assert "\n" not in str(raised.value)


_PRINT_ENVIRONMENT = """
import dataclasses, json, os
from ddpkit.env.detect import detect_environment
# One write of the whole line (under PIPE_BUF bytes): the two workers' lines never interleave.
os.write(1, (json.dumps(dataclasses.asdict(detect_environment(os.environ))) + "\\n").encode())
"""


@pytest.mark.slow
def test_real_torchrun_workers_resolve_consistently(tmp_path):
    script = tmp_path / "print_environment.py"
    script.write_text(_PRINT_ENVIRONMENT)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    resolved = sorted((json.loads(line) for line in result.stdout.splitlines()), key=lambda e: e["rank"])
    assert [e["rank"] for e in resolved] == [0, 1]
    assert [e["local_rank"] for e in resolved] == [0, 1]
    for e in resolved:
        assert e["source"] == "torchrun"
        assert (e["world_size"], e["local_world_size"], e["node_rank"], e["num_nodes"]) == (2, 2, 0, 1)
    assert resolved[0]["master_addr"] == resolved[1]["master_addr"]
    assert resolved[0]["master_port"] == resolved[1]["master_port"]
