"""The checkpoint package's face: every name it lists resolves, and ddpkit's public names come from it."""

from __future__ import annotations

import ddpkit
import ddpkit.checkpoint


def test_every_name_of_the_face_resolves_to_its_submodules_object() -> None:
    for name in ddpkit.checkpoint.__all__:
        value = getattr(ddpkit.checkpoint, name)
        assert getattr(__import__(ddpkit.checkpoint._PUBLIC[name], fromlist=[name]), name) is value


def test_ddpkit_takes_its_checkpoint_names_from_the_face() -> None:
    from_face = {name for name, module in ddpkit._PUBLIC.items() if module == "ddpkit.checkpoint"}
    assert from_face == {
        "Checkpointer",
        "CheckpointOptions",
        "ResumePoint",
        "CheckpointError",
        "Preempted",
        "list_checkpoints",
        "CheckpointInfo",
        "FolderLock",
        "FolderInUseError",
        "seed_everything",
        "export_checkpoint",
        "apply_transfer",
        "TransferReport",
    }
    assert from_face <= set(ddpkit.checkpoint.__all__)
    assert ddpkit.Checkpointer is ddpkit.checkpoint.Checkpointer
