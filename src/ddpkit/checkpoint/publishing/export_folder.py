"""An export folder (``ddpkit export``): its files, and reading one back with its weights verified.

Written by :mod:`ddpkit.checkpoint.publishing.export`, read by it (``load_exported``) and
by :mod:`ddpkit.checkpoint.publishing.transfer` (``init_from`` an export). export imports
transfer (``newest_verified``), so transfer reads exports here, not in export.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from ddpkit.checkpoint.disk.format import CheckpointError, load_file

EXPORT_INFO = "model.json"
"""The file that marks an export folder (written by ``ddpkit export``)."""
EXPORT_FORMAT = "ddpkit-export/1"
"""Value of model.json's ``format`` key."""
WEIGHTS = "model.pt"
"""The exported state_dict, beside model.json."""


def read_export(folder: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The description and the verified weights of an export folder.

    Raises:
        CheckpointError: not an export, or its weights are damaged or refused.
    """
    folder = Path(folder)
    try:
        info = json.loads((folder / EXPORT_INFO).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{folder} is not a readable ddpkit export ({e}); run ddpkit export first") from None
    if not isinstance(info, dict) or info.get("format") != EXPORT_FORMAT:
        raise CheckpointError(f"{folder / EXPORT_INFO} is not a {EXPORT_FORMAT} file; run ddpkit export again")
    expected = info["files"][WEIGHTS]
    data = (folder / WEIGHTS).read_bytes()
    if len(data) != expected["bytes"] or hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(
            f"{folder / WEIGHTS} is damaged (size or SHA-256 differs from {EXPORT_INFO}); export it again"
        )
    return info, load_file(folder / WEIGHTS, data=data)
