"""Real containers for tests: Podman under a storage root of the test's own, and ddpkit's image built offline.

Podman (Debian's ``podman``, ``runc``, ``netavark``, ``aardvark-dns``) runs
Docker-compatible containers without a daemon, each with its own network
namespace, /dev/shm and file system. Everything a test creates lives under
one temporary folder (``--root``, ``--runroot``, and the config file
``CONTAINERS_CONF`` names: network definitions, events, temporary files) and
goes with :func:`podman_root`; the machine's own storage and configuration
are untouched. Two settings this host needs are in that config file:

- ``runtime = "runc"``: crun refuses this host's mix of cgroup v1 and v2;
- ``default_ulimits = []``: Podman's default raises RLIMIT_NOFILE above the
  hard limit here ("setrlimit RLIMIT_NOFILE: Operation not permitted").

No registry can be reached, so the base image is made from Debian's packages
(:func:`import_debian_base`: mmdebstrap, from the mirrors the host's apt
uses), and the ddpkit image from the repository's Containerfile with every
wheel taken from a folder in its build context (:func:`build_image`), torch
from the wheel pip already has here. Needs root.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib.metadata
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests.cli_runner import REPO

TOOLS = ("podman", "runc", "mmdebstrap")
"""Commands these tests need (scripts/cluster-setup.sh installs them)."""

BASE_PACKAGES = ("python3", "python3-venv", "gcc", "libc6-dev")
"""What the base image holds: Python with venv (as python:3.11-slim has), and a C compiler for ddpkit's library."""

NETWORK_LOCK = Path("/run/lock/ddpkit-test-container-network.lock")
"""Held from creating a network until its bridge exists: Podman picks a bridge name and subnet that the host
does not use yet, so two test runs creating networks at once could pick the same."""

_CONFIG = """\
[containers]
default_ulimits = []
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{root}/events.log"
tmp_dir = "{root}/tmp"

[network]
network_backend = "netavark"
network_config_dir = "{root}/networks"
"""


@dataclass(frozen=True)
class Podman:
    """The podman command bound to one storage root and config file."""

    root: Path
    """The folder that holds everything: storage, run state, networks, the config."""

    def command(self, *args: str) -> list[str]:
        """``podman`` with this root's storage, then ``args``."""
        return [
            "podman",
            "--root",
            str(self.root / "storage"),
            "--runroot",
            str(self.root / "run"),
            "--storage-driver",
            "overlay",
            *args,
        ]

    @property
    def environ(self) -> dict[str, str]:
        """The environment of a podman command: this root's config file instead of the machine's."""
        return {**os.environ, "CONTAINERS_CONF": str(self.root / "containers.conf")}

    def run(self, *args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess:
        """Run ``podman ARGS``; raise with its output when it fails and ``check``."""
        result = subprocess.run(self.command(*args), env=self.environ, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"podman {' '.join(args[:3])} failed ({result.returncode}): {result.stderr[-3000:]}")
        return result


def missing_tools() -> list[str]:
    """The commands of :data:`TOOLS` not on the PATH."""
    return [tool for tool in TOOLS if shutil.which(tool) is None]


@contextlib.contextmanager
def podman_root() -> Iterator[Podman]:
    """A Podman with a fresh storage root under /var/tmp; on exit every container, image and network is gone."""
    root = Path(tempfile.mkdtemp(prefix="ddpkit-podman-", dir="/var/tmp"))
    (root / "containers.conf").write_text(_CONFIG.format(root=root))
    for folder in ("tmp", "networks"):
        (root / folder).mkdir()
    podman = Podman(root)
    try:
        yield podman
    finally:
        podman.run("rm", "--all", "--force", "--time", "0", check=False, timeout=120)
        podman.run("system", "reset", "--force", check=False, timeout=300)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def network_lock() -> Iterator[None]:
    """Hold :data:`NETWORK_LOCK` for the block (create a network and start its first container in it)."""
    NETWORK_LOCK.parent.mkdir(parents=True, exist_ok=True)
    with open(NETWORK_LOCK, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def import_debian_base(podman: Podman, tag: str) -> None:
    """Make image ``tag`` from Debian's packages: this host's release, minbase plus :data:`BASE_PACKAGES`.

    The mirrors are the host's apt sources, handed to mmdebstrap on its standard input.
    """
    suite = _os_release()["VERSION_CODENAME"]
    excludes = [f"--dpkgopt=path-exclude=/usr/share/{folder}/*" for folder in ("doc", "man", "locale")]
    mmdebstrap = [
        "mmdebstrap",
        "--quiet",
        "--variant=minbase",
        f"--include={','.join(BASE_PACKAGES)}",
        *excludes,
        "--skip=output/dev",
        suite,
        "-",
        "-",
    ]
    pipeline = f"{shlex.join(mmdebstrap)} | {shlex.join(podman.command('import', '-', tag))}"
    result = subprocess.run(
        ["bash", "-o", "pipefail", "-c", pipeline],
        input=apt_sources(),
        env=podman.environ,
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"building the Debian base image failed: {result.stderr[-3000:]}")


def apt_sources() -> str:
    """The host's apt sources: its deb822 ``.sources`` files, else its one-line ``sources.list`` entries."""
    folder = Path("/etc/apt")
    deb822 = sorted((folder / "sources.list.d").glob("*.sources"))
    if deb822:
        return "\n\n".join(path.read_text().strip() for path in deb822) + "\n"
    lists = [folder / "sources.list", *sorted((folder / "sources.list.d").glob("*.list"))]
    return "".join(path.read_text() for path in lists if path.exists())


def build_image(podman: Podman, base: str, tag: str, context: Path) -> subprocess.CompletedProcess:
    """Build the repository's Containerfile as ``tag`` on ``base``, offline: its wheels copied into ``context``."""
    _copy_sources(context)
    _download_wheels(context / "wheels")
    return podman.run(
        "build",
        "--network",
        "none",
        "--file",
        str(context / "Containerfile"),
        "--build-arg",
        f"BASE_IMAGE={base}",
        "--build-arg",
        "WHEELS=wheels",
        "--tag",
        tag,
        str(context),
        timeout=900,
    )


def _copy_sources(context: Path) -> None:
    """The repository's files as ``git`` sees them (tracked, and new ones not ignored) into ``context``."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (context / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, context / name)


def _download_wheels(folder: Path) -> None:
    """The wheels of ddpkit's dependencies at the versions installed here, torch included, and of its build.

    pip takes them from where it finds them on this machine (torch from its local wheel); the container's
    Python must be the same minor version as this one, which the Debian release of the base image gives.
    """
    names = [
        re.split(r"[ ;<>=!~\[]", requirement)[0]
        for requirement in importlib.metadata.requires("ddpkit")
        if "extra ==" not in requirement
    ]
    pinned = [f"{name}=={importlib.metadata.version(name)}" for name in (*names, "setuptools")]
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--only-binary=:all:",
            "--dest",
            str(folder),
            *pinned,
            "wheel",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if result.returncode != 0:
        raise RuntimeError(f"pip download of the image's wheels failed: {result.stderr[-3000:]}")


def _os_release() -> dict[str, str]:
    lines = Path("/etc/os-release").read_text().splitlines()
    return {key: value.strip('"') for key, _, value in (line.partition("=") for line in lines if "=" in line)}
