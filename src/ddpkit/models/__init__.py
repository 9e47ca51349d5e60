"""Models by name: the reference workloads and any the user registers."""

from ddpkit.models.registry import MODELS, get_model_spec, register_model
from ddpkit.models.spec import ModelSpec

__all__ = ["MODELS", "ModelSpec", "get_model_spec", "register_model"]
