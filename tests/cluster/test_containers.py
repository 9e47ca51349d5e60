"""ddpkit's image in real containers: built from the Containerfile, trained in one container and in two.

    container ddpkit-master-<id>  <--- user-defined bridge network --->  container ddpkit-trainer-<id>
    ddpkit train nnodes=2 node_rank=0                                    ddpkit train nnodes=2 node_rank=1
        master_addr=ddpkit-master-<id>                                       master_addr=ddpkit-master-<id>

The image is built once for the module (tests/helpers/podman.py: a Debian
base made from Debian's packages, the Containerfile on top with the wheels
of this machine, nothing downloaded from a registry). Each container has
its own network namespace, /dev/shm and file system; the run folder is a
host folder mounted into both, as a shared volume would be. The network is
internal: the containers reach each other and nothing else.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddpkit.env.shared_memory import FIX
from tests.helpers.podman import Podman, build_image, import_debian_base, missing_tools, network_lock, podman_root

# The first test also waits for the image (about 2 minutes alone on 2 cores, more beside other tests).
pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.timeout(900)]

IMAGE_UID = 1000
"""The image's user (Containerfile), who must be able to write the mounted run folder."""
TINY = ("dataset=synthetic", "synthetic_samples=1024", "epochs=2", "progress=false", "threads=1")
"""A short run: 2 epochs of 16 global batches of W1's model on synthetic data, one torch thread per worker."""
PORT = "29500"
"""The master's port: in a network namespace this test created, nothing else listens."""


@dataclass(frozen=True)
class Image:
    """The ddpkit image, built, and the Podman that holds it."""

    podman: Podman
    tag: str


@pytest.fixture(scope="module")
def image() -> Iterator[Image]:
    """ddpkit's image, built from a Debian base made here; removed, with everything else, after the module."""
    missing = missing_tools()
    if missing or os.geteuid() != 0:
        reason = f"needs root and {', '.join(missing) or 'podman'}: run `bash scripts/setup.sh --test` as root"
        if os.environ.get("CI"):
            pytest.fail(reason)  # CI installs them: there a missing tool is a failure, not a skip
        pytest.skip(reason)
    with podman_root() as podman:
        started = time.monotonic()
        import_debian_base(podman, "localhost/ddpkit-test-base:latest")
        based = time.monotonic()
        build_image(podman, "localhost/ddpkit-test-base:latest", "localhost/ddpkit:test", podman.root / "context")
        print(f"\ncontainer image: Debian base {based - started:.0f} s, ddpkit image {time.monotonic() - based:.0f} s")
        yield Image(podman, "localhost/ddpkit:test")


def runs_folder(tmp_path: Path) -> Path:
    """A host folder for the containers' runs/, writable by the image's user."""
    folder = tmp_path / "runs"
    folder.mkdir()
    os.chown(folder, IMAGE_UID, IMAGE_UID)
    return folder


def only_run(runs: Path) -> Path:
    """The one run folder under ``runs`` (W1's model on synthetic data)."""
    found = sorted((runs / "mlp-synthetic").iterdir())
    assert len(found) == 1, found
    return found[0]


def assert_finished(run: Path, world_size: int, steps: int) -> None:
    """The run's summary says it trained to the end with ``world_size`` workers; its last checkpoint is complete."""
    summary = json.loads((run / "summary.json").read_text())
    assert (summary["world_size"], summary["global_steps"]) == (world_size, steps), summary
    last = sorted((run / "checkpoints").glob("step-*"))[-1]
    assert last.name == f"step-{steps:09d}" and (last / "manifest.json").is_file(), list(last.iterdir())


def test_the_image_runs_ddpkit_as_its_non_root_user(image: Image):
    version = image.podman.run("run", "--rm", "--network", "none", image.tag, "--version")
    user = image.podman.run("run", "--rm", "--network", "none", "--entrypoint", "id", image.tag, "-u")
    assert (version.stdout, user.stdout) == ("ddpkit 0.1.0\n", f"{IMAGE_UID}\n")


def test_one_container_trains_with_two_workers(image: Image, tmp_path):
    # With the runtime's default /dev/shm, 64 MB: the shared-memory all_reduce of 2 workers takes 4 MiB of it.
    runs = runs_folder(tmp_path)
    out = image.podman.run(
        "run", "--rm", "--network", "none", "--volume", f"{runs}:/work/runs", image.tag, "train", "nproc=2", *TINY
    )

    assert "[rank 0/2] gradients: flat of 155 KiB with all_reduce=shm over gloo" in out.stderr, out.stderr
    assert "[rank 0/2] done: mlp on synthetic, 2 worker(s)" in out.stderr
    assert_finished(only_run(runs), world_size=2, steps=32)


def test_a_container_with_a_small_shm_falls_back_to_gloo_and_says_the_fix(image: Image, tmp_path):
    runs = runs_folder(tmp_path)
    out = image.podman.run(
        "run",
        "--rm",
        "--network",
        "none",
        "--shm-size",
        "1m",
        "--volume",
        f"{runs}:/work/runs",
        image.tag,
        "train",
        "nproc=2",
        *TINY,
    )

    warnings = [line for line in out.stderr.splitlines() if "allreduce=auto:" in line]
    assert warnings == [
        "[rank 0/2] allreduce=auto: using gloo's all_reduce (builtin), not shm: the shared-memory all_reduce of 2 "
        f"workers needs about 4.0 MiB of shared memory but /dev/shm has 1.0 MiB free of 1.0 MiB; {FIX}"
    ], out.stderr
    assert_finished(only_run(runs), world_size=2, steps=32)


def test_two_containers_train_as_two_nodes_on_a_bridge_network(image: Image, tmp_path):
    podman, suffix = image.podman, secrets.token_hex(4)
    network, master, trainer = f"ddpkit-test-{suffix}", f"ddpkit-master-{suffix}", f"ddpkit-trainer-{suffix}"
    runs = runs_folder(tmp_path)
    common = ("--network", network, "--volume", f"{runs}:/work/runs", "--detach")
    words = ("train", "nproc=2", "nnodes=2", f"master_addr={master}", f"master_port={PORT}", *TINY)
    try:
        with network_lock():  # until the bridge exists (see NETWORK_LOCK)
            podman.run("network", "create", "--internal", network)
            podman.run("run", "--name", master, *common, image.tag, *words, "node_rank=0")
        podman.run("run", "--name", trainer, *common, image.tag, *words, "node_rank=1")
        codes = [podman.run("wait", name, timeout=300).stdout.strip() for name in (master, trainer)]
        logs = [podman.run("logs", name).stderr for name in (master, trainer)]
    finally:
        podman.run("rm", "--force", "--time", "0", master, trainer, check=False)
        podman.run("network", "rm", "--force", network, check=False)

    assert codes == ["0", "0"], logs[0][-3000:] + logs[1][-3000:]
    assert f"[rank 0/4] ddpkit launcher: world_size 4 on 2 node(s), master {master}:{PORT}" in logs[0], logs[0]
    # Shared memory inside each container, gloo between them.
    assert "[rank 0/4] gradients: flat of 155 KiB with all_reduce=hierarchical over gloo" in logs[0], logs[0]
    assert "[rank 0/4] done: mlp on synthetic, 4 worker(s)" in logs[0]
    assert "[rank" not in logs[1] and "error" not in logs[1].lower(), logs[1]  # rank 0 speaks; nothing went wrong
    assert_finished(only_run(runs), world_size=4, steps=32)
