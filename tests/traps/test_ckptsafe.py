"""A sharded checkpoint that verifies but cannot load is set aside, and the run resumes the previous one.

The user's script (``scripts/ckptsafe_sharded.py``: FSDP2, a checkpoint every 2 steps) runs under
``ddpkit run nproc=2`` to step 6; its newest checkpoint is then broken in ways its manifest does not show
(a shard removed and the manifest edited to match; the DCP index pointed at a file outside the folder,
the manifest re-hashed), and the same command runs on to step 8. ``ddpkit checkpoints`` must list the
broken one as corrupt, the run must set it aside, resume step 4 and end with the weights of an
uninterrupted run (``torch.equal``); export and ``init_from`` must refuse the outside file.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tests.helpers.launch_in_process import Commands

SCRIPT = Path(__file__).resolve().parent / "scripts" / "ckptsafe_sharded.py"
MANIFEST = "manifest.json"


def _train(commands: Commands, folder: Path, steps: int):
    return commands.run("run", "nproc=2", str(SCRIPT), "ck", "final.pt", str(steps), cwd=folder)


def _rehash(checkpoint: Path, *names: str, drop: tuple[str, ...] = ()) -> None:
    """What a forger does: the manifest lists ``names`` with their new sizes and SHA-256, and no ``drop``."""
    manifest = json.loads((checkpoint / MANIFEST).read_text())
    for name in drop:
        del manifest["files"][name]
    for name in names:
        data = (checkpoint / name).read_bytes()
        manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    os.chmod(checkpoint / MANIFEST, 0o600)
    (checkpoint / MANIFEST).write_text(json.dumps(manifest))


def remove_a_shard(checkpoint: Path, outside: Path) -> None:
    """Rank 1's shard deleted, and the manifest edited to match."""
    (checkpoint / "__1_0.distcp").unlink()
    _rehash(checkpoint, drop=("__1_0.distcp",))


def point_outside(checkpoint: Path, outside: Path) -> None:
    """Rank 1's shard moved out of the folder, the index pointed at it, the manifest re-hashed."""
    shutil.move(checkpoint / "__1_0.distcp", outside)
    index = pickle.loads((checkpoint / ".metadata").read_bytes())
    for entry in index.storage_data.values():
        if entry.relative_path == "__1_0.distcp":
            entry.relative_path = str(outside)
    os.chmod(checkpoint / ".metadata", 0o600)
    (checkpoint / ".metadata").write_bytes(pickle.dumps(index))
    _rehash(checkpoint, ".metadata", drop=("__1_0.distcp",))


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[torch.Tensor]]:
    """An uninterrupted run to step 8, and a copy of a run stopped at step 6 (to break)."""
    root = tmp_path_factory.mktemp("ckptsafe")
    (root / "whole").mkdir()
    (root / "stopped").mkdir()
    with Commands() as commands:
        whole = _train(commands, root / "whole", 8)
        stopped = _train(commands, root / "stopped", 6)
    assert whole.returncode == 0, whole.stderr
    assert stopped.returncode == 0, stopped.stderr
    return root / "stopped", torch.load(root / "whole" / "final.pt", weights_only=True)


@pytest.mark.parametrize("breaking", [remove_a_shard, point_outside])
def test_an_unloadable_sharded_checkpoint_is_set_aside_and_the_previous_one_resumes(
    reference, tmp_path, breaking
) -> None:
    stopped, weights = reference
    folder = tmp_path / "run"
    shutil.copytree(stopped, folder)
    breaking(folder / "ck" / "step-000000006", tmp_path / "elsewhere.distcp")
    with Commands() as commands:
        listing = commands.run("checkpoints", "ck", cwd=folder)
        resumed = _train(commands, folder, 8)
    assert listing.returncode == 1
    assert "step-000000006     6" in listing.stdout and "CORRUPT: checkpoint ck/step-000000006 is corrupt" in listing.stdout
    assert resumed.returncode == 0, resumed.stderr
    assert "set ck/step-000000006 aside as step-000000006.corrupt" in resumed.stdout + resumed.stderr
    assert "resumed from ck/step-000000004" in resumed.stdout + resumed.stderr
    got = torch.load(folder / "final.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(got, weights, strict=True))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_and_init_from_refuse_an_index_that_points_outside_the_folder(reference, tmp_path) -> None:
    import ddpkit
    from ddpkit.checkpoint.transfer import read_weights

    stopped, _ = reference
    checkpoint = tmp_path / "step-000000006"
    shutil.copytree(stopped / "ck" / "step-000000006", checkpoint)
    point_outside(checkpoint, tmp_path / "elsewhere.distcp")
    outside = "names the file '.*elsewhere.distcp', outside the checkpoint's folder"
    with pytest.raises(ddpkit.CheckpointError, match=outside):
        ddpkit.export_checkpoint(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export" / "model.pt").exists()
    with pytest.raises(ddpkit.CheckpointError, match=outside):
        read_weights(checkpoint)
