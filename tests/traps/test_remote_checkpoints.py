"""Checkpoints in S3 under ``ddpkit run nproc=2``: a user's own loop (scripts/remote_loop.py) and a sharded one
(scripts/ckptsafe_sharded.py) given an s3:// URL, against moto's S3 server on loopback (tests/helpers/s3.py).

- rank 0 SIGKILLed while its checkpoint uploads, restarted (max_restarts=1): the checkpoint cut off is never
  taken as complete, and the run ends bit-equal to an uninterrupted one;
- a SIGTERM, then the same command again on another machine (an empty staging cache): bit-equal;
- a corrupted and a truncated object in the bucket: refused in one line, the checkpoint before it resumed,
  and the run ends bit-equal;
- a sharded run resumed from the bucket at another world size;
- two nodes that share no disk, each staging into its own folder: preempted, then resumed bit-equal;
- a run on a prefix another live run holds: refused in one line, nothing written;
- the credentials, given in the environment as botocore reads them, appear in nothing the runs wrote: the run
  folders, the staging caches, the output and every object in the bucket.
"""

from __future__ import annotations

import json
import re
import socket
import time
from pathlib import Path

import pytest
import torch

from ddpkit.checkpoint.remote.lease import LEASE_FILE
from ddpkit.names import EXIT_PREEMPTED, EXIT_USER_ERROR
from tests.helpers.launch_in_process import Commands
from tests.helpers.local_nodes import run_two_local_nodes
from tests.helpers.s3 import ACCESS_KEY, SECRET_KEY, s3

__all__ = ["s3"]

pytestmark = pytest.mark.slow  # ten launches and two two-node jobs: started first (tests/conftest.py)

SCRIPTS = Path(__file__).resolve().parent / "scripts"
LOOP, SHARDED = SCRIPTS / "remote_loop.py", SCRIPTS / "ckptsafe_sharded.py"


@pytest.fixture(scope="module")
def runs(s3, tmp_path_factory) -> dict:
    """Every launch of this module, in one Commands block, by name, with the bucket and root folder."""
    root = tmp_path_factory.mktemp("remote")
    bucket = s3.bucket()
    results: dict = {"root": root, "bucket": bucket}

    def run(name: str, *words: str, cache: str = "", env: dict | None = None):
        folder = root / name
        folder.mkdir(exist_ok=True)
        environ = {**s3.env, "DDPKIT_CACHE": str(root / "cache" / (cache or name)), **(env or {})}
        return commands.run("run", *words, cwd=folder, env=environ)

    with Commands() as commands:
        url = f"s3://{bucket}"
        results["reference"] = run("reference", "nproc=2", str(LOOP), f"{url}/reference", "final.pt")
        results["killed"] = run(
            "killed",
            "nproc=2",
            "max_restarts=1",
            "show_ranks=all",
            str(LOOP),
            f"{url}/killed",
            "final.pt",
            env={"KILL_MID_UPLOAD": "6"},
        )
        results["preempted"] = run(
            "preempted", "nproc=2", str(LOOP), f"{url}/preempted", "final.pt", env={"PREEMPT_AT": "7"}
        )
        results["preempted_again"] = run(
            "preempted", "nproc=2", str(LOOP), f"{url}/preempted", "final.pt", cache="another-machine"
        )
        results["sharded_reference"] = run("sharded_reference", "nproc=2", str(SHARDED), f"{url}/sh-ref", "f.pt", "8")
        results["sharded_2"] = run("sharded", "nproc=2", str(SHARDED), f"{url}/sharded", "f.pt", "4")
        results["sharded_1"] = run(
            "sharded", "nproc=1", str(SHARDED), f"{url}/sharded", "f.pt", "8", cache="one-rank-machine"
        )
        holder = {"host": "node7", "pid": 4121, "since": time.time(), "command": "ddpkit train", "token": "live"}
        s3.fs.pipe_file(f"{bucket}/held/{LEASE_FILE}", json.dumps({**holder, "renewed": time.time()}).encode())
        results["held"] = run("held", "nproc=2", str(LOOP), f"{url}/held", "final.pt")
        # The finished runs' last checkpoint (step 15) damaged in the bucket; the same command on an empty cache.
        for name, prefix, damage in (("corrupted", "reference", _flip_byte), ("truncated", "killed", _halve)):
            key = f"{bucket}/{prefix}/step-000000015/model.pt"
            s3.fs.pipe_file(key, damage(s3.fs.cat_file(key)))
            results[name] = run(name, "nproc=2", str(LOOP), f"{url}/{prefix}", "final.pt")
        results["objects"] = {path: s3.fs.cat_file(path) for path in s3.fs.find(bucket)}
    return results


def _flip_byte(data: bytes) -> bytes:
    return data[:-20] + bytes([data[-20] ^ 1]) + data[-19:]


def _halve(data: bytes) -> bytes:
    return data[: len(data) // 2]


def _log(out) -> str:
    return out.stdout + out.stderr


def _final(runs: dict, name: str, file: str = "final.pt") -> dict[str, torch.Tensor]:
    return torch.load(runs["root"] / name / file, weights_only=True)


def _assert_bit_equal(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> None:
    differing = [key for key in expected if not torch.equal(expected[key], got[key])]
    assert not differing, f"final weights differ from the uninterrupted run's in {differing}"


def test_rank_0_killed_mid_upload_and_restarted_ends_bit_equal_without_taking_the_cut_off_checkpoint(runs):
    reference, killed = runs["reference"], runs["killed"]
    assert reference.returncode == 0, _log(reference)
    assert killed.returncode == 0, _log(killed)
    assert "rank 0: SIGKILL while checkpoint 6 uploads" in killed.stdout
    # The restart found step 6 staged but without its manifest in the bucket: set aside, step 4 resumed.
    assert "step-000000006 aside as step-000000006.not-uploaded: s3://" in _log(killed)
    assert "rank 0: start epoch=0 step_in_epoch=4" in killed.stdout
    _assert_bit_equal(_final(runs, "reference"), _final(runs, "killed"))


def test_a_sigterm_then_the_same_command_on_another_machine_ends_bit_equal(runs):
    first, again = runs["preempted"], runs["preempted_again"]
    assert first.returncode == EXIT_PREEMPTED, _log(first)
    said = re.search(r"preempted by SIGTERM after global step (\d+): checkpoint (\S+) is complete", _log(first))
    step = int(said.group(1))
    assert said.group(2) == f"s3://{runs['bucket']}/preempted/step-{step:09d}"
    assert f"checkpoint step-{step:09d} uploaded to s3://" in _log(first)
    assert f"resumed from s3://{runs['bucket']}/preempted/step-{step:09d} (global step {step}: " in _log(again)
    assert list((runs["root"] / "cache" / "another-machine" / "checkpoints").glob("preempted-*/step-*"))
    assert again.returncode == 0, _log(again)
    _assert_bit_equal(_final(runs, "reference"), _final(runs, "preempted"))


@pytest.mark.parametrize("name, prefix", [("corrupted", "reference"), ("truncated", "killed")])
def test_a_damaged_object_is_refused_in_one_line_and_the_previous_checkpoint_ends_the_run_bit_equal(runs, name, prefix):
    out = runs[name]
    assert out.returncode == 0, _log(out)
    url = f"s3://{runs['bucket']}/{prefix}/step-000000015"
    what = "is damaged: its SHA-256 does not match" if name == "corrupted" else "is truncated or damaged: "
    assert f"resume=auto: skipping checkpoint {url}: {url}/model.pt {what}" in _log(out)
    assert "rank 0: start epoch=2 step_in_epoch=4" in out.stdout  # step 14, the one before
    _assert_bit_equal(_final(runs, "reference"), _final(runs, name))


def test_a_sharded_run_resumes_from_the_bucket_at_another_world_size(runs):
    for name in ("sharded_reference", "sharded_2", "sharded_1"):
        assert runs[name].returncode == 0, _log(runs[name])
    assert "resumed from " in _log(runs["sharded_1"]) and "step-000000004" in _log(runs["sharded_1"])
    expected, got = _final(runs, "sharded_reference", "f.pt"), _final(runs, "sharded", "f.pt")
    # One rank sums the batch the two ranks split: the same training up to float rounding, not bit for bit.
    assert all(torch.allclose(e, g, atol=1e-5) for e, g in zip(expected, got))


def test_a_run_on_a_prefix_another_live_run_holds_is_refused_in_one_line_and_writes_nothing(runs):
    held = runs["held"]
    url = f"s3://{runs['bucket']}/held"
    assert held.returncode == EXIT_USER_ERROR, _log(held)
    line = next(line for line in held.stderr.splitlines() if "is in use by another run" in line)
    assert f"{url} is in use by another run (host node7, pid 4121, since " in line
    assert f"if that run is gone, delete {url}/{LEASE_FILE}, or wait 120 s for its lease to lapse" in line
    assert [path for path in runs["objects"] if "/held/" in path] == [f"{runs['bucket']}/held/{LEASE_FILE}"]


def test_the_credentials_are_in_nothing_the_runs_wrote(runs):
    secrets = (ACCESS_KEY.encode(), SECRET_KEY.encode())
    written = {str(path): path.read_bytes() for path in runs["root"].rglob("*") if path.is_file()}
    assert any("/cache/" in path for path in written) and any(path.endswith("manifest.json") for path in written)
    written.update(runs["objects"])
    for name, out in runs.items():
        if hasattr(out, "stdout"):
            written[f"output of {name}"] = _log(out).encode()
    found = [where for where, data in written.items() if any(secret in data for secret in secrets)]
    assert not found, f"the credentials were written to {found}"
    assert socket.gethostname()  # the lease names the host, never the key


def test_two_nodes_that_share_no_disk_resume_from_the_bucket_bit_equal(runs, s3, tmp_path):
    url = f"s3://{s3.bucket()}/nodes"
    env = {**s3.env, "NODE_CACHE": str(tmp_path / "first" / "node-{node}")}
    first = run_two_local_nodes(LOOP, url, "final.pt", cwd=tmp_path, env={**env, "PREEMPT_AT": "7"})
    assert [done.returncode for done in first] == [EXIT_PREEMPTED] * 2, first[0].stderr + first[1].stderr
    env["NODE_CACHE"] = str(tmp_path / "again" / "node-{node}")
    again = run_two_local_nodes(LOOP, url, "final.pt", cwd=tmp_path, env=env)
    assert [done.returncode for done in again] == [0, 0], again[0].stderr + again[1].stderr
    # Node 1 staged the checkpoint node 0 chose into its own folder.
    assert list((tmp_path / "again" / "node-1").glob("step-*/manifest.json"))
    expected = _final(runs, "reference")
    _assert_bit_equal(expected, torch.load(tmp_path / "final.pt", weights_only=True))
