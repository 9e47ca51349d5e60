"""A sharded model's ``state_dict()`` that cannot be saved with ``torch.save`` by mistake.

After ``prepare_model(model, shard=True)`` (FSDP2), ``model.state_dict()``
holds this rank's shards as DTensors: what ``torch.distributed.checkpoint``
and ``ddpkit.Checkpointer`` want, every rank writing its part. What every
tutorial does instead, ``torch.save(model.state_dict(), path)`` on rank 0,
would write rank 0's shards alone (``fc.weight`` of 5 rows out of 10), a
file that loads nowhere else. Full weights need every rank (an all_gather),
which a save guarded by ``rank == 0`` cannot give without a hang, so the
state dict refuses to be pickled while it holds DTensors, in one line naming
the two ways to full weights. Everything else (``load_state_dict``, DCP's
save, iteration, copies) sees a plain ``OrderedDict``.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor

from ddpkit.errors import UserError

SHARDS_NOT_SAVABLE = (
    "model.state_dict() of a sharded model (prepare_model(shard=True)) holds only this rank's shards, which "
    "torch.save would write as a file that loads nowhere; for full weights save with ddpkit.Checkpointer and "
    "run `ddpkit export CHECKPOINT OUT`, or on every rank call torch.distributed.checkpoint.state_dict."
    "get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)) and "
    "torch.save its result on rank 0"
)


class ShardedStateDict(OrderedDict[str, Any]):
    """An ``OrderedDict`` that refuses pickling (``torch.save``) while any of its values is a DTensor shard."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        if any(isinstance(value, DTensor) for value in self.values()):
            raise UserError(SHARDS_NOT_SAVABLE)
        # Without shards (a full state dict built from this one), pickled as the plain OrderedDict it is.
        return (OrderedDict, (), vars(self) or None, None, iter(self.items()))

    def __copy__(self) -> ShardedStateDict:
        copied = ShardedStateDict(self)
        copied.__dict__.update(vars(self))
        return copied

    def __deepcopy__(self, memo: dict[int, Any]) -> ShardedStateDict:
        copied = ShardedStateDict((key, copy.deepcopy(value, memo)) for key, value in self.items())
        copied.__dict__.update(copy.deepcopy(vars(self), memo))
        return copied


def refuse_saving_shards(model: nn.Module) -> None:
    """Make ``model.state_dict()`` (the root's own call) a :class:`ShardedStateDict`."""

    def wrap(module: nn.Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> Any:
        if prefix:  # the model inside a larger module: the caller's dict is the one returned
            return None
        wrapped = ShardedStateDict(state_dict)
        wrapped.__dict__.update(vars(state_dict))  # _metadata (versions of the modules' formats)
        return wrapped

    model._register_state_dict_hook(wrap)


__all__ = ["SHARDS_NOT_SAVABLE", "ShardedStateDict", "refuse_saving_shards"]
