"""A Checkpointer on an s3:// URL in one process (world size 1) against moto's S3 server on loopback: what it
leaves in the bucket, resuming on another machine (an empty cache), damaged objects, a second run on the
prefix, a fresh start into a used prefix, a store that refuses."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import pytest
import torch

import ddpkit
from ddpkit.checkpoint import CheckpointError, FolderInUseError, remote_checkpoints
from ddpkit.checkpoint.disk.storage import StorageError
from ddpkit.checkpoint.remote import writer as remote_writer
from ddpkit.checkpoint.remote.lease import LEASE_FILE


def _parts(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _train(ckpt: ddpkit.Checkpointer, model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    while ckpt.global_step < steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(ckpt.global_step))
        torch.nn.functional.mse_loss(model(x), x[:, :2]).backward()
        optimizer.step()
        optimizer.zero_grad()
        ckpt.step()


def _checkpointer(url: str, cache: Path, model, optimizer, **options) -> ddpkit.Checkpointer:
    return ddpkit.Checkpointer(
        url, model=model, optimizer=optimizer, every_steps=2, keep=2, on_epoch_end=False, cache=str(cache), **options
    )


def _run(url: str, cache: Path, steps: int, **options) -> tuple[torch.nn.Module, ddpkit.ResumePoint]:
    model, optimizer = _parts()
    ckpt = _checkpointer(url, cache, model, optimizer, **options)
    start = ckpt.resume("auto")
    _train(ckpt, model, optimizer, steps)
    ckpt.close()
    return model, start


def test_the_bucket_holds_the_newest_keep_checkpoints_and_a_new_machine_resumes_them_bit_equal(s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    with s3.environment():
        reference, _ = _run(f"s3://{bucket}/reference", tmp_path / "reference", 9)
        _run(url, tmp_path / "first-machine", 5)
        assert [(i.global_step, i.complete) for i in remote_checkpoints(url)] == [(4, True), (5, True)]
        assert not s3.fs.exists(f"{bucket}/run/{LEASE_FILE}")  # given back at close()
        resumed, start = _run(url, tmp_path / "second-machine", 9)
    assert start.global_step == 5 and start.path == tmp_path / "second-machine" / "step-000000005"
    assert all(torch.equal(a, b) for a, b in zip(reference.state_dict().values(), resumed.state_dict().values()))


@pytest.mark.parametrize("damage", ["truncated", "corrupted"])
def test_a_damaged_newest_object_is_skipped_in_one_line_for_the_previous_checkpoint(s3, tmp_path, caplog, damage):
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    key = f"{bucket}/run/step-000000006/optimizer.pt"
    with s3.environment():
        _run(url, tmp_path / "first", 6)
        data = s3.fs.cat_file(key)
        s3.fs.pipe_file(key, data[:100] if damage == "truncated" else data[:-5] + b"XXXXX")
        with caplog.at_level(logging.WARNING, logger="ddpkit"):
            _, start = _run(url, tmp_path / "second", 8)
    assert start.global_step == 4
    [line] = [r.getMessage() for r in caplog.records if "skipping checkpoint" in r.getMessage()]
    what = "is truncated or damaged: 100 bytes in the store" if damage == "truncated" else "is damaged: its SHA-256"
    assert line.startswith(f"resume=auto: skipping checkpoint {url}/step-000000006: {url}/step-000000006/optimizer.pt")
    assert what in line


def test_a_second_checkpointer_on_a_prefix_in_use_is_refused_naming_the_first(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    with s3.environment():
        model, optimizer = _parts()
        first = _checkpointer(url, tmp_path / "a", model, optimizer)
        first.start()
        second = _checkpointer(url, tmp_path / "b", *_parts())
        with pytest.raises(FolderInUseError, match=rf"^{url} is in use by another run \(host "):
            second.start()
        second.close()
        first.close()


def test_a_fresh_start_into_a_prefix_that_holds_checkpoints_is_refused_before_writing(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    with s3.environment():
        _run(url, tmp_path / "first", 2)
        model, optimizer = _parts()
        ckpt = _checkpointer(url, tmp_path / "second", model, optimizer)
        with pytest.raises(CheckpointError, match=rf"^{url} already holds checkpoints \(newest: step-000000002\); "):
            _train(ckpt, model, optimizer, 2)
        ckpt.close()


def test_a_bucket_that_does_not_exist_stops_the_run_in_one_line_before_training(s3, tmp_path):
    with s3.environment():
        model, optimizer = _parts()
        ckpt = _checkpointer("s3://no-such-bucket-ddpkit/run", tmp_path, model, optimizer)
        with pytest.raises(StorageError) as refused:
            ckpt.resume("auto")
        ckpt.close()
    message = str(refused.value)
    assert message.startswith("s3://no-such-bucket-ddpkit/run cannot be written (") and "\n" not in message
    assert "check the bucket's name, the store's address (AWS_ENDPOINT_URL for S3)" in message


@pytest.mark.parametrize("on_write_error", ["warn", "stop"])
def test_an_upload_that_fails_every_try_warns_or_stops_as_on_write_error_says(
    s3, tmp_path, caplog, monkeypatch, on_write_error
):
    monkeypatch.setattr(remote_writer, "BACKOFF_SECONDS", 0.01)  # the tries' waits, not their number
    bucket = s3.bucket()
    with s3.environment():
        model, optimizer = _parts()
        ckpt = _checkpointer(f"s3://{bucket}/run", tmp_path, model, optimizer, on_write_error=on_write_error)
        ckpt.start()
        s3.fs.rm(bucket, recursive=True)  # the bucket goes away under the run
        with caplog.at_level(logging.WARNING, logger="ddpkit"):
            if on_write_error == "warn":
                _train(ckpt, model, optimizer, 4)
                ckpt.close()
            else:
                _train(ckpt, model, optimizer, 2)
                with pytest.raises(StorageError, match=r"^checkpoint step-000000002 not uploaded in 4 tries \(staged"):
                    ckpt.wait()
                ckpt.close()
    assert (tmp_path / "step-000000002" / "manifest.json").is_file()  # the staged copy is kept
    if on_write_error == "warn":
        warned = [r.getMessage() for r in caplog.records if "not uploaded" in r.getMessage()]
        assert len(warned) >= 2 and warned[0].endswith("(training goes on: on_write_error=warn)")


def test_the_best_checkpoint_is_kept_in_the_bucket_beside_the_newest_keep_ones(s3, tmp_path):
    bucket = s3.bucket()
    url = f"s3://{bucket}/run"
    with s3.environment():
        model, optimizer = _parts()
        ckpt = ddpkit.Checkpointer(
            url, model=model, optimizer=optimizer, keep=1, best_metric="acc", cache=str(tmp_path)
        )
        for epoch, accuracy in enumerate((0.5, 0.9, 0.7, 0.6)):
            _train(ckpt, model, optimizer, 2 * (epoch + 1))
            ckpt.epoch_end({"acc": accuracy})
        ckpt.close()
        steps = [(i.global_step, i.complete) for i in remote_checkpoints(url)]
        best = [(i.global_step, i.complete, i.manifest["metrics"]) for i in remote_checkpoints(url, prefix="best-")]
    assert steps == [(8, True)]
    assert best == [(4, True, {"acc": 0.9})]


def test_the_lease_is_renewed_while_its_run_lives(s3):
    from ddpkit.checkpoint.remote.lease import RemoteLease
    from ddpkit.checkpoint.remote.store import remote_folder

    bucket = s3.bucket()
    key = f"{bucket}/run/{LEASE_FILE}"
    with s3.environment():
        lease = RemoteLease(remote_folder(f"s3://{bucket}/run"), lease_seconds=0.4).acquire()
        first = renewed = json.loads(s3.fs.cat_file(key))["renewed"]
        deadline = time.monotonic() + 10  # every 0.1 s; a loaded machine may delay the first renewals
        while renewed == first and time.monotonic() < deadline:
            time.sleep(0.1)
            renewed = json.loads(s3.fs.cat_file(key))["renewed"]
        lease.release()
    assert renewed > first


def test_resume_given_a_checkpoints_url_stages_it_and_refuses_an_older_one_as_on_disk(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    with s3.environment():
        _run(url, tmp_path / "first", 4)
        model, optimizer = _parts()
        ckpt = _checkpointer(url, tmp_path / "second", model, optimizer)
        start = ckpt.resume(f"{url}/step-000000004")
        ckpt.close()
        ckpt = _checkpointer(url, tmp_path / "third", *_parts())
        with pytest.raises(CheckpointError, match=r"holds checkpoints newer than resume=.*step-000000002"):
            ckpt.resume(f"{url}/step-000000002")
        ckpt.close()
    assert start.global_step == 4 and start.path == tmp_path / "second" / "step-000000004"
