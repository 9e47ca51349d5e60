"""Checkpoint folders to and from a real S3 server (moto on loopback): the manifest last on the way up,
every file verified on the way down, pruning manifest-first, and the lease that keeps one run per prefix."""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.checkpoint import (
    CheckpointError,
    FolderInUseError,
    fetch_checkpoint,
    is_remote,
    remote_checkpoints,
    upload_checkpoint,
)
from ddpkit.checkpoint.disk.format import write_checkpoint
from ddpkit.checkpoint.remote.lease import LEASE_FILE, RemoteLease
from ddpkit.checkpoint.remote.store import remote_folder
from ddpkit.checkpoint.remote.transfer import prune_remote
from ddpkit.errors import UserError
from ddpkit.train.storage_url import check_storage_url


def _checkpoint(root: Path, step: int) -> Path:
    state = {"model.pt": {"w": torch.full((64,), float(step))}, "train.pt": {"global_step": step}}
    return write_checkpoint(root, f"step-{step:09d}", state, {}, {"global_step": step})


@pytest.mark.parametrize(
    "path, remote",
    [
        ("s3://bucket/run", True),
        ("gs://bucket/run", True),
        ("S3://bucket/run", True),
        ("file:///tmp/run", False),
        ("/tmp/s3://odd", False),
        ("runs/a", False),
        (Path("runs/a"), False),
        ("C:\\runs\\a", False),
    ],
)
def test_is_remote_tells_urls_of_other_file_systems_from_local_paths(path, remote):
    assert is_remote(path) is remote


def test_a_scheme_no_file_system_knows_is_one_line_naming_what_to_use():
    with pytest.raises(UserError, match=r"^nosuch://b/run: no file system is known for nosuch://; use s3://"):
        remote_folder("nosuch://b/run")


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_a_store_whose_library_is_missing_is_one_line_naming_the_package(tmp_path):
    with pytest.raises(
        UserError,
        match=r"^gs://b/run needs gcsfs, which is not installed: pip install gcsfs; or write to a local folder$",
    ):
        ddpkit.Checkpointer("gs://b/run", model=torch.nn.Linear(2, 2), cache=str(tmp_path))


@pytest.mark.skipif(importlib.util.find_spec("gcsfs") is not None, reason="gcsfs is installed here")
def test_the_trainer_s_check_and_the_checkpointer_name_a_missing_library_alike():
    with pytest.raises(UserError) as checked:
        check_storage_url("checkpoint.dir", "gs://b/run")
    with pytest.raises(UserError) as opened:
        remote_folder("gs://b/run")
    hint = "needs gcsfs, which is not installed: pip install gcsfs"
    assert (str(checked.value), str(opened.value)) == (
        f"checkpoint.dir=gs://b/run {hint}",
        f"gs://b/run {hint}; or write to a local folder",
    )


def test_a_url_that_pathlib_folded_is_refused_in_one_line_instead_of_making_a_folder_named_s3(tmp_path):
    with pytest.raises(UserError) as refused:
        ddpkit.Checkpointer(Path("s3://bucket/run"), model=torch.nn.Linear(2, 2))
    assert str(refused.value) == (
        "checkpoint folder s3:/bucket/run is the URL s3://bucket/run with its // folded into / (pathlib.Path does "
        "that); pass the URL as a string"
    )


def test_an_uploaded_checkpoint_is_listed_complete_and_fetched_verified(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    local = _checkpoint(tmp_path / "local", 4)
    with s3.environment():
        assert upload_checkpoint(local, url) == f"{url}/step-000000004"
        [info] = remote_checkpoints(url)
        copy = fetch_checkpoint(f"{url}/step-000000004", tmp_path / "cache")
    assert info.complete and info.global_step == 4 and info.url == f"{url}/step-000000004"
    assert copy == tmp_path / "cache" / "step-000000004"
    assert sorted(p.name for p in copy.iterdir()) == sorted(p.name for p in local.iterdir())
    assert torch.equal(torch.load(copy / "model.pt")["w"], torch.full((64,), 4.0))


def test_a_staged_copy_damaged_since_its_download_is_downloaded_again(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    with s3.environment():
        upload_checkpoint(_checkpoint(tmp_path / "local", 4), url)
        copy = fetch_checkpoint(f"{url}/step-000000004", tmp_path / "cache")
        (copy / "model.pt").write_bytes(b"damaged on this disk")
        again = fetch_checkpoint(f"{url}/step-000000004", tmp_path / "cache")
    assert again == copy and torch.equal(torch.load(again / "model.pt")["w"], torch.full((64,), 4.0))


def test_a_checkpoint_whose_manifest_is_not_uploaded_is_incomplete_and_refused(s3, tmp_path):
    bucket = s3.bucket()
    local = _checkpoint(tmp_path / "local", 2)
    s3.fs.put_file(str(local / "model.pt"), f"{bucket}/run/step-000000002/model.pt")  # an upload cut off
    with s3.environment():
        [info] = remote_checkpoints(f"s3://{bucket}/run")
        assert not info.complete
        with pytest.raises(CheckpointError, match=r"step-000000002 is not a complete checkpoint: it has no manifest"):
            fetch_checkpoint(f"s3://{bucket}/run/step-000000002", tmp_path / "cache")
    assert not (tmp_path / "cache" / "step-000000002").exists()


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda data: data[: len(data) // 2], r"model\.pt is truncated or damaged: \d+ bytes in the store, \d+ in the"),
        (lambda data: data[:-9] + bytes([data[-9] ^ 1]) + data[-8:], r"model\.pt is damaged: its SHA-256 does not"),
    ],
    ids=["truncated", "corrupted"],
)
def test_a_truncated_or_corrupted_object_is_refused_in_one_line_and_leaves_no_copy(s3, tmp_path, damage, message):
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    with s3.environment():
        upload_checkpoint(_checkpoint(tmp_path / "local", 6), url)
        key = f"{bucket}/run/step-000000006/model.pt"
        s3.fs.pipe_file(key, damage(s3.fs.cat_file(key)))
        with pytest.raises(CheckpointError, match=message) as refused:
            fetch_checkpoint(f"{url}/step-000000006", tmp_path / "cache")
    assert "\n" not in str(refused.value) and str(refused.value).startswith(f"{url}/step-000000006/model.pt")
    assert not list((tmp_path / "cache").iterdir())  # the partial download is gone, nothing looks complete


def test_an_upload_that_replaces_a_checkpoint_removes_its_old_manifest_first(s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    with s3.environment():
        upload_checkpoint(_checkpoint(tmp_path / "a", 3), url)
        first = s3.fs.cat_file(f"{bucket}/run/step-000000003/manifest.json")
        replacement = _checkpoint(tmp_path / "b", 3)
        (replacement / "model.pt").unlink()  # an upload that fails after the old manifest went
        with pytest.raises(FileNotFoundError):
            upload_checkpoint(replacement, url)
        [info] = remote_checkpoints(url)
    assert json.loads(first)["global_step"] == 3
    assert not info.complete  # never the old manifest over new files


def test_pruning_keeps_the_newest_complete_ones_and_never_one_being_uploaded(s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    with s3.environment():
        for step in (1, 2, 3, 4):
            upload_checkpoint(_checkpoint(tmp_path / "local", step), url)
        s3.fs.pipe_file(f"{bucket}/run/step-000000005/model.pt", b"partial")  # an upload in progress
        folder = remote_folder(url)
        assert prune_remote(folder, keep=2, protect="step-000000004") == ["step-000000001", "step-000000002"]
        left = [(i.global_step, i.complete) for i in remote_checkpoints(url)]
    assert left == [(3, True), (4, True), (5, False)]


def test_a_second_run_on_a_prefix_is_refused_naming_the_holder_until_the_first_ends(s3):
    bucket = s3.bucket()
    with s3.environment():
        folder = remote_folder(f"s3://{bucket}/run")
        first = RemoteLease(folder).acquire()
        with pytest.raises(FolderInUseError) as refused:
            RemoteLease(folder).acquire()
        first.release()
        second = RemoteLease(folder).acquire()
        second.release()
    message = str(refused.value)
    assert message.startswith(f"s3://{bucket}/run is in use by another run (host ")
    assert f"if that run is gone, delete s3://{bucket}/run/{LEASE_FILE}, or wait 120 s" in message
    assert "\n" not in message
    assert not s3.fs.exists(f"{bucket}/run/{LEASE_FILE}")


def test_a_lease_its_holder_stopped_renewing_is_taken_over(s3):
    bucket = s3.bucket()
    stale = {"host": "gone-node", "pid": 1, "since": 0, "command": "x", "token": "t", "renewed": time.time() - 600}
    s3.fs.pipe_file(f"{bucket}/run/{LEASE_FILE}", json.dumps(stale).encode())
    with s3.environment():
        lease = RemoteLease(remote_folder(f"s3://{bucket}/run")).acquire()
        holder = json.loads(s3.fs.cat_file(f"{bucket}/run/{LEASE_FILE}"))
        lease.release()
    assert holder["host"] != "gone-node" and holder["token"] != "t"


def test_a_restarted_worker_waits_for_its_predecessors_lease_on_another_host_to_lapse(s3):
    bucket = s3.bucket()
    with s3.environment():
        folder = remote_folder(f"s3://{bucket}/run")  # its client made before the clock starts
        now = time.time()
        held = {"host": "lost-node", "pid": 7, "since": now, "token": "t", "renewed": now, "lease_seconds": 4.0}
        folder.fs.pipe_file(folder.join(LEASE_FILE), json.dumps(held).encode())
        with pytest.raises(FolderInUseError, match="host lost-node, pid 7"):
            RemoteLease(folder, lease_seconds=4.0).acquire()  # a new run: refused at once
        lease = RemoteLease(folder, lease_seconds=4.0).acquire(restarted=True)
        waited = time.time() - now
        lease.release()
    assert waited >= 4.0
