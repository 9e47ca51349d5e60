"""``ddpkit.is_sharded`` tells a script what ``prepare_model`` did with its model, as the trainer asks it."""

from __future__ import annotations

import torch
from torch import nn

from tests.helpers.workers import run_on_ranks


def _what_prepare_model_did(rank: int, world_size: int) -> dict[str, bool]:
    import ddpkit

    ddpkit.init()
    try:
        out = {}
        for name, options in {"replicated": {}, "auto": {"shard": "auto"}, "sharded": {"shard": True}}.items():
            torch.manual_seed(0)
            model = ddpkit.prepare_model(nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)), **options)
            out[name] = ddpkit.is_sharded(model)
        return out
    finally:
        ddpkit.shutdown()


def test_is_sharded_answers_for_the_model_prepare_model_returned():
    results = run_on_ranks(_what_prepare_model_did, 2, timeout=120)
    # shard="auto" shards only a replica that does not fit the device: a small model on CPU stays replicated
    assert results == [{"replicated": False, "auto": False, "sharded": True}] * 2
