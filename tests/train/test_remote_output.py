"""``ddpkit train output_dir=s3://...``: the checkpoints in the bucket, the run's own files in a local folder.

Against moto's S3 server on loopback (tests/helpers/s3.py). The job is checkpoint_helpers' 2-worker job of
32 steps; stopped by SIGTERM at step 6 and continued with the command its last line prints, it must end
with the weights of the uninterrupted (local) run, bit for bit.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
import torch

from ddpkit.checkpoint import remote_checkpoints
from ddpkit.checkpoint.manager.preemption import EXIT_PREEMPTED
from ddpkit.commands.dispatch import main
from ddpkit.keyvalue import parse
from ddpkit.train.config import TrainConfig, parse_train_config, with_remote_checkpoints
from tests.cli_runner import PYTHONPATH, run_ddpkit
from tests.helpers.s3 import ACCESS_KEY, SECRET_KEY, s3  # noqa: F401  # s3: the session's server (a fixture)
from tests.train.checkpoint_helpers import CLI_TOTAL_STEPS, CLI_WORDS, assert_same_weights, reference_weights

TINY = ["dataset=synthetic", "synthetic_samples=256", "batch_size=32", "epochs=1", "progress=false"]


def test_an_output_dir_url_keeps_the_checkpoints_there_and_the_run_s_files_in_a_local_folder():
    cfg = parse_train_config(["output_dir=s3://ckpt/team/run1/"])
    assert (cfg.output_dir, cfg.checkpoint.dir) == ("runs/ckpt/team/run1", "s3://ckpt/team/run1/checkpoints")
    cfg = parse_train_config(["output_dir=s3://b/x", "checkpoint.dir=s3://other/ckpt"])  # named: kept
    assert (cfg.output_dir, cfg.checkpoint.dir) == ("runs/b/x", "s3://other/ckpt")
    cfg = parse(TrainConfig, ["output_dir=runs/a", "checkpoint.dir=s3://ckpt/a"])
    assert with_remote_checkpoints(cfg) == cfg  # a local output_dir stays as it is


def test_urls_whose_parts_join_alike_keep_their_run_files_in_two_local_folders():
    folders = [parse_train_config([f"output_dir={url}"]).output_dir for url in ("s3://a-b/c", "s3://a/b-c")]
    assert folders == ["runs/a-b/c", "runs/a/b-c"]


def test_missing_s3fs_is_one_line_naming_the_extra(tmp_path):
    # As where s3fs is not installed: a None in sys.modules makes its import fail.
    code = "import sys; sys.modules['s3fs'] = None; from ddpkit.commands.dispatch import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", code, "train", "nproc=2", *TINY, "output_dir=s3://bucket/run"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": PYTHONPATH},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert (
        result.stderr
        == "error: output_dir=s3://bucket/run needs s3fs, which is not installed: pip install 'ddpkit[s3]'\n"
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "words, message",
    [
        (
            ["output_dir=s3://"],
            "error: output_dir=s3:// names no bucket; use s3://BUCKET/PREFIX, e.g. s3://my-bucket/run",
        ),
        (["checkpoint.dir=s3:///run"], "error: checkpoint.dir=s3:///run names no bucket; use s3://BUCKET/PREFIX"),
        (
            ["output_dir=foo://bucket/run"],
            "error: output_dir=foo://bucket/run: foo:// is not a storage ddpkit keeps checkpoints in; use "
            "s3://BUCKET/PREFIX (or gs://, az://... with their fsspec library installed), or a local folder",
        ),
        (["output_dir=gs://bucket/run"], "error: output_dir=gs://bucket/run needs gcsfs, which is not installed: "),
        (["init_from=zip://x"], "error: init_from=zip://x: zip:// is not a storage ddpkit keeps checkpoints in"),
        (["output_dir=file:///tmp/run"], "error: output_dir=file:///tmp/run: give a local folder as its path"),
        (["data_dir=s3://bucket/fashion"], "error: data_dir=s3://bucket/fashion: the dataset is read from a local"),
        (["checkpoint.cache=s3://b/c"], "error: checkpoint.cache=s3://b/c: checkpoints are staged in a local folder"),
    ],
)
def test_a_url_where_it_cannot_work_is_one_line_and_nothing_is_created(tmp_path, monkeypatch, capsys, words, message):
    monkeypatch.chdir(tmp_path)
    assert main(["train", "nproc=2", *TINY, *words]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(message) and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []  # no runs/, and no folder named s3: or foo:


def _environ(s3, tmp_path) -> dict[str, str]:
    """The server's variables, and a staging cache inside the test's folder."""
    return {**s3.env, "DDPKIT_CACHE": str(tmp_path / "cache")}


def _newest(s3, url: str):  # noqa: F811  # s3: the server; the newest complete RemoteCheckpoint
    with s3.environment():
        return [info for info in remote_checkpoints(url) if info.manifest is not None][-1]


@pytest.fixture(scope="module")
def stopped_and_continued(s3, tmp_path_factory):  # noqa: F811  # s3: the fixture imported above
    """The CLI job on output_dir=s3://<bucket>/run: SIGTERM to its launcher at step 6, then the command its
    last line names. Returns (folder, url, the stopped run, the continued run)."""
    folder = tmp_path_factory.mktemp("remote-run")
    url = f"s3://{s3.bucket()}/run"
    env = {
        **_environ(s3, folder),
        "DDPKIT_TEST_SIGNAL_STEP": "6",
        "DDPKIT_TEST_SIGNAL": "SIGTERM",
        "DDPKIT_TEST_SIGNAL_TARGET": "parent",
        "DDPKIT_TEST_STEP_SLEEP": "0.05",
    }
    stopped = run_ddpkit("train", *CLI_WORDS, f"output_dir={url}", cwd=folder, env=env, timeout=240)
    continued = None
    line = re.search(r"continue with: (ddpkit train .*)$", stopped.stderr, re.MULTILINE)
    if line is not None:
        words = shlex.split(line.group(1))[2:]  # the words after "ddpkit train"
        continued = run_ddpkit("train", *words, cwd=folder, env=_environ(s3, folder), timeout=240)
    return folder, url, stopped, continued


@pytest.mark.slow
def test_sigterm_then_the_printed_command_continues_from_the_bucket_to_the_uninterrupted_weights(
    stopped_and_continued,
    s3,  # noqa: F811
):
    folder, url, stopped, continued = stopped_and_continued
    assert stopped.returncode == EXIT_PREEMPTED, stopped.stderr[-3000:]
    assert f"checkpoints in {url}/checkpoints; the run's own files in the local folder runs/" in stopped.stderr
    assert "is complete; continue with: ddpkit train " in stopped.stderr
    assert f"output_dir={url} resume=auto" in stopped.stderr  # the URL as given, not the local folder
    assert continued is not None and continued.returncode == 0, (continued or stopped).stderr[-3000:]
    assert f"uploaded to {url}/checkpoints/" in continued.stderr
    # The run's own files are local, under the folder the URL names; nothing under a folder called s3:
    local = folder / "runs" / url[len("s3://") :]
    assert (local / "metrics.jsonl").is_file() and (local / "summary.json").is_file()
    assert not (local / "checkpoints").exists() and not (folder / "s3:").exists()
    newest = _newest(s3, f"{url}/checkpoints")
    assert newest.global_step == CLI_TOTAL_STEPS
    with s3.environment():
        from ddpkit.checkpoint import local_checkpoint, verify_checkpoint

        with local_checkpoint(newest.url) as (copy, _):
            weights = verify_checkpoint(copy)["model.pt"]
    assert_same_weights(weights, reference_weights(), "stopped by SIGTERM at step 6, continued from the bucket")


@pytest.mark.slow
def test_checkpoints_and_export_read_the_run_s_url(stopped_and_continued, s3, tmp_path):  # noqa: F811
    folder, url, _, continued = stopped_and_continued
    assert continued is not None and continued.returncode == 0
    env = _environ(s3, tmp_path)
    listing = run_ddpkit("checkpoints", url, cwd=tmp_path, env=env, timeout=120)
    assert listing.returncode == 0, listing.stderr
    lines = listing.stdout.splitlines()
    assert lines[0] == f"{url}/checkpoints:"
    newest = _newest(s3, f"{url}/checkpoints").name
    assert any(line.startswith(newest) and line.endswith("ok, newest") for line in lines), listing.stdout

    exported = run_ddpkit("export", url, "out", cwd=tmp_path, env=env, timeout=120)
    assert exported.returncode == 0, exported.stderr
    assert exported.stdout == f"exported {url}/checkpoints/{newest} to out (model.pt, model.json)\n"
    info = json.loads((tmp_path / "out" / "model.json").read_text())
    assert info["source"]["checkpoint"] == f"{url}/checkpoints/{newest}"
    assert info["source"]["global_step"] == CLI_TOTAL_STEPS
    weights = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    assert_same_weights(weights, reference_weights(), "exported from the bucket")


@pytest.mark.slow
def test_checkpoints_of_the_run_s_local_folder_says_where_its_checkpoints_are(stopped_and_continued, s3):  # noqa: F811
    folder, url, _, continued = stopped_and_continued
    assert continued is not None and continued.returncode == 0
    local = f"runs/{url[len('s3://') :]}"
    listing = run_ddpkit("checkpoints", local, cwd=folder, env=_environ(s3, folder), timeout=120)
    assert listing.returncode == 0, listing.stderr
    assert listing.stdout == (
        f"no checkpoints in {local}: this run keeps them in {url}/checkpoints; list them with ddpkit checkpoints "
        f"{url}/checkpoints\n"
    )


@pytest.mark.slow
def test_the_credentials_are_in_no_file_the_run_wrote(stopped_and_continued):
    folder, _, _, continued = stopped_and_continued
    assert continued is not None and continued.returncode == 0
    for path in folder.rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert ACCESS_KEY.encode() not in data and SECRET_KEY.encode() not in data, path


@pytest.mark.slow
def test_init_from_a_run_s_url_starts_from_its_newest_verified_checkpoint(stopped_and_continued, s3, tmp_path):  # noqa: F811
    _, url, _, continued = stopped_and_continued
    assert continued is not None and continued.returncode == 0
    words = [w for w in CLI_WORDS if not w.startswith(("nproc=", "epochs=", "checkpoint."))]
    out = run_ddpkit(
        "train", *words, "nproc=1", "epochs=1", "checkpoint.enabled=false", f"init_from={url}", "output_dir=new",
        cwd=tmp_path, env=_environ(s3, tmp_path), timeout=180,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    newest = _newest(s3, f"{url}/checkpoints").name
    assert f"init_from {url}/checkpoints/{newest}: loaded 4 tensor(s)" in out.stderr, out.stderr[-3000:]


@pytest.mark.slow
def test_resume_from_one_checkpoint_s_url_continues_it_into_another_prefix(stopped_and_continued, s3, tmp_path):  # noqa: F811
    _, url, _, continued = stopped_and_continued
    assert continued is not None and continued.returncode == 0
    newest = _newest(s3, f"{url}/checkpoints")
    env = _environ(s3, tmp_path)
    words = [w for w in CLI_WORDS if not w.startswith("epochs=")]
    missing = run_ddpkit("train", *words, "epochs=3", f"output_dir={url}-more", f"resume={url}/checkpoints/step-000000099",
                         cwd=tmp_path, env=env, timeout=120)  # fmt: skip
    assert missing.returncode == 2 and missing.stderr == (
        f"error: resume={url}/checkpoints/step-000000099 is not a complete checkpoint: it has no manifest.json in the "
        "store; pass a checkpoint's URL (e.g. .../checkpoints/step-000000120), or resume=auto\n"
    )
    out = run_ddpkit("train", *words, "epochs=3", f"output_dir={url}-more", f"resume={newest.url}",
                     cwd=tmp_path, env=env, timeout=180)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    # (the line names the checkpoint's staged copy, verified against the manifest it was downloaded with)
    assert f"/{newest.name} (global step {CLI_TOTAL_STEPS}: 2 epoch(s) complete)" in out.stderr, out.stderr[-3000:]
    assert _newest(s3, f"{url}-more/checkpoints").global_step == CLI_TOTAL_STEPS * 3 // 2
