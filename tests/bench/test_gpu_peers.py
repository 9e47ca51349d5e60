"""benchmarks/gpu_peers.py (T11: torch + DDP, ddpkit and Accelerate on one GPU): the smoke run and its parts.

The figures come from a GPU machine; here ``--smoke`` trains both models with
tiny sizes on the CPU (gloo), each peer as a whole process under its own
launcher, and the report is checked for what it must hold. Accelerate is
skipped with a note where it is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli_runner import PYTHONPATH

BENCHMARK = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_peers.py"
PHASES = ["launch", "imports", "cuda_init", "process_group", "setup", "first_batch", "first_step"]


def _module():
    spec = importlib.util.spec_from_file_location("gpu_peers", BENCHMARK)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def smoke(tmp_path_factory) -> tuple[dict, str, subprocess.CompletedProcess]:
    folder = tmp_path_factory.mktemp("gpu-peers")
    out = subprocess.run(
        [sys.executable, str(BENCHMARK), "--smoke", "--output-dir", str(folder)],
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-5000:]
    (json_path,) = folder.glob("gpu-peers-*-smoke.json")
    return json.loads(json_path.read_text()), json_path.with_suffix(".md").read_text(), out


@pytest.mark.slow
def test_the_smoke_run_trains_every_model_with_every_installed_peer_and_reports_them(smoke):
    report, markdown, _ = smoke
    installed = importlib.util.find_spec("accelerate") is not None
    peers = {"torch", "ddpkit"} | ({"accelerate"} if installed else set())
    assert report["config"]["device"] == "cpu" and report["failures"] == []
    assert set(report["summary"]) == {"resnet18", "mlp"}
    for model, result in report["summary"].items():
        assert set(result["peers"]) == peers, model
        for value in result["peers"].values():
            assert value["images_per_s"]["median"] > 0 and value["time_to_first_step_s"]["median"] > 0
            assert list(value["startup_phases_s"]) == PHASES
            assert value["checkpoint_bytes"] > 0  # a checkpoint at every epoch end, as each peer's users save
        assert result["ratio_ddpkit_over_best_peer"] > 0
        assert f"## {model}" in markdown
    assert {run["peer"] for run in report["runs"]} == peers
    assert all(run["timed_images"] == 256 for run in report["runs"])  # epoch 1 of 2: the warm-up is not timed
    assert "ddpkit / best peer" in markdown and "torch + DDP (torchrun)" in markdown


@pytest.mark.slow
def test_accelerate_missing_is_skipped_with_a_note(smoke):
    report, markdown, out = smoke
    if importlib.util.find_spec("accelerate") is not None:
        pytest.skip("Accelerate is installed here")
    assert "not installed" in report["skipped"]["accelerate"]
    assert "Skipped: Accelerate" in markdown and "skipping accelerate" in out.stderr


def test_each_peer_is_started_by_its_users_launcher():
    gpu_peers = _module()
    torch_ddp = gpu_peers.peer_command("torch", 1, "cuda", ["--x"])
    assert torch_ddp[1:5] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1"]
    assert torch_ddp[-2:] == [str(gpu_peers.PEERS_DIR / "torch_ddp.py"), "--x"]
    ddpkit = gpu_peers.peer_command("ddpkit", 2, "cuda", ["--x"])
    assert ddpkit[1:6] == ["-m", "ddpkit", "run", "nproc=2", "device=auto"]
    assert gpu_peers.peer_command("ddpkit", 1, "cpu", [])[5] == "device=cpu"
    assert gpu_peers.peer_command("accelerate", 1, "cuda", ["--x"])[1:] == [
        str(gpu_peers.PEERS_DIR / "accelerate_loop.py"),
        "--x",
    ]
    assert "torch.distributed.run" in gpu_peers.peer_command("accelerate", 2, "cuda", [])


def test_the_full_run_has_the_workloads_settings_and_the_smoke_run_tiny_ones():
    gpu_peers = _module()
    full = gpu_peers.arguments(["--device", "cuda"])
    assert (full.samples, full.batch_size, full.num_workers, full.precision, full.width) == (25000, 256, 8, "bf16", 64)
    assert (full.epochs, full.rounds, full.models, full.peers) == (None, 2, "resnet18,mlp", "torch,ddpkit,accelerate")
    epochs = {model: gpu_peers.script_arguments(full, model, Path("o"), Path("r"))[2] for model in ("resnet18", "mlp")}
    assert epochs == {"resnet18": "--epochs=3", "mlp": "--epochs=8"}  # about 3 s timed each on an H200
    smoke = gpu_peers.arguments(["--smoke"])
    assert (smoke.device, smoke.rounds, smoke.samples, smoke.width, smoke.epochs) == ("cpu", 1, 256, 8, 2)


def test_the_timed_window_opens_with_epoch_1s_first_batch_after_a_save_made_when_that_epoch_begins(monkeypatch):
    spec = importlib.util.spec_from_file_location("workload", BENCHMARK.parent / "peers" / "workload.py")
    assert spec is not None and spec.loader is not None
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    monkeypatch.delenv(workload.T0_VARIABLE, raising=False)
    clock = iter(range(101, 200))
    monkeypatch.setattr(workload.time, "time", lambda: float(next(clock)))
    timeline = workload.Timeline(started=100.0)
    timeline.batch(0)  # 101: the first batch
    timeline.batch(0)  # (reads no clock)
    timeline.epoch_done(0, images=64)  # 102: plain torch saved epoch 0 before this
    next(clock)  # 103: ddpkit's Checkpointer writes epoch 0 as epoch 1's loop begins
    timeline.batch(1)  # 104: the window opens
    timeline.batch(1)
    timeline.epoch_done(1, images=64)
    assert timeline.marks["first_batch"] == 1.0 and timeline.timed_from == 4.0
    assert timeline.images == 64  # epoch 0's are not timed


def test_the_result_files_are_named_by_gpu_and_the_ratio_is_ddpkits_over_the_best_peer():
    gpu_peers = _module()
    assert gpu_peers.machine_slug("cuda", "NVIDIA H100 80GB HBM3") == "h100"
    assert gpu_peers.machine_slug("cuda", "NVIDIA H200") == "h200"

    def run(peer, rate):
        phases = dict.fromkeys(PHASES, 0.1)
        return {
            "peer": peer,
            "model": "mlp",
            "images_per_s": rate,
            "time_to_first_step_s": 1.0,
            "startup_phases_s": phases,
            "gpu_memory": None,
            "checkpoint_bytes": 1,
        }

    runs = [run("torch", 100.0), run("torch", 120.0), run("ddpkit", 90.0), run("accelerate", 150.0)]
    summary = gpu_peers.summarize_runs(runs, ["mlp"], ["torch", "ddpkit", "accelerate"])
    assert summary["mlp"]["peers"]["torch"]["images_per_s"]["median"] == 110.0
    assert summary["mlp"]["ratio_ddpkit_over_best_peer"] == pytest.approx(90 / 150)
