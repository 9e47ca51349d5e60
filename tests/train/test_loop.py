"""The training loop on real gloo ranks: same result for any number of workers."""

import pytest
import torch

from ddpkit.config import TrainConfig
from ddpkit.data.datasets import DataOptions, load_dataset
from ddpkit.distributed import Context
from ddpkit.env.base import ClusterEnvironment
from ddpkit.models.registry import get_model_spec
from ddpkit.train.loop import Trainer
from tests.helpers.workers import run_on_ranks


def _context(rank: int, world_size: int) -> Context:
    env = ClusterEnvironment("test", rank, rank, world_size, world_size, 0, 1, "127.0.0.1", 1)
    return Context(env, torch.device("cpu"), "gloo")


def _train(rank, world_size, words, output_dir):
    cfg = TrainConfig(**words, output_dir=output_dir, progress=False)
    data = load_dataset("synthetic", DataOptions(synthetic_samples=cfg.synthetic_samples, seed=1))
    trainer = Trainer(cfg, _context(rank, world_size), data, get_model_spec(cfg.model))
    summary = trainer.fit()
    return summary, [p.detach().clone() for p in trainer.module.parameters()]


# 101 training samples, global batch 6: the last batch of each epoch has 5 samples
# and splits unevenly over 2 or 3 workers.
WORDS = {"model": "mlp", "synthetic_samples": 101, "batch_size": 6, "epochs": 2, "allreduce": "builtin"}


@pytest.mark.slow
def test_same_weights_and_metrics_for_1_2_3_workers(tmp_path):
    results = {n: run_on_ranks(_train, n, WORDS, str(tmp_path / str(n))) for n in (1, 2, 3)}
    reference_summary, reference_params = results[1][0]
    for n in (2, 3):
        for rank, (summary, params) in enumerate(results[n]):
            for p, q in zip(params, reference_params):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
            assert summary["test"]["accuracy"] == pytest.approx(reference_summary["test"]["accuracy"], abs=1e-3)
            assert summary["global_steps"] == reference_summary["global_steps"] == 2 * 17


@pytest.mark.parametrize("grad_sync", ["flat", "ddp"])
def test_gradient_accumulation_matches_one_big_step(tmp_path, grad_sync):
    plain = run_on_ranks(_train, 2, {**WORDS, "grad_sync": grad_sync}, str(tmp_path / "a"))
    accumulated = run_on_ranks(_train, 2, {**WORDS, "grad_sync": grad_sync, "grad_accum_steps": 3}, str(tmp_path / "b"))
    for p, q in zip(plain[0][1], accumulated[0][1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grad_sync", ["flat", "manual"])
def test_grad_sync_modes_match_ddp(tmp_path, grad_sync):
    ddp = run_on_ranks(_train, 2, {**WORDS, "grad_sync": "ddp"}, str(tmp_path / "a"))
    other = run_on_ranks(_train, 2, {**WORDS, "grad_sync": grad_sync}, str(tmp_path / "b"))
    assert ddp[0][0]["grad_sync"] == "ddp" and other[0][0]["grad_sync"] == grad_sync
    for p, q in zip(ddp[1][1], other[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_grad_sync_auto_is_flat_for_small_gradients_only():
    from ddpkit.train.grad_sync import choose_grad_sync

    mlp, cnn = get_model_spec("mlp").build(), get_model_spec("cnn").build()  # 155 KiB and 2.3 MiB of gradients
    assert choose_grad_sync("auto", mlp, sync_batchnorm=False) == "flat"
    assert choose_grad_sync("auto", cnn, sync_batchnorm=False) == "ddp"
    assert choose_grad_sync("auto", mlp, sync_batchnorm=True) == "ddp"
    assert choose_grad_sync("manual", cnn, sync_batchnorm=False) == "manual"


def test_metrics_file_written_by_rank_zero(tmp_path):
    run_on_ranks(_train, 2, {**WORDS, "log_every": 5}, str(tmp_path))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    events = [line.split('"event": "')[1].split('"')[0] for line in lines]
    assert events.count("train") == 6 and events.count("eval") == 2 and events[-1] == "summary"


@pytest.mark.slow
@pytest.mark.parametrize("words", [
    {"model": "cnn", "batch_size": 8, "batch_scope": "per_worker", "optimizer": "sgd", "lr": 0.01, "momentum": 0.5},
    {"model": "autoencoder", "batch_size": 16, "precision": "bf16"},
    {"model": "mlp", "batch_size": 16, "precision": "bf16", "sync_batchnorm": True, "scale_lr": True},
])
def test_reference_models_and_options_train(tmp_path, words):
    """W2 and W3 train for a few steps on 2 ranks; replicas stay identical; metrics are finite."""
    config = {"synthetic_samples": 64, "epochs": 1, "allreduce": "builtin", **words}
    results = run_on_ranks(_train, 2, config, str(tmp_path))
    (summary0, params0), (summary1, params1) = results
    for p, q in zip(params0, params1):
        assert torch.equal(p, q)
    metric = "accuracy" if words["model"] != "autoencoder" else "mse"
    assert torch.isfinite(torch.tensor(summary0["test"][metric]))
    assert summary0["test"] == summary1["test"]


@pytest.mark.parametrize("allreduce", ["shm", "ring"])
def test_allreduce_algorithms_train_like_builtin(tmp_path, allreduce):
    """shm and ring, as DDP communication hooks, give the builtin's weights."""
    builtin = run_on_ranks(_train, 2, WORDS, str(tmp_path / "builtin"))
    other = run_on_ranks(_train, 2, {**WORDS, "allreduce": allreduce}, str(tmp_path / allreduce))
    assert other[0][0]["allreduce"] == allreduce
    for p, q in zip(builtin[0][1], other[0][1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
