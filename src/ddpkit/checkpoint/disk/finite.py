"""Non-finite weights never replace finite ones: find them, mark them, never count them.

A run whose loss became NaN or infinite (a learning rate of ``inf`` or
``1e300``, an overflow, a bad batch) goes on producing checkpoints of NaN
weights; counted toward ``keep``, they would prune the last good ones. Three
small parts keep the good ones:

- :func:`nonfinite_tensors`: which floating tensors of a ``state_dict``-like
  structure hold NaN or infinity, for a writer to refuse or set apart a
  save. On a device, one ``torch.isfinite(t).all()`` per tensor, read
  together in one host transfer. On the CPU (the copies a background save
  writes), NumPy's ``isfinite`` in chunks: on one thread, without the GIL,
  where torch's would wake its pool of intra-op threads, which compete with
  the training's threads and loader workers (it also takes twice the time
  on one thread);
- :data:`FINITE_KEY`: a manifest key, ``"finite": false``, that a writer
  passes through ``write_checkpoint``'s ``meta`` for such a checkpoint
  (:func:`nonfinite_marker` builds it);
  :func:`ddpkit.checkpoint.disk.format.prune` never counts a checkpoint so marked
  toward ``keep`` and resume never picks it (:func:`is_marked_nonfinite`);
- :func:`last_finite_checkpoint`: after a run stopped on a non-finite loss,
  the newest complete checkpoint whose weights are finite (those a marker
  does not vouch for are loaded and checked; a sharded checkpoint's marker
  always vouches, since every rank checked its shards as it wrote them).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch before 2.5
    from torch.distributed._tensor import DTensor  # type: ignore[attr-defined]  # private in newer torch's stubs

from ddpkit.checkpoint.disk.format import CheckpointError, list_checkpoints, load_file
from ddpkit.checkpoint.disk.layout import SHARDED_KEY

FINITE_KEY = "finite"
"""Manifest key: False when the checkpoint's tensors hold NaN or infinity (absent: finite, or not checked)."""
NONFINITE_SUFFIX = ".nonfinite"
"""What a checkpoint of non-finite weights is renamed to when it is set aside (never loaded by resume=auto)."""


def nonfinite_tensors(state: Any, prefix: str = "") -> list[str]:
    """The names (dotted paths) of the floating tensors in ``state`` that hold NaN or infinity.

    Args:
        state: a tensor, or mappings, lists and tuples of them (a ``state_dict``, an optimizer's,
            a dict of several); other values are ignored.
        prefix: prepended to every name.

    Returns:
        The names, in the order found; empty when every floating tensor is finite. A sharded tensor
        (DTensor) is judged by this rank's shard.
    """
    names: list[str] = []
    flags: list[torch.Tensor | bool] = []
    _collect(state, prefix, names, flags)
    on_device = [flag for flag in flags if isinstance(flag, torch.Tensor)]
    if on_device:
        # One host transfer for all of them (on a GPU, one synchronisation rather than one per tensor).
        read = iter(torch.stack([flag.to("cpu", non_blocking=False) for flag in on_device]).tolist())
        flags = [next(read) if isinstance(flag, torch.Tensor) else flag for flag in flags]
    return [name for name, ok in zip(names, flags) if not ok]


def _collect(value: Any, name: str, names: list[str], flags: list[torch.Tensor | bool]) -> None:
    if isinstance(value, torch.Tensor):
        if isinstance(value, DTensor):  # a sharded model's: this rank's shard (the caller agrees across ranks)
            value = value.to_local()
        if (value.is_floating_point() or value.is_complex()) and value.numel():
            names.append(name or "tensor")
            flags.append(_all_finite_on_cpu(value) if value.device.type == "cpu" else torch.isfinite(value).all())
    elif isinstance(value, Mapping):
        for key, item in value.items():
            _collect(item, f"{name}.{key}" if name else str(key), names, flags)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _collect(item, f"{name}.{i}" if name else str(i), names, flags)


_CHUNK = 1 << 20
"""Elements NumPy checks at a time: its temporary array of flags stays small and in cache."""
_EXPONENT_BITS = {torch.bfloat16: 0x7F80, torch.float16: 0x7C00}
"""A half-precision value is NaN or infinite when every bit of its exponent is set."""


def _all_finite_on_cpu(tensor: torch.Tensor) -> bool | torch.Tensor:
    """Whether a CPU tensor holds no NaN or infinity: NumPy on one thread for the usual float types."""
    tensor = tensor.detach().resolve_neg()  # NumPy reads the stored values, not a lazy negation
    finite: Callable[[Any], Any]
    if tensor.dtype in (torch.float32, torch.float64):
        values, finite = tensor.reshape(-1).numpy(), np.isfinite
    elif tensor.dtype in _EXPONENT_BITS:
        values, exponent = tensor.reshape(-1).view(torch.int16).numpy(), _EXPONENT_BITS[tensor.dtype]

        def finite(bits: Any) -> Any:
            return (bits & exponent) != exponent

    else:
        return torch.isfinite(tensor).all()  # complex, float8: torch's own (read with the device's flags)
    return all(bool(finite(values[i : i + _CHUNK]).all()) for i in range(0, len(values), _CHUNK))


def nonfinite_marker(names: list[str]) -> dict[str, Any]:
    """The manifest facts a writer adds through ``write_checkpoint``'s ``meta`` for a state whose tensors
    ``names`` hold NaN or infinity (:func:`nonfinite_tensors`): ``{}`` for none, else
    ``{"finite": False, "nonfinite_tensors": [the first 10 names]}``.

    ::

        meta = {**meta, **nonfinite_marker(nonfinite_tensors(objects))}   # objects: file name -> state_dict
    """
    return {FINITE_KEY: False, "nonfinite_tensors": names[:10]} if names else {}


def is_finite_number(value: Any) -> bool:
    """True for a real number that is neither NaN nor infinite (a metric that may become the best)."""
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


def is_marked_nonfinite(manifest: Mapping[str, Any] | None) -> bool:
    """True when a manifest says its checkpoint holds NaN or infinity (``"finite": false``)."""
    return bool(manifest) and manifest.get(FINITE_KEY, True) is False  # type: ignore[union-attr]


def last_finite_checkpoint(root: str | Path, suspect_from: int | None = None) -> tuple[Path | None, list[Path]]:
    """The newest complete checkpoint of ``root`` whose weights are finite, and the non-finite ones newer than it.

    Args:
        root: the checkpoints folder.
        suspect_from: checkpoints at this global step or later are loaded and checked (their weights may
            have diverged before the loss said so); older ones are trusted unless their manifest marks them.
            None checks every one that is not marked.

    Returns:
        (the checkpoint or None, the newer checkpoints found non-finite, newest first).
    """
    bad: list[Path] = []
    for info in reversed(list_checkpoints(root)):
        if info.manifest is None:
            continue
        if is_marked_nonfinite(info.manifest):
            bad.append(info.path)
            continue
        if info.manifest.get(SHARDED_KEY):
            return info.path, bad  # every rank checked its shards when it wrote them: its marker vouches
        if suspect_from is None or info.global_step >= suspect_from:
            try:
                weights = load_file(info.path / "model.pt")
            except CheckpointError:
                continue  # damaged: not a good one, and not ours to judge here (resume sets it aside)
            if nonfinite_tensors(weights):
                bad.append(info.path)
                continue
        return info.path, bad
    return None, bad


__all__ = [
    "FINITE_KEY",
    "NONFINITE_SUFFIX",
    "is_finite_number",
    "is_marked_nonfinite",
    "last_finite_checkpoint",
    "nonfinite_marker",
    "nonfinite_tensors",
]
