"""Checkpoints written on a GPU: fp32, bf16 and fp16 (GradScaler) resume bit for bit, and load on a CPU.

Each precision runs once uninterrupted and once stopped after 3 steps
(``max_steps``, which checkpoints) then continued with ``resume=auto``; the
final weights, optimizer and scaler states must be identical.
"""

from __future__ import annotations

import pytest
import torch

from ddpkit.checkpoint.disk.format import load_file, verify_checkpoint
from ddpkit.checkpoint.publishing.export import export_checkpoint, load_exported
from ddpkit.models.registry import get_model_spec
from tests.gpu.runs import newest_checkpoint, train, weights

STEPS = 512 // 64
"""Optimizer steps of one epoch of the TINY runs (mlp's global batch of 64)."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``runs(precision)``: (uninterrupted run folder, stopped-and-resumed run folder, resumed run's output)."""
    done = {}

    def run(precision: str):
        if precision not in done:
            base = tmp_path_factory.mktemp(f"resume-{precision}")
            words = ("model=mlp", f"precision={precision}")
            whole, _ = train(base / "whole", *words)
            stopped, _ = train(base / "resumed", *words, "max_steps=3")
            resumed, text = train(base / "resumed", *words, "resume=auto")
            assert (whole["global_steps"], stopped["global_steps"], resumed["global_steps"]) == (STEPS, 3, STEPS)
            done[precision] = base / "whole", base / "resumed", text
        return done[precision]

    return run


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_resume_on_gpu_is_bit_equal(runs, precision):
    whole, resumed, text = runs(precision)
    assert "resumed from" in text and "global step 3" in text, text[-3000:]
    a, b = newest_checkpoint(whole), newest_checkpoint(resumed)
    assert a.name == b.name == f"step-{STEPS:09d}"
    for name in ("model.pt", "optimizer.pt", "scaler.pt"):
        assert _equal(load_file(a / name), load_file(b / name)), f"{name} differs after resuming ({precision})"


def test_fp16_checkpoint_holds_the_grad_scaler(runs):
    whole, _, _ = runs("fp16")
    scaler = load_file(newest_checkpoint(whole) / "scaler.pt")
    assert scaler["scale"] > 0 and "_growth_tracker" in scaler  # GradScaler's state, enabled on CUDA for fp16
    whole, _, _ = runs("bf16")
    assert load_file(newest_checkpoint(whole) / "scaler.pt") == {}  # bf16 needs no scaler: disabled, empty


def test_gpu_checkpoint_loads_on_cpu(runs, tmp_path):
    whole, _, _ = runs("fp32")
    checkpoint = newest_checkpoint(whole)
    verify_checkpoint(checkpoint)
    state = weights(checkpoint)
    assert {t.device.type for t in state.values()} == {"cpu"}
    model = get_model_spec("mlp").build()
    model.load_state_dict(state)
    assert model(torch.rand(2, 1, 28, 28)).shape == (2, 10)
    optimizer = load_file(checkpoint / "optimizer.pt", map_location="cpu")
    assert {t.device.type for s in optimizer["state"].values() for t in s.values() if torch.is_tensor(t)} == {"cpu"}

    exported, info = load_exported(export_checkpoint(checkpoint, tmp_path / "exported"), device="cpu")
    assert info["model"]["name"] == "mlp"
    for name, tensor in exported.state_dict().items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, state[name])


def _equal(a, b) -> bool:
    """Nested state dicts equal, tensors bit for bit (on the CPU)."""
    if torch.is_tensor(a) or torch.is_tensor(b):
        return torch.is_tensor(a) and torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_cpu_checkpoint_resumes_with_the_optimizer_state_on_the_gpu(tmp_path):
    """A checkpoint written on CPU, resumed with device=cuda: Adam's state lands on the parameters' GPU."""
    from tests.train.checkpoint_helpers import train as train_here
    from tests.train.test_resume import WORDS

    words = [*WORDS, f"output_dir={tmp_path}", "checkpoint.every_steps=3"]
    train_here(0, 1, [*words, "max_steps=7"])  # device=cpu
    trainer, start = train_here(0, 1, [*words, "device=cuda", "resume=auto", "epochs=1"])
    assert start is not None and start.name.endswith("7") and trainer.state.global_step == 12
    for param in trainer.module.parameters():
        assert param.device.type == "cuda"
        state = trainer.optimizer.state[param]
        assert state["exp_avg"].device == state["exp_avg_sq"].device == param.device


def test_a_gpu_model_saves_in_the_background_by_default_and_writes_a_synchronous_save_s_files(tmp_path):
    from torch import nn

    from ddpkit import Checkpointer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10)).cuda()
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    default = Checkpointer(tmp_path / "default", model=model, optimizer=optimizer, preempt_signals=())
    synchronous = Checkpointer(
        tmp_path / "sync", model=model, optimizer=optimizer, preempt_signals=(), async_save=False
    )
    assert default.async_save and not synchronous.async_save
    a, b = default.save(), synchronous.save()
    default.close()
    synchronous.close()
    for name in ("model.pt", "optimizer.pt"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_a_sharded_run_saves_in_the_background_and_resumes_bit_equal(tmp_path):
    """shard=true on a GPU: the model reaches the device block by block, async_save=auto writes the shards in
    the background (staged in pinned memory), and a stopped run resumed ends with the same shards."""
    from ddpkit.checkpoint.disk.format import read_manifest

    words = ("model=mlp", "shard=true")
    train(tmp_path / "whole", *words)
    train(tmp_path / "resumed", *words, "max_steps=3")
    _, text = train(tmp_path / "resumed", *words, "resume=auto")
    assert "resumed from" in text and "global step 3" in text, text[-3000:]
    assert "sharded: every rank wrote its shards" in text
    a, b = newest_checkpoint(tmp_path / "whole"), newest_checkpoint(tmp_path / "resumed")
    assert a.name == b.name == f"step-{STEPS:09d}"
    verify_checkpoint(a)
    files_a, files_b = read_manifest(a)["files"], read_manifest(b)["files"]
    assert files_a["__0_0.distcp"] == files_b["__0_0.distcp"]  # size and SHA-256 of the shards: bit for bit
