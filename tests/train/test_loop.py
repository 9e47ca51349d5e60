"""The training loop on real gloo ranks: same result for any number of workers."""

import pytest
import torch

from ddpkit.comm.grad_sync import choose_grad_sync
from ddpkit.models.registry import get_model_spec
from tests.helpers.workers import run_on_ranks
from tests.train.checkpoint_helpers import close, make_trainer


def _train(rank, world_size, words, output_dir):
    """The run's summary and final parameters; the parts built by build_trainer, no checkpoints."""
    words = [f"{key}={value}" for key, value in words.items()]
    trainer = make_trainer(rank, world_size, [*words, f"output_dir={output_dir}", "checkpoint.enabled=false"])
    try:
        summary = trainer.fit()
    finally:
        close(trainer)
    return summary, [p.detach().clone() for p in trainer.module.parameters()]


# 101 training samples, global batch 6: the last batch of each epoch has 5 samples
# and splits unevenly over 2 or 3 workers. A metrics line every 5 steps.
WORDS = {"model": "mlp", "synthetic_samples": 101, "batch_size": 6, "epochs": 2, "allreduce": "builtin", "log_every": 5}


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """``two_ranks(grad_sync)``: (results, output_dir) of WORDS on 2 ranks, each run once for this module."""
    runs = {}

    def run(grad_sync: str = "auto"):
        if grad_sync not in runs:
            folder = tmp_path_factory.mktemp(f"two-ranks-{grad_sync}")
            runs[grad_sync] = run_on_ranks(_train, 2, {**WORDS, "grad_sync": grad_sync}, str(folder)), folder
        return runs[grad_sync]

    return run


@pytest.mark.slow
def test_same_weights_and_metrics_for_1_2_3_workers(tmp_path, two_ranks):
    results = {n: run_on_ranks(_train, n, WORDS, str(tmp_path / str(n))) for n in (1, 3)}
    results[2] = two_ranks()[0]
    reference_summary, reference_params = results[1][0]
    for n in (2, 3):
        for rank, (summary, params) in enumerate(results[n]):
            for p, q in zip(params, reference_params):
                torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
            assert summary["test"]["accuracy"] == pytest.approx(reference_summary["test"]["accuracy"], abs=1e-3)
            assert summary["global_steps"] == reference_summary["global_steps"] == 2 * 17


@pytest.mark.parametrize("grad_sync", ["flat", "ddp"])
def test_gradient_accumulation_matches_one_big_step(tmp_path, two_ranks, grad_sync):
    plain, _ = two_ranks(grad_sync)
    accumulated = run_on_ranks(_train, 2, {**WORDS, "grad_sync": grad_sync, "grad_accum_steps": 3}, str(tmp_path))
    for p, q in zip(plain[0][1], accumulated[0][1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grad_sync", ["flat", "manual"])
def test_grad_sync_modes_match_ddp(two_ranks, grad_sync):
    ddp, _ = two_ranks("ddp")
    other, _ = two_ranks(grad_sync)
    assert ddp[0][0]["grad_sync"] == "ddp" and other[0][0]["grad_sync"] == grad_sync
    for p, q in zip(ddp[1][1], other[1][1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_grad_sync_auto_is_flat_for_small_gradients_only():
    mlp, cnn = get_model_spec("mlp").build(), get_model_spec("cnn").build()  # 155 KiB and 2.3 MiB of gradients
    assert choose_grad_sync("auto", mlp, sync_batchnorm=False) == "flat"
    assert choose_grad_sync("auto", cnn, sync_batchnorm=False) == "ddp"
    assert choose_grad_sync("auto", mlp, sync_batchnorm=True) == "ddp"
    assert choose_grad_sync("manual", cnn, sync_batchnorm=False) == "manual"


def test_metrics_file_written_by_rank_zero(two_ranks):
    _, folder = two_ranks()
    lines = (folder / "metrics.jsonl").read_text().splitlines()
    events = [line.split('"event": "')[1].split('"')[0] for line in lines]
    assert events.count("train") == 6 and events.count("eval") == 2 and events[-1] == "summary"


@pytest.mark.slow
@pytest.mark.parametrize("words", [
    {"model": "cnn", "batch_size": 8, "batch_scope": "per_worker", "optimizer": "sgd", "lr": 0.01, "momentum": 0.5},
    {"model": "autoencoder", "batch_size": 16, "precision": "bf16"},
    # (sync_batchnorm needs CUDA: on these CPU ranks it is refused, as tests/models/test_models.py checks)
    {"model": "mlp", "batch_size": 16, "precision": "bf16", "scale_lr": True},
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
def test_allreduce_algorithms_train_like_builtin(tmp_path, two_ranks, allreduce):
    """shm and ring (in the flat all_reduce grad_sync=auto picks for the MLP) give the builtin's weights."""
    builtin, _ = two_ranks()
    other = run_on_ranks(_train, 2, {**WORDS, "allreduce": allreduce}, str(tmp_path / allreduce))
    assert other[0][0]["allreduce"] == allreduce
    for p, q in zip(builtin[0][1], other[0][1]):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
