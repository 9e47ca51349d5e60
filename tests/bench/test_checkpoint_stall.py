"""``ddpkit.bench.checkpoint_stall`` (T10) with a sharded model: a real 2-worker smoke run under ``ddpkit run``."""

from __future__ import annotations

import json

import pytest

from tests.cli_runner import run_ddpkit


@pytest.mark.timeout(300)
def test_the_sharded_stall_benchmark_times_every_kind_of_window_and_finds_the_files_identical(tmp_path) -> None:
    words = ["shard=true", "rounds=1", "width=64", "io=32", "batch_size=8", "every_steps=2", f"folder={tmp_path}"]
    result = run_ddpkit("run", "nproc=2", "-m", "ddpkit.bench.checkpoint_stall", *words, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]  # rank 0 alone prints it
    report = json.loads(line)
    assert report["world_size"] == 2
    assert report["parameters"] == 32 * 64 + 64 + 64 * 64 + 64 + 64 * 32 + 32  # the whole model's, not a shard's
    assert all(len(report["windows_s"][kind]) == 1 for kind in ("none", "sync", "async"))
    assert report["files_identical"] is True  # every worker's shards, background or not
    assert not any(tmp_path.glob("ddpkit-stall-*"))  # its checkpoints are gone


@pytest.mark.parametrize(("word", "words_in_error"), [("device=tpu", "cpu, cuda"), ("widht=8", "did you mean 'width'")])
def test_a_bad_option_is_one_line_naming_the_fix(word, words_in_error) -> None:
    from ddpkit.bench.checkpoint_stall import main

    with pytest.raises(SystemExit) as stopped:
        main([word])
    assert str(stopped.value).startswith("error: ") and words_in_error in str(stopped.value)


@pytest.mark.timeout(300)
def test_the_s3_stall_benchmark_uploads_to_its_own_loopback_server_and_finds_the_objects_identical(tmp_path) -> None:
    words = ["s3=true", "rounds=1", "width=64", "io=32", "batch_size=8", "every_steps=2", f"folder={tmp_path}"]
    result = run_ddpkit("run", "nproc=1", "-m", "ddpkit.bench.checkpoint_stall", *words, cwd=tmp_path, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("{")]
    report = json.loads(line)
    assert report["target"] == "T16" and report["world_size"] == 1
    assert all(len(report["windows_s"][kind]) == 1 for kind in ("none", "sync", "async"))
    assert report["files_identical"] is True  # every object of the uploaded checkpoint equals the local save's file
    assert not any(tmp_path.glob("ddpkit-stall-*"))  # its staged checkpoints are gone
    assert "T16 round 1: none" in result.stderr
