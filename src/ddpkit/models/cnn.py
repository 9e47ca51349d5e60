"""W2: the small convolutional network of PyTorch's MNIST example."""

from torch import nn

from ddpkit.models.registry import register_model


@register_model(
    "cnn",
    normalize=(0.1307, 0.3081),
    recipe={"optimizer": "sgd", "lr": 0.01, "momentum": 0.5, "batch_size": 16, "batch_scope": "per_worker", "epochs": 1},
)
def cnn() -> nn.Module:
    """conv 1->32 k3, ReLU, conv 32->32 k3, ReLU, maxpool 2, dropout 0.25, fc 4608->128, ReLU, dropout 0.5, fc 128->10."""
    return nn.Sequential(
        nn.Conv2d(1, 32, 3),
        nn.ReLU(),
        nn.Conv2d(32, 32, 3),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Dropout(0.25),
        nn.Flatten(),
        nn.Linear(4608, 128),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Linear(128, 10),
    )
