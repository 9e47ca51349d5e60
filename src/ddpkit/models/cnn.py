"""W2: the small convolutional network of PyTorch's MNIST example, and cnn_bn, W2 with batch normalization.

cnn_bn is the built-in model with BatchNorm layers, the one ``sync_batchnorm=true``
acts on (torch's SyncBatchNorm runs on CUDA only).
"""

import torch
from torch import nn

from ddpkit.models.spec import ModelSpec

MNIST_MEAN_STD = (0.1307, 0.3081)
"""Mean and standard deviation of MNIST's pixels in [0, 1], as PyTorch's MNIST example normalizes them."""


class Normalize(nn.Module):
    """``(x - mean) / std``: the example's input normalization, inside the model so that any data path gets it."""

    def __init__(self, mean: float, std: float) -> None:
        super().__init__()
        self.mean, self.std = mean, std

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Normalize ``x``."""
        return (x - self.mean) / self.std

    def extra_repr(self) -> str:
        return f"mean={self.mean}, std={self.std}"


CNN_RECIPE = {
    "optimizer": "sgd",
    "lr": 0.01,
    "momentum": 0.5,
    "batch_size": 16,
    "batch_scope": "per_worker",
    "epochs": 1,
}
"""The training recipe of PyTorch's MNIST example, shared by cnn and cnn_bn."""


def cnn() -> nn.Module:
    """normalize, conv 1->32 k3, ReLU, conv 32->32 k3, ReLU, maxpool 2, dropout 0.25, fc 4608->128, ReLU, dropout 0.5, fc 128->10."""
    return _mnist_cnn(batchnorm=False)


def cnn_bn() -> nn.Module:
    """cnn with BatchNorm2d after each convolution (before its ReLU); the same recipe."""
    return _mnist_cnn(batchnorm=True)


CNN = ModelSpec("cnn", cnn, "classification", CNN_RECIPE)
"""W2 in the registry, with the example's recipe."""
CNN_BN = ModelSpec("cnn_bn", cnn_bn, "classification", CNN_RECIPE)
"""cnn_bn in the registry, with the same recipe."""


def _mnist_cnn(batchnorm: bool) -> nn.Sequential:
    def conv(in_channels: int) -> list[nn.Module]:
        norm = [nn.BatchNorm2d(32)] if batchnorm else []
        return [nn.Conv2d(in_channels, 32, 3), *norm, nn.ReLU()]

    return nn.Sequential(
        Normalize(*MNIST_MEAN_STD),
        *conv(1),
        *conv(32),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(4608, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )
