"""A sharded model's state dict: refused by torch.save while it holds shards, a plain OrderedDict otherwise."""

from __future__ import annotations

import copy
import io
import pickle
from collections import OrderedDict

import torch
from torch import nn

from ddpkit.comm.sharded_state import ShardedStateDict, refuse_saving_shards


def test_a_state_dict_without_shards_pickles_and_copies_as_the_plain_ordered_dict():
    model = nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3))
    refuse_saving_shards(model)
    state = model.state_dict()
    assert isinstance(state, ShardedStateDict)
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    assert type(loaded) is OrderedDict and list(loaded) == list(state)
    assert loaded._metadata == state._metadata  # the modules' format versions, which load_state_dict reads
    nn.Sequential(nn.Linear(2, 3), nn.BatchNorm1d(3)).load_state_dict(loaded)
    for copied in (copy.copy(state), copy.deepcopy(state)):
        assert list(copied) == list(state) and copied._metadata == state._metadata
    assert type(pickle.loads(pickle.dumps(state))) is OrderedDict


def test_inside_a_larger_module_the_callers_dict_is_left_alone():
    inner = nn.Linear(2, 3)
    refuse_saving_shards(inner)
    outer = nn.Sequential(inner, nn.ReLU())
    assert type(outer.state_dict()) is OrderedDict
