"""Lightning Trainer and Fabric scripts under ``ddpkit run``, with ddpkit's environment (DdpkitEnvironment)."""

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lightning")

import ddpkit  # noqa: E402
from ddpkit.errors import UserError  # noqa: E402
from ddpkit.integrations.lightning import DdpkitEnvironment  # noqa: E402
from tests.cli_runner import run_ddpkit  # noqa: E402

SCRIPTS = Path(__file__).parent / "scripts"


def first_global_batch() -> torch.Tensor:
    """The inputs of the first batch of the scripts' loader at world size 1 (their data, their seed)."""
    g = torch.Generator().manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 4, generator=g), torch.randn(64, 1, generator=g))
    x, _ = next(iter(ddpkit.DataLoader(data, global_batch_size=16, shuffle=True, rank=0, world_size=1)))
    return x


def assert_two_ranks_trained_alike(folder: Path, source: str) -> None:
    """The scripts' reports in ``folder``: 2 ranks detected from ``source``, ddpkit's sampler kept, each rank
    given its half of ddpkit's global batch, and the same final weights on both."""
    ranks = [torch.load(folder / f"rank-{r}.pt", weights_only=True) for r in (0, 1)]
    assert [(r["rank"], r["world_size"], r["source"]) for r in ranks] == [(0, 2, source), (1, 2, source)]
    assert all(r["loader_kept"] for r in ranks)  # Lightning left ddpkit's sampler in place
    # Each rank had its half of ddpkit's global batch: together, the batch a single process gets.
    assert torch.equal(torch.cat([r["first_batch"] for r in ranks]), first_global_batch())
    for name, weight in ranks[0]["weights"].items():
        assert torch.equal(weight, ranks[1]["weights"][name]), name


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lightning_trainer.py", "lightning_fabric.py"])
def test_a_lightning_script_under_ddpkit_run_trains_as_two_ranks_on_ddpkits_batches(script, tmp_path):
    out = run_ddpkit("run", "nproc=2", str(SCRIPTS / script), str(tmp_path), cwd=tmp_path, timeout=240)
    assert out.returncode == 0, out.stderr
    assert_two_ranks_trained_alike(tmp_path, source="torchrun")


def test_environment_reports_the_launchers_job_and_keeps_the_users_interface(monkeypatch):
    variables = dict(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", LOCAL_WORLD_SIZE="2", GROUP_RANK="1")
    for name, value in {**variables, "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29511"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")  # the user's choice stands
    env = DdpkitEnvironment()
    assert env.creates_processes_externally and DdpkitEnvironment.detect()
    assert (env.global_rank(), env.world_size(), env.local_rank(), env.node_rank()) == (3, 4, 1, 1)
    assert (env.main_address, env.main_port, env.devices, env.num_nodes) == ("10.1.2.3", 29511, 2, 2)
    env.set_global_rank(0)
    env.set_world_size(1)  # Lightning's own count does not override the launcher's
    assert (env.global_rank(), env.world_size()) == (3, 4)
    assert env.job.source == "torchrun"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth7"


def test_devices_that_contradict_the_launcher_are_refused_in_one_line(monkeypatch):
    for name, value in dict(RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29512")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    env = DdpkitEnvironment()
    env.validate_settings(num_devices=2, num_nodes=1)
    with pytest.raises(UserError) as error:
        env.validate_settings(num_devices=1, num_nodes=1)
    assert "\n" not in str(error.value)
    assert "devices=1, num_nodes=1 but the launcher (torchrun) started 2 processes per node on 1 node(s)" in str(
        error.value
    )
    assert "pass devices=env.devices, num_nodes=env.num_nodes" in str(error.value)


def test_a_single_process_is_not_detected_as_a_job(monkeypatch):
    import os

    from tests.helpers.launch_in_process import LAUNCHER_VARIABLES

    for name in list(os.environ):
        if name.startswith(LAUNCHER_VARIABLES):
            monkeypatch.delenv(name)
    assert not DdpkitEnvironment.detect()
    assert DdpkitEnvironment().world_size() == 1
