"""The reference models have the shapes of WORKLOADS.md, and users can register theirs."""

import pytest
import torch
from torch import nn

from ddpkit.models import MODELS, get_model_spec, register_model
from tests.cli_runner import run_ddpkit
from tests.helpers.workers import run_on_ranks


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


def _train_cnn_bn(rank: int, world_size: int, output_dir: str) -> dict:
    from ddpkit.cli import parse_train_config
    from ddpkit.train.run import run_worker

    cfg = parse_train_config(["model=cnn_bn", "dataset=synthetic", "synthetic_samples=64", "batch_size=8",
                              "epochs=1", "device=cpu", "checkpoint.enabled=false", "progress=false",
                              f"output_dir={output_dir}"])
    return run_worker(cfg)


def test_cnn_bn_trains_on_two_cpu_ranks_without_sync_batchnorm(tmp_path):
    summary0, summary1 = run_on_ranks(_train_cnn_bn, 2, str(tmp_path), timeout=240)
    assert summary0["model"] == "cnn_bn" and summary0["world_size"] == 2 and summary0["global_steps"] == 4
    assert torch.isfinite(torch.tensor(summary0["test"]["accuracy"])) and summary0["test"] == summary1["test"]


@pytest.mark.parametrize("device", ["cpu", *([] if torch.cuda.is_available() else ["auto"])])
def test_sync_batchnorm_on_cpu_is_one_line_before_launch(tmp_path, device):
    out = run_ddpkit("train", "model=cnn_bn", "sync_batchnorm=true", f"device={device}", "nproc=2",
                     "dataset=synthetic", cwd=tmp_path, timeout=60)
    assert out.returncode == 2
    assert out.stderr == ("error: sync_batchnorm=true needs CUDA devices (torch's SyncBatchNorm supports CUDA only); "
                          "drop it on CPU\n"), out.stderr
    assert not (tmp_path / "runs").exists()  # no worker started


def _prepare_with_sync_batchnorm(rank: int, world_size: int) -> str:
    import ddpkit
    from ddpkit import distributed

    distributed.init(device="cpu")
    try:
        with pytest.raises(ValueError) as error:
            ddpkit.prepare_model(get_model_spec("cnn_bn").build(), sync_batchnorm=True)
        return str(error.value)
    finally:
        distributed.shutdown()


def test_prepare_model_refuses_sync_batchnorm_on_cpu():
    message = run_on_ranks(_prepare_with_sync_batchnorm, 1, init_process_group=False)[0]
    assert message == ("sync_batchnorm=True needs CUDA devices (torch's SyncBatchNorm supports CUDA only); "
                       "drop it on CPU")
