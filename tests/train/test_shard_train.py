"""``ddpkit train shard=true``: stopped anywhere and resumed, a sharded run ends bit-equal to one never stopped.

2 gloo ranks train the trainer's model sharded (FSDP2); runs stopped inside
the first epoch, at its end and inside the second are resumed from their
sharded checkpoints. Each rank compares its own shards of the model and of
the optimizer's state, its RNG and the loader's position: equal on every
rank means equal as a whole.
"""

from __future__ import annotations

import pytest

from ddpkit.checkpoint.format import checkpoint_name
from tests.helpers.workers import DYNAMO, run_on_ranks, warm_workers
from tests.train.checkpoint_helpers import train
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
