"""Where a run writes: a folder of its own, so that runs never collide.

Without ``output_dir``, every fresh run gets a new folder
``runs/<model>-<dataset>/<date-time>`` (in a Slurm job ``slurm-<job id>``,
the same for every rank and for a requeued job), and ``runs/latest`` points
to it. ``resume=auto`` without ``output_dir`` continues the newest run of the
same model and dataset (and starts a new one when there is none); so does a
restarted job (torchrun's ``max_restarts``, a Slurm requeue).

A fresh run (one that resumes no checkpoint) never writes into another
run's files nor into a folder of other things: :func:`check_fresh_run_folder`
refuses, in one line, an ``output_dir`` that is not empty (a new run goes to
a new or empty folder; ``resume=auto`` without ``output_dir`` continues the
newest run only when it holds a checkpoint, else starts a new folder).

The folder is planned (:func:`plan_run_folder`, no side effects, so that
bad input leaves nothing behind) and then claimed (:func:`claim_run_folder`:
created, ``runs/latest`` pointed to it). Every rank must write into the same
folder: the launcher plans it once before starting local workers; workers of
another launcher take the folder rank 0 chose (see ``ddpkit.train.run``).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from ddpkit import FolderLock
from ddpkit.checkpoint import restart_count, stored_checkpoints
from ddpkit.errors import UserError
from ddpkit.train.config import RUNS_DIR, TrainConfig

LATEST = RUNS_DIR / "latest"
"""Symbolic link to the newest run's folder."""
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def plan_run_folder(cfg: TrainConfig, environ: Mapping[str, str], now: float | None = None) -> Path:
    """The folder of the run ``cfg`` describes (``cfg.output_dir`` when given); nothing is created."""
    if cfg.output_dir:
        return Path(cfg.output_dir)
    series = RUNS_DIR / f"{_safe(cfg.model)}-{_safe(cfg.dataset)}"
    job = environ.get("SLURM_JOB_ID", "")
    if job:  # every rank, and the requeued job, agree on it without talking
        return series / f"slurm-{_safe(job)}"
    if cfg.resume == "auto" or restart_count(environ):
        newest = newest_run(series)
        # continued only where there is a checkpoint to continue from: else its files are another run's
        if newest is not None and (
            restart_count(environ) or stored_checkpoints(cfg.checkpoint.dir or newest / "checkpoints")
        ):
            return newest
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(now))
    folder, n = series / stamp, 1
    while folder.exists():  # two runs started within the same second
        n += 1
        folder = series / f"{stamp}-{n}"
    return folder


def newest_run(series: Path) -> Path | None:
    """The newest run folder of ``runs/<model>-<dataset>`` (by name: the names are times), if any."""
    if not series.is_dir():
        return None
    runs = sorted((p for p in series.iterdir() if p.is_dir() and not p.is_symlink()), key=lambda p: _order(p.name))
    return runs[-1] if runs else None


def claim_run_folder(folder: Path) -> Path:
    """Create ``folder`` and, for a folder under runs/, point ``runs/latest`` to it; returns ``folder``.

    Raises:
        UserError: ``folder`` names an existing file, or cannot be created (permissions, read-only).
    """
    check_run_folder(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(
            f"cannot create output_dir {folder} ({e.strerror or e}); choose a folder this user can write "
            "(output_dir=...)"
        ) from None
    _check_writable(folder)
    if folder.resolve().is_relative_to(RUNS_DIR.resolve()) and folder.resolve() != LATEST.resolve():
        _point_latest(folder)
    return folder


RESTART_LOCK_WAIT_SECONDS = 60.0
"""How long a restarted run waits for its run folder's lock: DataLoader workers its dead rank 0 forked hold it
until they notice their parent is gone (torch's watchdog checks every few seconds) and exit."""


def lock_wait_seconds(environ: Mapping[str, str]) -> float:
    """Seconds to wait for the run folder's lock: 0 for a new run (a run in the way is refused at once), a
    minute for a restarted one (torch elastic, a Slurm requeue), whose predecessor's processes are ending."""
    return RESTART_LOCK_WAIT_SECONDS if restart_count(environ) else 0.0


def check_run_folder(folder: Path) -> None:
    """Raise UserError, in one line, when ``folder`` cannot be a run folder: an existing file, or under one.

    (Whether it can be written is known only by writing: :func:`claim_run_folder` and the run's lock say so.)
    """
    for path in (folder, *folder.parents):
        try:
            if path.exists() and not path.is_dir():
                what = "" if path == folder else f" (its parent {path} is a file)"
                raise UserError(
                    f"output_dir {folder} is not a folder{what}; choose a folder (output_dir=...), "
                    "or move that file away"
                )
        except OSError:
            return  # not searchable: the mkdir or the lock names the problem


def _check_writable(folder: Path) -> None:
    """Raise UserError when no file can be created in ``folder`` (read-only, immutable, not this user's): said here,
    before any worker starts or the launcher makes the logs folder in it."""
    try:
        descriptor, probe = tempfile.mkstemp(prefix=".ddpkit-write-test-", dir=folder)
    except OSError as e:
        raise UserError(
            f"cannot write to {folder} ({e.strerror or e}); choose a folder this user can write (output_dir=...)"
        ) from None
    os.close(descriptor)
    os.unlink(probe)


URL_FILE = "checkpoints.url"
"""The file in a run's local folder that holds the URL of the run's checkpoints, when they are in a store."""


def recorded_url(folder: str | os.PathLike[str]) -> str:
    """The URL of the checkpoints of the run whose local folder is ``folder`` (its :data:`URL_FILE`), else ""."""
    try:
        return (Path(folder) / URL_FILE).read_text().strip()
    except OSError:  # none (a local run's folder), or not readable: nothing recorded
        return ""


RUN_FILES = ("metrics.jsonl", "summary.json", "checkpoints", "logs", ".ddpkit.lock")
"""What a run leaves in its folder: a folder holding one of these holds a run."""


def check_fresh_run_folder(folder: Path) -> None:
    """Raise UserError, in one line, when a run that resumes nothing would write into ``folder`` beside other files.

    Another run's metrics.jsonl would get this run's lines and its summary.json this run's summary; a folder of
    other things (``output_dir=/etc``) is no place for a run. A missing or empty folder is fine.
    """
    try:
        names = sorted(path.name for path in folder.iterdir())
    except OSError:
        return  # missing (created later), or not readable: the mkdir or the lock names the problem
    if not names:
        return
    ran = [name for name in RUN_FILES if name in names]
    if ran:
        with contextlib.suppress(OSError), FolderLock(folder, fix="output_dir=..."):
            pass  # a run still writing there is named by the lock's refusal (FolderInUseError): who holds it
        raise UserError(
            f"output_dir {folder} holds another run ({', '.join(ran)}) with no checkpoint to continue; start this "
            "run in a new folder (another output_dir=..., or none for a new one under runs/) or remove that run"
        )
    shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
    raise UserError(
        f"output_dir {folder} is not empty ({shown}) and holds no ddpkit run; choose a new or empty folder "
        "(output_dir=...), or none for a new one under runs/"
    )


def _point_latest(folder: Path) -> None:
    if LATEST.exists() and not LATEST.is_symlink():
        return  # a real folder of that name (an older ddpkit's runs/latest): leave it alone
    # A new link under a temporary name, renamed over the old one: readers see the old or the new run, never none.
    temporary = RUNS_DIR / f".latest-{os.getpid()}"
    temporary.unlink(missing_ok=True)
    temporary.symlink_to(os.path.relpath(folder.resolve(), RUNS_DIR.resolve()))
    os.replace(temporary, LATEST)


def _order(name: str) -> tuple[str, int]:
    # "20261124-071900-2" after "20261124-071900"; slurm-<id> by id.
    stamp, _, n = name.rpartition("-")
    if n.isdigit() and len(n) < 4 and stamp:
        return stamp, int(n)
    return name, 1


def _safe(name: str) -> str:
    """A name usable in a path: my_models:build -> my_models.build."""
    return _UNSAFE.sub(".", name).strip(".") or "run"
