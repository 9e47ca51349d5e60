"""Checkpoint files: complete-or-absent writes, verification, safe loading, retention, best."""

import hashlib
import json
import os
import stat

import pytest
import torch

from ddpkit.checkpoint.disk.format import (
    MANIFEST,
    CheckpointError,
    checkpoint_name,
    list_checkpoints,
    load_file,
    mark_best,
    prune,
    verify_checkpoint,
    write_checkpoint,
    write_file_atomic,
)
from tests.train.checkpoint_helpers import train


def _write(root, step, mode=0o600, **meta):
    objects = {"model.pt": {"w": torch.full((4,), float(step))}, "train.pt": {"step": step}}
    return write_checkpoint(
        root, checkpoint_name(step), objects, {"config.yaml": "a: 1\n"}, {"global_step": step, **meta}, mode
    )


class Payload:
    """Unpickling this creates the file ``path``: what a malicious checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def plant_payload(folder, sentinel, name="model.pt"):
    """Replace ``folder/name`` by a crafted pickle and fix the manifest's checksum to match it."""
    torch.save({"w": Payload(sentinel)}, folder / name)
    manifest = json.loads((folder / MANIFEST).read_text())
    data = (folder / name).read_bytes()
    manifest["files"][name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def test_written_checkpoint_verifies_and_is_private(tmp_path):
    path = _write(tmp_path, 7)
    loaded = verify_checkpoint(path)
    assert torch.equal(loaded["model.pt"]["w"], torch.full((4,), 7.0))
    assert loaded["manifest"]["global_step"] == 7
    assert set(loaded["manifest"]["files"]) == {"model.pt", "train.pt", "config.yaml"}
    assert stat.S_IMODE(path.stat().st_mode) == 0o700
    for file in path.iterdir():
        assert stat.S_IMODE(file.stat().st_mode) == 0o600, file
    assert not [p for p in path.iterdir() if p.name.startswith(".")], "temporary files left behind"


def test_group_readable_mode_ignores_umask(tmp_path):
    old = os.umask(0o077)
    try:
        path = _write(tmp_path, 1, mode=0o640)
    finally:
        os.umask(old)
    assert stat.S_IMODE((path / "model.pt").stat().st_mode) == 0o640
    assert stat.S_IMODE(path.stat().st_mode) == 0o750


def test_truncated_file_is_named(tmp_path):
    path = _write(tmp_path, 3)
    data = (path / "model.pt").read_bytes()
    (path / "model.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.pt is truncated"):
        verify_checkpoint(path)


def test_flipped_byte_is_found(tmp_path):
    path = _write(tmp_path, 3)
    data = bytearray((path / "train.pt").read_bytes())
    data[len(data) // 2] ^= 1
    (path / "train.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"train\.pt is damaged: its SHA-256"):
        verify_checkpoint(path)


def test_no_manifest_means_incomplete(tmp_path):
    path = _write(tmp_path, 3)
    (path / MANIFEST).unlink()
    assert not list_checkpoints(tmp_path)[0].complete
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        verify_checkpoint(path)


def test_crafted_pickle_is_refused_and_never_runs(tmp_path):
    path = _write(tmp_path, 5)
    sentinel = tmp_path / "sentinel"
    plant_payload(path, sentinel)
    with pytest.raises(CheckpointError, match="refused to load .*model.pt.*weights_only=True"):
        verify_checkpoint(path)
    with pytest.raises(CheckpointError, match="refused to load") as refused:
        load_file(path / "model.pt")
    assert not sentinel.exists()
    # What the file holds, without torch's advice to load it with weights_only=False (which would run it).
    assert "GLOBAL io.open" in str(refused.value) and "weights_only=False" not in str(refused.value)


def test_failed_write_leaves_no_file(tmp_path):
    def explode(f):
        f.write(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_file_atomic(tmp_path, "x.pt", explode)
    assert list(tmp_path.iterdir()) == []


def test_prune_keeps_newest_complete_and_never_deletes_folders_without_a_manifest(tmp_path):
    for step in (1, 2, 3, 4):
        _write(tmp_path, step)
    (tmp_path / checkpoint_name(2) / MANIFEST).unlink()  # an interrupted write, or a copy still in progress
    (tmp_path / checkpoint_name(9)).mkdir()  # the same, newer than everything
    deleted = prune(tmp_path, keep=2)
    names = [info.path.name for info in list_checkpoints(tmp_path)]
    assert names == [checkpoint_name(2), checkpoint_name(3), checkpoint_name(4), checkpoint_name(9)]
    assert sorted(p.name for p in deleted) == [checkpoint_name(1)]


def test_prune_never_counts_a_checkpoint_marked_non_finite(tmp_path):
    for step in (1, 2):
        _write(tmp_path, step)
    for step in (3, 4, 5):  # a diverged run goes on saving NaN weights
        _write(tmp_path, step, finite=False)
    assert prune(tmp_path, keep=2) == []
    names = [info.path.name for info in list_checkpoints(tmp_path) if info.finite]
    assert names == [checkpoint_name(1), checkpoint_name(2)]  # the last good ones are kept
    _write(tmp_path, 6)
    assert [p.name for p in prune(tmp_path, keep=2)] == [checkpoint_name(1)]


def test_rewriting_an_interrupted_step_replaces_it(tmp_path):
    leftover = tmp_path / checkpoint_name(6)
    leftover.mkdir()
    (leftover / "model.pt").write_bytes(b"half a file")
    path = _write(tmp_path, 6)
    assert verify_checkpoint(path)["manifest"]["global_step"] == 6


def test_best_survives_pruning_of_its_step(tmp_path):
    first = _write(tmp_path, 1)
    best = mark_best(tmp_path, first)
    for step in (2, 3, 4):
        _write(tmp_path, step)
        prune(tmp_path, keep=2)
    assert not first.exists()
    assert torch.equal(verify_checkpoint(best)["model.pt"]["w"], torch.full((4,), 1.0))
    newer = mark_best(tmp_path, tmp_path / checkpoint_name(4))
    assert not best.exists() and newer.name == "best-000000004"


def test_cadence_retention_and_metrics_lines_during_training(tmp_path):
    train(
        0,
        1,
        [
            "model=tests.train.checkpoint_helpers:mlp_dropout",
            "synthetic_samples=90",
            "batch_size=8",
            "epochs=2",
            f"output_dir={tmp_path}",
            "checkpoint.every_steps=5",
            "checkpoint.every_seconds=0.000001",
            "checkpoint.sync_seconds=0.000001",
            "checkpoint.keep=3",
        ],
    )
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    saved = [(line["global_step"], line["reason"]) for line in lines if line["event"] == "checkpoint"]
    # Every step is an agreement (sync_seconds tiny) and a timed save is always due; an epoch's end is
    # written once, after the code that follows its batch loop (at the next epoch's start, and at the end
    # of training), with its evaluation's metrics.
    assert [step for step, _ in saved] == list(range(1, 25))
    assert dict(saved)[5] == "every_seconds" and dict(saved)[12] == "epoch_end" and dict(saved)[24] == "epoch_end"
    root = tmp_path / "checkpoints"
    assert [info.global_step for info in list_checkpoints(root)] == [22, 23, 24]
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
