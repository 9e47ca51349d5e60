"""The reference models have the shapes of WORKLOADS.md, and users can register theirs."""

import torch
from torch import nn

from ddpkit.models import MODELS, get_model_spec, register_model


def test_reference_models_shapes():
    x = torch.rand(3, 1, 28, 28)
    assert get_model_spec("mlp").build()(x).shape == (3, 10)
    assert get_model_spec("cnn").build()(x).shape == (3, 10)
    assert get_model_spec("autoencoder").build()(x).shape == (3, 1, 28, 28)
    mlp_params = sum(p.numel() for p in get_model_spec("mlp").build().parameters())
    assert mlp_params == 784 * 50 + 50 + 50 * 10 + 10


def test_user_model_registration():
    @register_model("test-tiny", recipe={"lr": 0.5})
    def tiny() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

    try:
        spec = get_model_spec("test-tiny")
        assert spec.recipe == {"lr": 0.5} and spec.task == "classification"
    finally:
        MODELS.pop("test-tiny")
