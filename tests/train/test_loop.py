"""The training loop on real gloo ranks: same result for any number of workers.

Starting ranks costs seconds (each imports torch); training these tiny runs
takes a fraction of that. So every 2-rank run of this module happens in ONE
2-rank job (the ``two_ranks`` fixture: the same worker processes train each
configuration in turn, in one process group), and the tests compare its
results. One worker trains in the test process; 3 workers are one more job,
run side by side with the first, their ranks forked from one worker server.
"""

import pytest
import torch

from ddpkit.comm.grad_sync import choose_grad_sync
from ddpkit.models.registry import get_model_spec
from tests.helpers.module_runs import run_side_by_side
from tests.helpers.workers import DYNAMO
from tests.train.checkpoint_helpers import close, make_trainer


def _train(rank, world_size, words, output_dir):
    """The run's summary, final parameters and learning rate; the parts built by build_trainer, no checkpoints."""
    words = [f"{key}={value}" for key, value in words.items()]
    trainer = make_trainer(rank, world_size, [*words, f"output_dir={output_dir}", "checkpoint.enabled=false"])
    try:
        summary = trainer.fit()
    finally:
        close(trainer)
    lr = trainer.optimizer.param_groups[0]["lr"]
    return summary, [p.detach().clone() for p in trainer.module.parameters()], lr


def _train_each(rank, world_size, runs, root):
    """``_train`` of every (name -> words) of ``runs`` in turn, in these ranks; output folders root/name."""
    return {name: _train(rank, world_size, words, f"{root}/{name}") for name, words in runs.items()}


# 101 training samples, global batch 6: the last batch of each epoch has 5 samples
# and splits unevenly over 2 or 3 workers. A metrics line every 5 steps.
WORDS = {"model": "mlp", "synthetic_samples": 101, "batch_size": 6, "epochs": 2, "allreduce": "builtin", "log_every": 5}

# W2 and W3 (and cnn_bn, whose BatchNorm trains without sync_batchnorm on CPU ranks) for a few steps.
MODELS = {
    "cnn": {
        "model": "cnn",
        "batch_size": 8,
        "batch_scope": "per_worker",
        "optimizer": "sgd",
        "lr": 0.01,
        "momentum": 0.5,
    },
    "cnn_bn": {"model": "cnn_bn", "batch_size": 8},
    "autoencoder": {"model": "autoencoder", "batch_size": 16, "precision": "bf16"},
    "mlp-bf16-scale_lr": {"model": "mlp", "batch_size": 16, "precision": "bf16", "scale_lr": True},
}
MODEL_STEPS = {"cnn": 4, "cnn_bn": 8, "autoencoder": 4, "mlp-bf16-scale_lr": 4}
"""Optimizer steps of one epoch of 64 samples: global batches of 16 (8 per worker), 8 and 16."""

TWO_RANK_RUNS = {
    "auto": WORDS,
    **{sync: {**WORDS, "grad_sync": sync} for sync in ("flat", "ddp", "manual")},
    **{f"accumulated-{sync}": {**WORDS, "grad_sync": sync, "grad_accum_steps": 3} for sync in ("flat", "ddp")},
    **{allreduce: {**WORDS, "allreduce": allreduce} for allreduce in ("shm", "ring")},
    **{name: {"synthetic_samples": 64, "epochs": 1, "allreduce": "builtin", **words} for name, words in MODELS.items()},
}


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The module's two jobs, side by side, their ranks forked from one worker server: by world size, the
    :class:`Outcome` of 2: ``_train_each`` of TWO_RANK_RUNS (output folders root/name), 3: ``_train`` of WORDS
    (output folder root/3); and "root"."""
    root = tmp_path_factory.mktemp("two-ranks")
    outcomes = run_side_by_side(
        {
            2: (_train_each, 2, (TWO_RANK_RUNS, str(root)), {"timeout": 300}),
            3: (_train, 3, (WORDS, str(root / "3")), {}),
        },
        DYNAMO,
    )  # every rank builds optimizers: torch._dynamo imported once, in the server
    return {**outcomes, "root": root}


@pytest.fixture(scope="module")
def two_ranks(jobs):
    """(results, root): ``results[rank][name]`` is ``_train``'s value for TWO_RANK_RUNS[name]; folders root/name."""
    return jobs[2].get(), jobs["root"]


def _assert_close(params, reference):
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_same_weights_and_metrics_for_1_2_3_workers(tmp_path, jobs):
    # One worker needs no process group of ours: it trains here, as `ddpkit train nproc=1` does, without a spawn.
    results = {
        1: [_train(0, 1, WORDS, str(tmp_path / "1"))],
        2: [by_name["auto"] for by_name in jobs[2].get()],
        3: jobs[3].get(),
    }
    reference_summary, reference_params, _ = results[1][0]
    for n in (2, 3):
        for summary, params, _ in results[n]:
            _assert_close(params, reference_params)
            assert summary["test"]["accuracy"] == pytest.approx(reference_summary["test"]["accuracy"], abs=1e-3)
            assert summary["global_steps"] == reference_summary["global_steps"] == 2 * 17


@pytest.mark.slow
@pytest.mark.parametrize("grad_sync", ["flat", "ddp"])
def test_gradient_accumulation_matches_one_big_step(two_ranks, grad_sync):
    results, _ = two_ranks
    plain, accumulated = results[0][grad_sync], results[0][f"accumulated-{grad_sync}"]
    assert accumulated[0]["global_steps"] == plain[0]["global_steps"] == 2 * 17
    _assert_close(accumulated[1], plain[1])


@pytest.mark.slow
@pytest.mark.parametrize("grad_sync", ["flat", "manual"])
def test_grad_sync_modes_match_ddp(two_ranks, grad_sync):
    results, _ = two_ranks
    ddp, other = results[1]["ddp"], results[1][grad_sync]
    assert ddp[0]["grad_sync"] == "ddp" and other[0]["grad_sync"] == grad_sync
    _assert_close(other[1], ddp[1])


def test_grad_sync_auto_is_flat_for_small_gradients_and_with_shared_memory():
    mlp, cnn = get_model_spec("mlp").build(), get_model_spec("cnn").build()  # 155 KiB and 2.3 MiB of gradients
    assert choose_grad_sync("auto", mlp, sync_batchnorm=False) == "flat"
    assert choose_grad_sync("auto", cnn, sync_batchnorm=False) == "ddp"
    assert choose_grad_sync("auto", cnn, sync_batchnorm=False, allreduce="hierarchical") == "ddp"
    assert choose_grad_sync("auto", cnn, sync_batchnorm=False, allreduce="shm") == "flat"  # W2 on one CPU node
    assert choose_grad_sync("auto", cnn, sync_batchnorm=True, allreduce="shm") == "ddp"
    assert choose_grad_sync("auto", mlp, sync_batchnorm=True) == "ddp"
    assert choose_grad_sync("manual", cnn, sync_batchnorm=False) == "manual"


@pytest.mark.slow
def test_metrics_file_written_by_rank_zero(two_ranks):
    results, root = two_ranks
    assert results[0]["auto"][0]["grad_sync"] == "flat"  # what auto chose for the MLP
    lines = (root / "auto" / "metrics.jsonl").read_text().splitlines()
    events = [line.split('"event": "')[1].split('"')[0] for line in lines]
    assert (
        events.count("train") == 8 and events.count("eval") == 2
    )  # 5, 10, 15, 17 (the epoch end), ... and events[-1] == "summary"


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
def test_reference_models_and_options_train(two_ranks, name):
    """W2, W3 and cnn_bn train for a few steps on 2 ranks; replicas stay identical; metrics are finite."""
    results, _ = two_ranks
    (summary0, params0, _), (summary1, params1, _) = results[0][name], results[1][name]
    assert summary0["model"] == MODELS[name]["model"] and summary0["world_size"] == 2
    assert summary0["global_steps"] == MODEL_STEPS[name]
    for p, q in zip(params0, params1, strict=True):
        assert torch.equal(p, q)
    metric = "accuracy" if MODELS[name]["model"] != "autoencoder" else "mse"
    assert torch.isfinite(torch.tensor(summary0["test"][metric]))
    assert summary0["test"] == summary1["test"]


@pytest.mark.slow
def test_scale_lr_multiplies_the_learning_rate_by_the_number_of_workers(two_ranks):
    results, _ = two_ranks
    plain_lr, scaled_lr = results[0]["auto"][2], results[0]["mlp-bf16-scale_lr"][2]
    assert plain_lr == 1e-3  # W1's Adam recipe
    assert scaled_lr == 2 * plain_lr == results[1]["mlp-bf16-scale_lr"][2]


@pytest.mark.slow
@pytest.mark.parametrize("allreduce", ["shm", "ring"])
def test_allreduce_algorithms_train_like_builtin(two_ranks, allreduce):
    """shm and ring (in the flat all_reduce grad_sync=auto picks for the MLP) give the builtin's weights."""
    results, _ = two_ranks
    builtin, other = results[0]["auto"], results[0][allreduce]
    assert other[0]["allreduce"] == allreduce
    _assert_close(other[1], builtin[1])
