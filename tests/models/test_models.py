"""The reference models have the shapes of WORKLOADS.md, and users can register theirs."""

import pytest
import torch
from torch import nn

import ddpkit
from ddpkit import distributed
from ddpkit.commands.dispatch import main
from ddpkit.models import MODELS, get_model_spec, register_model


def test_reference_models_shapes():
    x = torch.rand(3, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    assert get_model_spec("mlp").build()(x).shape == (3, 10)
    assert get_model_spec("cnn").build()(x).shape == (3, 10)
    assert get_model_spec("autoencoder").build()(x).shape == (3, 1, 28, 28)
    mlp_params = sum(p.numel() for p in get_model_spec("mlp").build().parameters())
    assert mlp_params == 784 * 50 + 50 + 50 * 10 + 10


def test_cnn_normalizes_its_input_itself():
    """The MNIST example's (x - 0.1307) / 0.3081 is the CNN's first module, so any data path gets it."""
    cnn = get_model_spec("cnn").build()
    x = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(cnn[0](x), (x - 0.1307) / 0.3081)
    assert list(dict(cnn.named_parameters()))[:2] == ["1.weight", "1.bias"]  # Normalize holds no parameters


def test_user_model_registration():
    @register_model("test-tiny", recipe={"lr": 0.5})
    def tiny() -> nn.Module:
        return nn.Sequential(nn.Flatten(), nn.Linear(784, 10))

    try:
        spec = get_model_spec("test-tiny")
        assert spec.recipe == {"lr": 0.5} and spec.task == "classification"
    finally:
        MODELS.pop("test-tiny")
    with pytest.raises(ValueError, match="task='ranking' is not valid; choose one of: classification, regression"):
        register_model("test-bad", task="ranking")


def test_cnn_bn_is_cnn_with_batchnorm_after_each_convolution():
    cnn, cnn_bn = get_model_spec("cnn"), get_model_spec("cnn_bn")
    assert cnn_bn.recipe == cnn.recipe and cnn_bn.task == "classification"
    model = cnn_bn.build()
    kinds = [type(m).__name__ for m in model]
    assert kinds[1:4] == ["Conv2d", "BatchNorm2d", "ReLU"] and kinds[4:7] == ["Conv2d", "BatchNorm2d", "ReLU"]
    assert [type(m) for m in model if not isinstance(m, nn.BatchNorm2d)] == [type(m) for m in cnn.build()]
    assert model(torch.rand(3, 1, 28, 28)).shape == (3, 10)


@pytest.mark.parametrize("device", ["cpu", *([] if torch.cuda.is_available() else ["auto"])])
def test_sync_batchnorm_on_cpu_is_one_line_before_launch(tmp_path, monkeypatch, capsys, device):
    monkeypatch.chdir(tmp_path)
    # In-process: tests/test_cli.py checks the exit status of the command itself.
    assert (
        main(["train", "model=cnn_bn", "sync_batchnorm=true", f"device={device}", "nproc=2", "dataset=synthetic"]) == 2
    )
    assert capsys.readouterr().err == (
        "error: sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm supports CUDA only); drop it on CPU\n"
    )
    assert not (tmp_path / "runs").exists()  # no worker started


def test_prepare_model_refuses_sync_batchnorm_on_cpu():
    # One rank in this process: ddpkit.init forms a one-rank group of its own, and shutdown leaves it.
    distributed.init(device="cpu", environ={})
    try:
        with pytest.raises(ValueError) as error:
            ddpkit.prepare_model(get_model_spec("cnn_bn").build(), sync_batchnorm=True)
    finally:
        distributed.shutdown()
    assert str(error.value) == (
        "sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm supports CUDA only); drop it on CPU"
    )
