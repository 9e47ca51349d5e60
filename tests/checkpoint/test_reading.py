"""Loading a file that is not a checkpoint: one line naming the file and what it is."""

from __future__ import annotations

import pytest
import torch

from ddpkit.checkpoint.disk.format import CheckpointError
from ddpkit.checkpoint.disk.reading import load_file


def test_a_file_of_text_is_named_not_a_torch_save_file(tmp_path):
    path = tmp_path / "notes.pt"
    path.write_text("garbage\n")
    with pytest.raises(CheckpointError) as refused:
        load_file(path)
    message = str(refused.value)
    assert message.startswith(f"{path} is not a file torch.save wrote (Unsupported operand 103)"), message
    assert "()" not in message and "\n" not in message


def test_a_pickle_that_would_run_code_is_refused_naming_what_it_holds(tmp_path):
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(1), "run": print}, path)  # a global a weights-only load refuses
    with pytest.raises(CheckpointError) as refused:
        load_file(path)
    message = str(refused.value)
    assert message.startswith(f"refused to load {path}: it holds objects other than tensors"), message
    assert "GLOBAL print" in message and "()" not in message


@pytest.mark.parametrize("name", ["../elsewhere.pt", "/dev/zero", "sub/model.pt", ".."])
def test_a_manifest_that_lists_a_file_outside_its_folder_is_damaged(tmp_path, name):
    import json

    from ddpkit.checkpoint.disk.format import checkpoint_name, verify_checkpoint, write_checkpoint

    checkpoint = write_checkpoint(tmp_path, checkpoint_name(1), {"model.pt": {"w": torch.ones(2)}}, {}, {})
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"bytes": 0, "sha256": "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=f"it lists the file '{name}', outside the checkpoint's folder"):
        verify_checkpoint(checkpoint)
