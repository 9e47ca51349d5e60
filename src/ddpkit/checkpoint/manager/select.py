"""Which checkpoint a run resumes from: ``resume=never``, ``auto`` or a path.

- ``never``: start fresh. A folder that already holds complete checkpoints
  (``step-*`` or ``best-*``) is refused (two runs' checkpoints would mix):
  continue it with ``auto`` or choose another folder.
- ``auto``: the newest complete checkpoint that verifies (sizes, SHA-256,
  safe load), among the ``step-*`` ones and the ``best-*`` one (taken, and
  said in one line, when no newer ``step-*`` is complete). A newer one that
  is corrupt, unreadable or marked as holding non-finite weights is named in
  a warning and set aside (renamed ``step-....corrupt``, ``.unreadable``,
  ``.nonfinite``) and the previous good one is used. With no checkpoint at all
  the run starts fresh and says so; when checkpoints exist but none verifies,
  it stops with an error rather than starting silently from scratch.
- a path: that checkpoint, strictly (any problem is an error).

Nothing is deleted here: a folder without a manifest newer than the
checkpoint resumed from (an interrupted write, or a copy or sync still in
progress) is renamed ``step-....incomplete`` and reported, so that the run's
next checkpoints cannot collide with it and its files stay for whoever put
them there.

A restarted worker (``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT``
above 0) resumes as with ``auto`` whatever was asked, when the folder holds a
complete checkpoint.

Only rank 0 runs these functions; the Checkpointer shares the outcome.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.disk.finite import NONFINITE_SUFFIX
from ddpkit.checkpoint.disk.format import (
    BEST_PREFIX,
    CORRUPT_SUFFIX,
    INCOMPLETE_SUFFIX,
    MANIFEST,
    UNREADABLE_SUFFIX,
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    read_manifest,
    set_aside,
    verify_checkpoint,
)
from ddpkit.checkpoint.remote.store import is_remote, remote_folder
from ddpkit.checkpoint.remote.transfer import remote_checkpoints
from ddpkit.log import get_logger


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this job was restarted (torch elastic) or requeued (Slurm)."""
    counts = [environ.get("TORCHELASTIC_RESTART_COUNT", ""), environ.get("SLURM_RESTART_COUNT", "")]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


def holds_checkpoints(root: str | Path, newest: str) -> CheckpointError:
    """The error for a fresh start into a folder (or URL) that already holds checkpoints, the newest named ``newest``."""
    return CheckpointError(
        f"{root} already holds checkpoints (newest: {newest}); continue that run with "
        "resume=auto, or start a new one in another folder (output_dir=... or checkpoint.dir=...)"
    )


def candidates(root: str | Path) -> list[CheckpointInfo]:
    """The complete (or unreadable) ``step-*`` and ``best-*`` checkpoints of ``root``, oldest first; at one
    step, the ``best-*`` before the ``step-*`` (its hard-linked twin), so the ``step-*`` is tried first."""
    found = [i for i in list_checkpoints(root) + list_checkpoints(root, prefix=BEST_PREFIX) if i.complete]
    return sorted(found, key=lambda info: (info.global_step, not info.path.name.startswith(BEST_PREFIX)))


def stored_checkpoints(root: str | Path) -> list[str]:
    """The names of :func:`candidates`, in its order, for a folder or a URL (the store's listing)."""
    if not is_remote(root):
        return [info.path.name for info in candidates(root)]
    found = [c for c in remote_checkpoints(root) + remote_checkpoints(root, prefix=BEST_PREFIX) if c.complete]
    return [c.name for c in sorted(found, key=lambda c: (c.global_step, not c.name.startswith(BEST_PREFIX)))]


def check_resume(root: str | Path, resume: str) -> None:
    """Fail early, before any worker starts, when ``resume`` cannot work (the workers check again, fully).

    Raises:
        CheckpointError: a fresh start into a folder holding checkpoints, or
            ``resume=PATH`` that is not a complete checkpoint.
    """
    if resume == "never":
        complete = stored_checkpoints(root)  # a URL's too: the trainer checks before launch
        if complete:
            raise holds_checkpoints(root, complete[-1])
    elif is_remote(resume):
        folder = remote_folder(resume)
        if not folder.fs.exists(folder.join(MANIFEST)):
            raise CheckpointError(
                f"resume={resume} is not a complete checkpoint: it has no {MANIFEST} in the store; pass a "
                "checkpoint's URL (e.g. .../checkpoints/step-000000120), or resume=auto"
            )
    elif resume != "auto":
        read_manifest(resume)


def choose_checkpoint(
    root: str | Path, resume: str, restarts: int = 0, shown: Callable[[Path], str] = str
) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its verified, loaded files (None, None: start fresh).

    Args:
        root: the checkpoints folder.
        resume: never, auto or the path of a checkpoint.
        restarts: how often the job was restarted (see the module docstring).
        shown: how the lines name a checkpoint or ``root`` (a remote folder's staged copy: its URL).

    Raises:
        CheckpointError: see the module docstring; the message says what to do.
    """
    root = Path(root)
    infos = list_checkpoints(root)
    complete = candidates(root)
    if restarts and resume != "auto" and complete:
        get_logger().info(f"restart {restarts}: resuming from the newest checkpoint in {shown(root)}")
        resume = "auto"
    if resume == "never":
        if complete:
            raise holds_checkpoints(shown(root), complete[-1].path.name)
        set_aside_incomplete(infos)
        return None, None
    if resume == "auto":
        return _newest_good(root, infos, complete, shown)
    return _strict(root, Path(resume), infos, shown)


def _strict(
    root: Path, path: Path, infos: list[CheckpointInfo], shown: Callable[[Path], str]
) -> tuple[Path, dict[str, Any]]:
    loaded = verify_checkpoint(path)
    step = loaded["manifest"]["global_step"]
    newer = [i for i in infos if i.complete and i.global_step > step and i.path.resolve() != path.resolve()]
    if newer:
        raise CheckpointError(
            f"{shown(root)} holds checkpoints newer than resume={shown(path)} ({newer[-1].path.name}); resuming "
            "from the older one there would mix two runs: move the newer ones away, "
            "or write this run's checkpoints to another folder"
        )
    set_aside_incomplete([i for i in infos if i.global_step > step])
    return path, loaded


def _newest_good(
    root: Path, infos: list[CheckpointInfo], complete: list[CheckpointInfo], shown: Callable[[Path], str]
) -> tuple[Path | None, dict[str, Any] | None]:
    log = get_logger()
    bad: list[tuple[CheckpointInfo, str]] = []
    for info in reversed(complete):
        if not info.finite:
            log.warning(f"resume=auto: skipping checkpoint {info.path.name}: its weights are NaN or infinite")
            bad.append((info, NONFINITE_SUFFIX))
            continue
        try:
            loaded = verify_checkpoint(info.path)
        except CheckpointError as e:
            log.warning(f"resume=auto: skipping checkpoint {info.path.name}: {e}")
            bad.append((info, UNREADABLE_SUFFIX if info.unreadable or "cannot be read" in str(e) else CORRUPT_SUFFIX))
            continue
        if bad:
            what = {CORRUPT_SUFFIX: "corrupt", UNREADABLE_SUFFIX: "unreadable", NONFINITE_SUFFIX: "non-finite"}
            log.warning(
                f"resume=auto: newest checkpoint {shown(bad[0][0].path)} is {what[bad[0][1]]}; "
                f"using the previous good one, {shown(info.path)}"
            )
            for info_bad, suffix in bad:
                _set_aside(info_bad.path, suffix)
        if info.path.name.startswith(BEST_PREFIX):
            log.warning(
                f"resume=auto: no complete step-* checkpoint is newer than {info.path.name}; "
                f"resuming from the best checkpoint {shown(info.path)}"
            )
        set_aside_incomplete([i for i in infos if i.global_step > info.global_step])
        return info.path, loaded
    if bad:
        raise CheckpointError(
            f"no checkpoint in {shown(root)} verifies ({', '.join(i.path.name for i, _ in bad)} are not usable); "
            "restore them from a backup, or start over with resume=never in another folder"
        )
    log.info(f"resume=auto: no checkpoint in {shown(root)} yet; starting from the beginning")
    set_aside_incomplete(infos)
    return None, None


def set_aside_incomplete(infos: list[CheckpointInfo]) -> list[Path]:
    """Rename the folders without a manifest among ``infos`` to ``<name>.incomplete``; returns the new paths.

    Never deleted: an interrupted write looks the same as a copy or sync still in progress.
    """
    moved = []
    for info in infos:
        if not info.complete:
            target = _set_aside(
                info.path,
                INCOMPLETE_SUFFIX,
                "it has no manifest: an interrupted write, or a copy "
                "still in progress; delete it once nothing is writing there",
            )
            if target is not None:
                moved.append(target)
    return moved


def _set_aside(path: Path, suffix: str, why: str = "") -> Path | None:
    """Rename ``path`` aside with ``suffix`` and say so in one line; a failed rename is a warning too."""
    log = get_logger()
    try:
        target = set_aside(path, suffix)
    except OSError as e:
        log.warning(f"could not set {path} aside ({e.strerror or e}); it is left where it is and not used")
        return None
    log.warning(f"set {path} aside as {target.name}" + (f": {why}" if why else ""))
    return target
