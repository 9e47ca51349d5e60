"""T16's check that a checkpoint in object storage is the same bytes as one written to a local folder.

One Checkpointer saves the state into a local folder, another the same state to a URL (staged, then
uploaded); each object under the remote checkpoint is read back raw and compared with the local file of
its name. The manifests are compared without their ``created`` time, the one fact that differs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from torch import nn

from ddpkit.checkpoint import MANIFEST, Checkpointer


def same_objects(model: nn.Module, optimizer: Any, tmp: Path, url: str) -> bool:
    """Save the state to ``tmp/same-sync`` and to ``url``; True when every object equals its local file."""
    local = Checkpointer(tmp / "same-sync", model=model, optimizer=optimizer, on_epoch_end=False, preempt_signals=())
    local_path = local.save()
    local.close()
    remote = Checkpointer(
        url,
        model=model,
        optimizer=optimizer,
        on_epoch_end=False,
        preempt_signals=(),
        cache=str(tmp / "staging-same"),
    )
    remote_path = remote.save()
    remote.wait()  # uploaded
    remote.close()
    if local_path is None or remote_path is None:
        return False
    import fsspec  # type: ignore[import-untyped]  # fsspec ships no type information

    fs, root = fsspec.core.url_to_fs(f"{url}/{local_path.name}")
    objects = {path.rsplit("/", 1)[-1]: path for path in fs.find(root)}
    if sorted(objects) != sorted(p.name for p in local_path.iterdir()):
        return False
    for name, path in objects.items():
        mine, theirs = (local_path / name).read_bytes(), fs.cat_file(path)
        if name == MANIFEST:
            mine, theirs = (_without_time(json.loads(data)) for data in (mine, theirs))
        if mine != theirs:
            return False
    return True


def _without_time(manifest: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in manifest.items() if key != "created"}
