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


def garble_a_slice(checkpoint: Path, outside: Path) -> None:
    """The header of rank 1's first slice overwritten (the file's size kept), the manifest re-hashed."""
    shard = checkpoint / "__1_0.distcp"
    os.chmod(shard, 0o600)
    data = bytearray(shard.read_bytes())
    data[:32] = bytes(32)
    shard.write_bytes(bytes(data))
    _rehash(checkpoint, "__1_0.distcp")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, list[torch.Tensor], str]:
    """An uninterrupted run to step 8's weights, and a run stopped at step 6 (to copy and break) with its log."""
    root = tmp_path_factory.mktemp("ckptsafe")
    (root / "whole").mkdir()
    (root / "stopped").mkdir()
    with Commands() as commands:
        whole = _train(commands, root / "whole", 8)
        stopped = _train(commands, root / "stopped", 6)
    assert whole.returncode == 0, whole.stderr
    assert stopped.returncode == 0, stopped.stderr
    return root / "stopped", torch.load(root / "whole" / "final.pt", weights_only=True), stopped.stdout + stopped.stderr


@pytest.mark.parametrize("breaking", [remove_a_shard, point_outside, garble_a_slice])
def test_an_unloadable_sharded_checkpoint_is_set_aside_and_the_previous_one_resumes(
    reference, tmp_path, breaking
) -> None:
    stopped, weights, _ = reference
    folder = tmp_path / "run"
    shutil.copytree(stopped, folder)
    breaking(folder / "ck" / "step-000000006", tmp_path / "elsewhere.distcp")
    with Commands() as commands:
        listing = commands.run("checkpoints", "ck", cwd=folder)
        resumed = _train(commands, folder, 8)
    assert listing.returncode == 1
    row = next(line for line in listing.stdout.splitlines() if line.startswith("step-000000006 "))
    assert "CORRUPT: " in row and "Traceback" not in listing.stdout + listing.stderr, listing.stdout
    assert resumed.returncode == 0, resumed.stderr
    assert "set ck/step-000000006 aside as step-000000006.corrupt" in resumed.stdout + resumed.stderr
    assert "resumed from ck/step-000000004" in resumed.stdout + resumed.stderr
    got = torch.load(folder / "final.pt", weights_only=True)
    assert all(torch.equal(a, b) for a, b in zip(got, weights, strict=True))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_and_init_from_refuse_an_index_that_points_outside_the_folder(reference, tmp_path) -> None:
    import ddpkit
    from ddpkit.checkpoint.publishing.transfer import read_weights

    stopped, _, _ = reference
    checkpoint = tmp_path / "step-000000006"
    shutil.copytree(stopped / "ck" / "step-000000006", checkpoint)
    point_outside(checkpoint, tmp_path / "elsewhere.distcp")
    outside = "names the file '.*elsewhere.distcp', outside the checkpoint's folder"
    with pytest.raises(ddpkit.CheckpointError, match=outside):
        ddpkit.export_checkpoint(checkpoint, tmp_path / "export")
    assert not (tmp_path / "export" / "model.pt").exists()
    with pytest.raises(ddpkit.CheckpointError, match=outside):
        read_weights(checkpoint)


def test_a_full_disk_under_a_sharded_run_stops_with_74_in_one_line_and_resumes_bit_equal(tmp_path) -> None:
    from tests.checkpoint.test_storage import page_bytes, remount, tmpfs

    reference, run = tmp_path / "reference", tmp_path / "run"
    reference.mkdir()
    run.mkdir()
    with Commands() as commands:
        whole = commands.run("run", "nproc=2", str(SCRIPT), "ck", "final.pt", "8", "20000", cwd=reference)
        assert whole.returncode == 0, whole.stderr
        # Room for step 2's checkpoint (3.2 MB) and the lock's files, and a page more: each rank's first
        # tensor of step 4's checkpoint fails inside torch.save, which reports it as "unexpected pos".
        size = page_bytes(reference / "ck" / "step-000000008") + 3 * 4096
        with tmpfs(run / "ck", size):
            out = commands.run("run", "nproc=2", str(SCRIPT), "ck", "final.pt", "8", "20000", cwd=run)
            assert out.returncode == 74, out.stderr
            said = out.stdout + out.stderr  # warned before training: the folder holds one checkpoint, not keep + 1
            assert said.index("a save will fail for lack of space") < said.index("resume=auto: no checkpoint"), said
            errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "Traceback" not in out.stderr and "unexpected pos" not in out.stderr
            assert "cannot write checkpoint ck/step-000000004: No space left on device (" in errors[0], errors
            assert "the newest complete checkpoint ck/step-000000002 is untouched" in errors[0], errors
            remount(run / "ck", f"size={4 * size}")
            out = commands.run("run", "nproc=2", str(SCRIPT), "ck", "final.pt", "8", "20000", cwd=run)
            assert out.returncode == 0, out.stderr
            assert "resumed from ck/step-000000002" in out.stdout + out.stderr
    got = torch.load(run / "final.pt", weights_only=True)
    assert all(
        torch.equal(a, b) for a, b in zip(got, torch.load(reference / "final.pt", weights_only=True), strict=True)
    )


def test_a_checkpoint_changed_and_rehashed_verifies_but_not_against_the_digest_its_save_logged(
    reference, tmp_path
) -> None:
    stopped, _, log = reference
    said = [line for line in log.splitlines() if "checkpoint ck/step-000000004 (every_steps" in line]
    assert len(said) == 1 and said[0].split(", digest ")[1].isalnum(), log
    digest = said[0].split(", digest ")[1]
    folder = tmp_path / "run"
    shutil.copytree(stopped, folder)
    checkpoint = folder / "ck" / "step-000000004"
    with Commands() as commands:
        kept = commands.run("checkpoints", str(checkpoint), f"digest={digest}", cwd=folder)
        # Someone who can write the folder swaps in step 6's weights for rank 0 and re-hashes the manifest.
        os.chmod(checkpoint / "__0_0.distcp", 0o600)
        shutil.copyfile(folder / "ck" / "step-000000006" / "__0_0.distcp", checkpoint / "__0_0.distcp")
        _rehash(checkpoint, "__0_0.distcp")
        listing = commands.run("checkpoints", "ck", cwd=folder)
        changed = commands.run("checkpoints", str(checkpoint), f"digest={digest}", cwd=folder)
    assert kept.returncode == 0, kept.stderr
    assert kept.stdout == f"{checkpoint}: ok, every file verifies and matches the digest {digest}\n"
    assert listing.returncode == 0 and digest not in listing.stdout  # its manifest verifies: a new digest
    assert changed.returncode == 1 and changed.stdout == ""
    assert changed.stderr.startswith(
        f"ddpkit: checkpoint {checkpoint} does not match the digest {digest}: its digest is "
    )
    assert (
        changed.stderr.endswith("do not use it; restore it from a copy you trust\n") and changed.stderr.count("\n") == 1
    )
