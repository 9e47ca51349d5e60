"""The lines a URL run prints about its checkpoints name them by URL, never by their local staged copy.

A user's own loop (scripts/remote_loop.py) given an s3:// URL under ``ddpkit run nproc=2``, against moto's S3
server on loopback (tests/helpers/s3.py): a first run that finds no checkpoint and is preempted, the same
command again, and a fresh start (``resume("never")``) into the prefix that now holds checkpoints. Each line
about a checkpoint names ``s3://bucket/run/...``: the staging folder, which is this machine's cache and where
no other machine finds anything, appears in none of the output.
"""

from __future__ import annotations

import re
from pathlib import Path

from ddpkit.names import EXIT_PREEMPTED
from tests.helpers.launch_in_process import Commands
from tests.helpers.s3 import s3

__all__ = ["s3"]

LOOP = Path(__file__).resolve().parent / "scripts" / "remote_loop.py"


def test_a_url_run_names_its_checkpoints_by_url_in_every_line(s3, tmp_path):
    url = f"s3://{s3.bucket()}/run"
    cache = tmp_path / "cache"
    env = {**s3.env, "DDPKIT_CACHE": str(cache)}
    with Commands() as commands:
        first = commands.run("run", "nproc=2", str(LOOP), url, "final.pt", cwd=tmp_path, env={**env, "PREEMPT_AT": "7"})
        again = commands.run("run", "nproc=2", str(LOOP), url, "final.pt", cwd=tmp_path, env=env)
        fresh = commands.run("run", "nproc=2", str(LOOP), url, "final.pt", cwd=tmp_path, env={**env, "RESUME": "never"})
    outputs = {name: out.stdout + out.stderr for name, out in (("first", first), ("again", again), ("fresh", fresh))}
    assert (first.returncode, again.returncode) == (EXIT_PREEMPTED, 0), outputs
    assert fresh.returncode != 0, outputs["fresh"]
    assert f"resume=auto: no checkpoint in {url} yet; starting from the beginning" in outputs["first"]
    written = re.findall(r"\] checkpoint (\S+) \(every_steps\), digest [0-9a-f]{64}", outputs["first"])
    assert written[:2] == [f"{url}/step-000000002", f"{url}/step-000000004"], outputs["first"]
    said = re.search(r"preempted by SIGTERM after global step (\d+): checkpoint (\S+) is complete", outputs["first"])
    assert said and said.group(2) == f"{url}/step-{int(said.group(1)):09d}", outputs["first"]
    assert f"resumed from {said.group(2)} (global step {said.group(1)}: " in outputs["again"]
    assert (
        f"{url} already holds checkpoints (newest: step-000000015); continue that run with resume=auto"
        in (outputs["fresh"])
    )
    assert list(cache.rglob("step-*/manifest.json")), "the checkpoints were staged in the cache"
    staged = [name for name, text in outputs.items() if str(cache) in text]
    assert not staged, f"the output of {staged} names the local staging folder"
