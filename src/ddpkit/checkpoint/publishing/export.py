"""Publishing a trained model: weights plus what is needed to rebuild it, without training state.

``ddpkit export CHECKPOINT OUT`` writes a folder::

    OUT/
      model.pt      the model's state_dict: torch.load(..., weights_only=True) and load_state_dict
      model.json    model name, task, input normalization, the checkpoint it came from
                    (step, epoch, metrics), the training config, and the SHA-256 of model.pt

A sharded checkpoint (``shard=True``) is exported the same way: its slices
are assembled a tensor at a time into a ``model.pt`` of the full weights
(:mod:`ddpkit.checkpoint.publishing.sharded_export`). Optimizer, RNG and train state stay behind: an export is for inference and
for ``init_from``. :func:`load_exported` rebuilds the model from the registry
and loads the weights in one call.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint.disk.finite import nonfinite_tensors
from ddpkit.checkpoint.disk.format import (
    CheckpointError,
    folder_mode,
    has_manifest,
    load_file,
    read_manifest,
    verify_checkpoint,
    write_file_atomic,
)
from ddpkit.checkpoint.options import READABLE_BY
from ddpkit.checkpoint.publishing.export_folder import EXPORT_FORMAT, EXPORT_INFO, WEIGHTS, read_export
from ddpkit.checkpoint.publishing.remote_source import local_checkpoint
from ddpkit.checkpoint.publishing.sharded_export import sharded_weights
from ddpkit.checkpoint.publishing.transfer import newest_verified
from ddpkit.checkpoint.remote.store import is_remote
from ddpkit.checkpoint.sharded.state import sharded_names
from ddpkit.errors import UserError, check_choice


def export_checkpoint(checkpoint: str | Path, out: str | Path, readable_by: str = "user") -> Path:
    """Write the weights and model description of ``checkpoint`` to the folder ``out``.

    Args:
        checkpoint: a checkpoint folder, or a checkpoints folder / output_dir
            (its newest verified checkpoint); or such a checkpoint's or run's URL (``s3://...``).
        out: the export folder (created; an earlier export there is replaced).
        readable_by: user, group or all: who may read the files.

    Returns:
        The export folder.

    Raises:
        CheckpointError: the checkpoint is incomplete, corrupt or refused.
        ValueError: ``out`` exists and is not an export, or a bad ``readable_by``.
    """
    check_choice("readable_by", readable_by, tuple(READABLE_BY))
    with local_checkpoint(checkpoint) as (local, name):  # a URL's checkpoint: downloaded and verified
        return _export(local, name if is_remote(checkpoint) else "", Path(out), READABLE_BY[readable_by])


def _export(source: Path, url: str, out: Path, mode: int) -> Path:
    """:func:`export_checkpoint` of the local ``source`` (downloaded from ``url``, when not empty)."""
    if not has_manifest(source):
        source = newest_verified(source)
    verify_checkpoint(source, load=False)  # every file checksummed, as resume does; the weights loaded below
    manifest = read_manifest(source)
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / EXPORT_INFO).exists())):
        raise UserError(f"{out} exists and is not a ddpkit export; choose a new or empty folder for the export")
    out.mkdir(parents=True, exist_ok=True, mode=folder_mode(mode))
    with _weights(source, manifest, out) as state:
        if bad := nonfinite_tensors(state):
            raise CheckpointError(
                f"{source} holds NaN or infinite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
                "export an earlier checkpoint of that run"
            )
        weights = write_file_atomic(out, WEIGHTS, lambda f: torch.save(state, f), mode)
        num_parameters = int(sum(t.numel() for t in state.values()))
    info = {
        "format": EXPORT_FORMAT,
        "created": time.time(),
        "model": manifest.get("model", {}),
        "files": {WEIGHTS: weights},
        "num_parameters": num_parameters,
        "source": {
            "checkpoint": url or str(source.resolve()),
            "global_step": manifest.get("global_step"),
            "completed_epochs": manifest.get("completed_epochs"),
            "metrics": manifest.get("metrics", {}),
        },
        "versions": manifest.get("versions", {}),
        "config": manifest.get("config", {}),
    }
    text = json.dumps(info, indent=2, sort_keys=True) + "\n"
    write_file_atomic(out, EXPORT_INFO, lambda f: f.write(text.encode()), mode)
    fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return out


@contextlib.contextmanager
def _weights(source: Path, manifest: dict[str, Any], out: Path) -> Iterator[dict[str, Any]]:
    """The model's state_dict: its ``model.pt``, or a sharded checkpoint's slices assembled a tensor at a time
    (:mod:`ddpkit.checkpoint.publishing.sharded_export`) in a scratch folder beside the export, removed after."""
    if "model" not in sharded_names(manifest):
        yield load_file(source / WEIGHTS)
        return
    scratch = out / f".weights-{uuid.uuid4().hex[:8]}"
    scratch.mkdir()
    try:
        with sharded_weights(source, scratch) as state:
            yield state
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def load_exported(folder: str | Path, device: str | torch.device = "cpu") -> tuple[nn.Module, dict[str, Any]]:
    """Rebuild the exported model from the registry and load its weights (for inference).

    Returns:
        (the model in eval mode, the export's description).

    Raises:
        CheckpointError: damaged or refused weights.
        ValueError: the model is not registered (nor importable) here.
    """
    from ddpkit.models.registry import get_model_spec

    info, state = read_export(folder)
    model = get_model_spec(info["model"]["name"]).build()
    model.load_state_dict(state)
    return model.to(device).eval(), info
