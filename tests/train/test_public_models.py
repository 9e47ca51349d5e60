"""A user's own model, registered through ddpkit's public names, is what ``ddpkit train model=...`` trains."""

from __future__ import annotations

import pytest
import torch

import ddpkit
from ddpkit.models import MODELS
from ddpkit.train.config import parse_train_config

USER_MODULE = """
from torch import nn

import ddpkit


@ddpkit.register_model("user-tiny", task="regression", recipe={"lr": 0.25, "batch_size": 8})
def build() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 1))
"""


def test_a_model_registered_with_the_public_decorator_brings_its_recipe(tmp_path, monkeypatch: pytest.MonkeyPatch):
    (tmp_path / "user_models_public.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        cfg = parse_train_config(["model=user_models_public:build"])
        spec = ddpkit.get_model_spec("user-tiny")
    finally:
        MODELS.pop("user-tiny", None)
    assert (cfg.lr, cfg.batch_size) == (0.25, 8)
    assert isinstance(spec, ddpkit.ModelSpec) and spec.task == "regression"
    assert spec.build()(torch.zeros(2, 1, 28, 28)).shape == (2, 1)


def test_an_unknown_model_name_is_one_line_naming_the_choices():
    with pytest.raises(
        ddpkit.UserError, match=r"^unknown model 'nope'; choose one of: .*cnn.*, or give module:function$"
    ):
        ddpkit.get_model_spec("nope")
