"""``ddpkit checkpoints``, ``export`` and ``plot`` given a URL: the bucket's checkpoints listed and verified, one
checkpoint checked against its digest, and a URL where only a local folder can work refused in one line.

The checkpoints are written by a Checkpointer on the URL (staged, uploaded) to moto's S3 server on loopback
(tests/helpers/s3.py); the commands run in this process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ddpkit.checkpoint import Checkpointer, checkpoint_digest, remote_checkpoints
from ddpkit.commands.dispatch import main
from tests.helpers.s3 import s3  # noqa: F401  # the session's server (a fixture)


@pytest.fixture
def run_url(s3, tmp_path, monkeypatch):  # noqa: F811
    """A bucket's prefix holding the uploaded checkpoints of steps 2 and 4 (and the best mark of step 4)."""
    url = f"s3://{s3.bucket()}/run"
    model = nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with s3.environment():
        ckpt = Checkpointer(url, model=model, optimizer=optimizer, preempt_signals=(), cache=str(tmp_path / "staged"))
        for step in (2, 4):
            ckpt.global_step = step
            with torch.no_grad():
                model.weight.add_(1.0)
            ckpt.save()
        ckpt.close()
    for name, value in s3.env.items():  # the commands below read the server's variables, as a user's would
        monkeypatch.setenv(name, value)
    monkeypatch.chdir(tmp_path)
    return url


def test_the_listing_of_a_url_verifies_each_checkpoint_and_tags_the_newest(run_url, capsys):
    assert main(["checkpoints", run_url]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{run_url}:"
    assert [line.split()[0] for line in lines[2:]] == ["step-000000002", "step-000000004"]
    assert lines[2].endswith("  ok") and lines[3].endswith("  ok, newest")


def test_a_corrupted_object_is_named_and_the_listing_exits_1_naming_the_checkpoint_resume_would_take(
    run_url,
    s3,
    capsys,  # noqa: F811
):
    path = f"{run_url[len('s3://') :]}/step-000000004/model.pt"
    data = bytearray(s3.fs.cat_file(path))
    data[-20] ^= 0xFF  # one flipped byte, same size
    s3.fs.pipe_file(path, bytes(data))
    assert main(["checkpoints", run_url]) == 1
    out, err = capsys.readouterr()
    newest = [line for line in out.splitlines() if line.startswith("step-000000004")][0]
    assert f"CORRUPT: {run_url}/step-000000004/model.pt is damaged: its SHA-256 does not match the manifest" in newest
    assert err == (
        "ddpkit: the newest checkpoint step-000000004 is not usable (CORRUPT); resume=auto would continue "
        "from step-000000002\n"
    )


def test_digest_checks_one_checkpoint_of_a_url(run_url, s3, capsys):  # noqa: F811
    with s3.environment():
        [_, newest] = remote_checkpoints(run_url)
    digest = checkpoint_digest(newest.manifest)
    assert main(["checkpoints", newest.url, f"digest={digest}"]) == 0
    assert capsys.readouterr().out == f"{newest.url}: ok, every file verifies and matches the digest {digest}\n"

    assert main(["checkpoints", newest.url, f"digest={'0' * 64}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ddpkit: checkpoint {newest.url} does not match the digest {'0' * 64}") and "/tmp" not in err

    assert main(["checkpoints", run_url, f"digest={digest}"]) == 2  # the run, not one checkpoint
    assert capsys.readouterr().err == (
        f"error: {run_url} is not a checkpoint: digest=... checks one checkpoint; pass its URL (e.g. {newest.url})\n"
    )


def test_export_of_a_url_to_a_url_and_plot_of_a_url_are_one_line_each(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "runs/a", "s3://bucket/exported"]) == 2
    assert capsys.readouterr().err == (
        "error: OUT=s3://bucket/exported: the export is written to a local folder; export there, then copy it to "
        "the store\n"
    )
    assert main(["plot", "s3://bucket/team/run"]) == 2
    assert capsys.readouterr().err == (
        "error: s3://bucket/team/run: a run's metrics stay in its local folder; ddpkit plot runs/bucket/team/run\n"
    )
    assert list(tmp_path.iterdir()) == []
