"""``ddpkit train shard=true``: stopped anywhere and resumed, a sharded run ends bit-equal to one never stopped.

2 gloo ranks train the trainer's model sharded (FSDP2); runs stopped inside
the first epoch, at its end and inside the second are resumed from their
sharded checkpoints. Each rank compares its own shards of the model and of
the optimizer's state, its RNG and the loader's position: equal on every
rank means equal as a whole.
"""

from __future__ import annotations

import pytest
import torch

from ddpkit.checkpoint.disk.format import checkpoint_name
from tests.helpers.workers import DYNAMO, run_on_ranks, warm_workers
from tests.train import checkpoint_helpers
from tests.train.checkpoint_helpers import assert_bit_equal, close, final_state, make_trainer, train
from tests.train.test_resume import STEPS_PER_EPOCH, WORDS, stop_and_resume

SHARDED = [*WORDS, "shard=true"]


@pytest.mark.slow
def test_a_sharded_run_stopped_anywhere_and_resumed_is_bit_exact(tmp_path):
    stops = [5, STEPS_PER_EPOCH, STEPS_PER_EPOCH + 7]
    with warm_workers(DYNAMO):
        results = run_on_ranks(stop_and_resume, 2, str(tmp_path), stops, SHARDED, timeout=300)
    assert [result["grad_sync"] for result in results] == ["fsdp", "fsdp"]
    assert results[0]["resumed_from"] == results[1]["resumed_from"] == [checkpoint_name(s) for s in stops]
    manifests = list((tmp_path / "full" / "checkpoints").glob("step-*/manifest.json"))
    assert manifests and all('"sharded"' in path.read_text() for path in manifests)


def _four_then_two(rank, world_size, tmp, stop):
    """4 ranks (the last global batch of 2 samples leaves 2 ranks empty rows) stop at ``stop``; 2 ranks resume."""
    if world_size == 4:
        trainer, _ = train(rank, world_size, [*SHARDED, f"output_dir={tmp}", f"max_steps={stop}"])
        return trainer.state.global_step
    trainer, start = train(rank, world_size, [*SHARDED, f"output_dir={tmp}", "resume=auto"])
    return trainer.state.global_step, start.name, trainer.loader.epoch


@pytest.mark.slow
def test_a_sharded_run_of_4_ranks_continues_on_2(tmp_path):
    stop = STEPS_PER_EPOCH + 3
    with warm_workers(DYNAMO):
        assert run_on_ranks(_four_then_two, 4, str(tmp_path), stop, timeout=300) == [stop] * 4
        resumed = run_on_ranks(_four_then_two, 2, str(tmp_path), stop, timeout=300)
    assert resumed == [(2 * STEPS_PER_EPOCH, checkpoint_name(stop), 1)] * 2


def _built_where(rank, world_size, tmp, model):
    """Train ``model`` sharded for 2 epochs; its final state and where this rank built it."""
    checkpoint_helpers.BUILT_ON.clear()
    trainer, _ = train(
        rank, world_size, [*SHARDED, f"model=tests.train.checkpoint_helpers:{model}", f"output_dir={tmp}"]
    )
    return final_state(trainer), list(checkpoint_helpers.BUILT_ON)


def _started_from(rank, world_size, tmp, init_from):
    """The full weights of a sharded trainer started from ``init_from`` (before training) and where it was built."""
    checkpoint_helpers.BUILT_ON.clear()
    words = [*SHARDED, "model=tests.train.checkpoint_helpers:mlp_dropout_recording", f"output_dir={tmp}"]
    trainer = make_trainer(rank, world_size, [*words, f"init_from={init_from}"])
    try:
        weights = {name: tensor.full_tensor() for name, tensor in trainer.module.state_dict().items()}
    finally:
        close(trainer)
    return weights, list(checkpoint_helpers.BUILT_ON)


@pytest.mark.slow
def test_ranks_other_than_0_build_a_sharded_model_on_the_meta_device_and_train_as_if_they_built_it(tmp_path):
    """Rank 1 builds on meta; a model that cannot be built there is built on the CPU; both train bit-equal.

    The model has dropout: rank 1 draws what it would have drawn after building the model itself
    (it takes rank 0's generators once rank 0 has built it). Started from the first run's weights
    (init_from, read by rank 0 alone), both ranks hold them.
    """
    with warm_workers(DYNAMO):
        on_meta = run_on_ranks(_built_where, 2, str(tmp_path / "meta"), "mlp_dropout_recording", timeout=300)
        on_cpu = run_on_ranks(_built_where, 2, str(tmp_path / "cpu"), "mlp_dropout_not_on_meta", timeout=300)
        started = run_on_ranks(_started_from, 2, str(tmp_path / "init"), str(tmp_path / "meta"), timeout=300)
    assert [built for _, built in on_meta] == [["cpu"], ["meta"]]
    for rank in range(2):
        assert_bit_equal(on_meta[rank][0], on_cpu[rank][0], f"rank {rank}")
    assert [built for _, built in started] == [["cpu"], ["meta"]]
    trained = {name: torch.cat([on_meta[r][0]["model"][name] for r in range(2)]) for name in on_meta[0][0]["model"]}
    for weights, _ in started:
        assert weights.keys() == trained.keys()
        assert all(torch.equal(weights[name], trained[name]) for name in trained)
