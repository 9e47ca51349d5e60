"""W3: a fully connected autoencoder 784-128-128-128-784, trained to reproduce its input."""

from torch import nn

from ddpkit.models.spec import ModelSpec


def autoencoder() -> nn.Module:
    """784-128-128-128-784 with ReLU after every layer; output shaped like the input."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 128),
        nn.ReLU(),
        nn.Linear(128, 784),
        nn.ReLU(),
        nn.Unflatten(1, (1, 28, 28)),
    )


AUTOENCODER = ModelSpec(
    "autoencoder",
    autoencoder,
    "reconstruction",
    {"optimizer": "adam", "lr": 1e-3, "batch_size": 128, "batch_scope": "global", "epochs": 2},
)
"""W3 in the registry, with its training recipe."""
