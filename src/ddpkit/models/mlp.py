"""W1: the MLP 784-50-ReLU-10, the communication-bound reference workload."""

from torch import nn

from ddpkit.models.spec import ModelSpec


def mlp() -> nn.Module:
    """Flatten 28 x 28 pixels, one hidden layer of 50 ReLU units, 10 logits."""
    return nn.Sequential(nn.Flatten(), nn.Linear(784, 50), nn.ReLU(), nn.Linear(50, 10))


MLP = ModelSpec(
    "mlp",
    mlp,
    "classification",
    {"optimizer": "adam", "lr": 1e-3, "batch_size": 64, "batch_scope": "global", "epochs": 5},
)
"""W1 in the registry, with its training recipe."""
