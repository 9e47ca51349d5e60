"""Which checkpoint a run resumes from: ``resume=never``, ``auto`` or a path.

- ``never``: start fresh. A folder that already holds complete checkpoints
  is refused (two runs' checkpoints would mix): continue it with ``auto`` or
  choose another folder.
- ``auto``: the newest complete checkpoint that verifies (sizes, SHA-256,
  safe load). A newer one that is corrupt is named in a warning and set
  aside (``step-....corrupt``) and the previous good one is used; leftovers of
  interrupted writes are removed. With no checkpoint at all the run starts
  fresh and says so; when checkpoints exist but none verifies, it stops with
  an error rather than starting silently from scratch.
- a path: that checkpoint, strictly (any problem is an error).

A restarted worker (``TORCHELASTIC_RESTART_COUNT`` or ``SLURM_RESTART_COUNT``
above 0) resumes as with ``auto`` whatever was asked, when the folder holds a
complete checkpoint.

Only rank 0 runs these functions; the Checkpointer shares the outcome.
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpkit.checkpoint.format import (
    CheckpointError,
    CheckpointInfo,
    list_checkpoints,
    read_manifest,
    set_aside,
    verify_checkpoint,
)
from ddpkit.log import get_logger


def restart_count(environ: Mapping[str, str]) -> int:
    """How many times this job was restarted (torch elastic) or requeued (Slurm)."""
    counts = [environ.get("TORCHELASTIC_RESTART_COUNT", ""), environ.get("SLURM_RESTART_COUNT", "")]
    return max((int(c) for c in counts if c.strip().isdigit()), default=0)


def holds_checkpoints(root: Path, complete: list[CheckpointInfo]) -> CheckpointError:
    """The error for a fresh start into a folder that already holds checkpoints."""
    return CheckpointError(
        f"{root} already holds checkpoints (newest: {complete[-1].path.name}); continue that run with "
        "resume=auto, or start a new one in another folder (output_dir=... or checkpoint.dir=...)"
    )


def check_resume(root: str | Path, resume: str) -> None:
    """Fail early, before any worker starts, when ``resume`` cannot work (the workers check again, fully).

    Raises:
        CheckpointError: a fresh start into a folder holding checkpoints, or
            ``resume=PATH`` that is not a complete checkpoint.
    """
    if resume == "never":
        complete = [info for info in list_checkpoints(root) if info.complete]
        if complete:
            raise holds_checkpoints(Path(root), complete)
    elif resume != "auto":
        read_manifest(resume)


def choose_checkpoint(root: str | Path, resume: str, restarts: int = 0) -> tuple[Path | None, dict[str, Any] | None]:
    """The checkpoint to resume from and its verified, loaded files (None, None: start fresh).

    Args:
        root: the checkpoints folder.
        resume: never, auto or the path of a checkpoint.
        restarts: how often the job was restarted (see the module docstring).

    Raises:
        CheckpointError: see the module docstring; the message says what to do.
    """
    root = Path(root)
    infos = list_checkpoints(root)
    complete = [info for info in infos if info.complete]
    if restarts and resume != "auto" and complete:
        get_logger().info(f"restart {restarts}: resuming from the newest checkpoint in {root}")
        resume = "auto"
    if resume == "never":
        if complete:
            raise holds_checkpoints(root, complete)
        remove_incomplete(infos)
        return None, None
    if resume == "auto":
        return _newest_good(root, infos)
    return _strict(root, Path(resume), infos)


def _strict(root: Path, path: Path, infos: list[CheckpointInfo]) -> tuple[Path, dict[str, Any]]:
    loaded = verify_checkpoint(path)
    step = loaded["manifest"]["global_step"]
    newer = [i for i in infos if i.complete and i.global_step > step and i.path.resolve() != path.resolve()]
    if newer:
        raise CheckpointError(
            f"{root} holds checkpoints newer than resume={path} ({newer[-1].path.name}); resuming "
            "from the older one there would mix two runs: move the newer ones away, "
            "or write this run's checkpoints to another folder"
        )
    remove_incomplete([i for i in infos if i.global_step > step])
    return path, loaded


def _newest_good(root: Path, infos: list[CheckpointInfo]) -> tuple[Path | None, dict[str, Any] | None]:
    log = get_logger()
    bad: list[CheckpointInfo] = []
    for info in reversed([info for info in infos if info.complete]):
        try:
            loaded = verify_checkpoint(info.path)
        except CheckpointError as e:
            log.warning(f"resume=auto: skipping checkpoint {info.path.name}: {e}")
            bad.append(info)
            continue
        if bad:
            log.warning(
                f"resume=auto: newest checkpoint {bad[0].path} is corrupt; using the previous good one, {info.path}"
            )
            for info_bad in bad:
                log.warning(f"set aside as {set_aside(info_bad.path)}")
        remove_incomplete([i for i in infos if i.global_step > info.global_step])
        return info.path, loaded
    if bad:
        raise CheckpointError(
            f"no checkpoint in {root} verifies ({', '.join(i.path.name for i in bad)} are corrupt); "
            "restore them from a backup, or start over with resume=never in another folder"
        )
    log.info(f"resume=auto: no checkpoint in {root} yet; starting from the beginning")
    remove_incomplete(infos)
    return None, None


def remove_incomplete(infos: list[CheckpointInfo]) -> None:
    """Delete the folders of interrupted writes (no manifest) among ``infos``."""
    for info in infos:
        if not info.complete:
            get_logger().warning(f"removing {info.path}: an interrupted checkpoint write (it has no manifest)")
            shutil.rmtree(info.path, ignore_errors=True)
