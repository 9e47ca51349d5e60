"""``ddpkit checkpoints``: list a folder of checkpoints, or check one against its digest.

::

    ddpkit checkpoints runs/latest                       # or runs/latest/checkpoints
    ddpkit checkpoints s3://my-bucket/run                # a run's checkpoints in object storage
    ddpkit checkpoints runs/latest/checkpoints/step-000000120 digest=9f86d081...

torch is imported only when a command runs, so ``ddpkit --help`` stays quick.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

from ddpkit.commands.help import CommandHelp
from ddpkit.errors import UserError
from ddpkit.keyvalue import parse


@dataclasses.dataclass
class CheckpointsConfig:
    """Options of ``ddpkit checkpoints``."""

    verify: bool = True
    """Read every file and check its SHA-256 against the manifest (false: only read the manifests)."""
    digest: str = ""
    """Check one checkpoint (DIR is its folder) against the digest recorded when it was written (its log line,
    or this listing's digest column, kept where the folder cannot be written): exit status 1 unless it matches."""

    def __post_init__(self) -> None:
        if self.digest and not re.fullmatch(r"[0-9a-fA-F]{64}", self.digest):
            raise UserError(
                f"digest={self.digest} is not a digest: pass the 64 hex digits the checkpoint's log line or "
                "the listing's digest column shows"
            )


CHECKPOINTS_HELP = CommandHelp(
    usage="ddpkit checkpoints DIR [key=value ...]",
    summary="List the checkpoints of a folder, one line each: step, epoch, metric, size, digest and whether it "
    "verifies (newest, best, incomplete, corrupt, unreadable or non-finite). Exit status 1 when the newest one is "
    "not usable; 'newest' tags the one resume=auto would take. With digest=..., check one checkpoint against the "
    "digest recorded when it was written.",
    schema="ddpkit.commands.checkpoints:CheckpointsConfig",
    positional=(("DIR", "a run's folder (e.g. runs/latest) or its checkpoints folder, or their URL (s3://...)"),),
    examples=(
        "ddpkit checkpoints runs/latest",
        "ddpkit checkpoints s3://my-bucket/run",
        "ddpkit checkpoints runs/latest verify=false",
        "ddpkit checkpoints runs/latest/checkpoints/step-000000120 digest=9f86d081...",
    ),
)


def split_paths(args: Sequence[str], help: CommandHelp, num_positional: int) -> tuple[list[str], list[str]]:
    """The positional words (checked in number) and the key=value words."""
    positional = [a for a in args if "=" not in a]
    if len(positional) != num_positional:
        raise UserError(f"expected {num_positional} path(s), got {len(positional)}; usage: {help.usage}")
    return positional, [a for a in args if "=" in a]


def checkpoints_command(args: Sequence[str]) -> int:
    """``ddpkit checkpoints DIR``: one line per checkpoint: step, epoch, metric, size, whether it verifies.

    DIR may be a URL (``s3://bucket/run``): its checkpoints are listed from the store, and each is
    downloaded into a temporary folder to be verified (``verify=false`` reads only the manifests).
    Exits 1 (after the table, with one line on stderr) when the newest ``step-*`` folder is not a good
    checkpoint (incomplete, corrupt, unreadable or of non-finite weights): "newest" tags the newest one
    that is, the one ``resume=auto`` takes.
    """
    import sys

    from ddpkit.checkpoint import BEST_PREFIX, checkpoint_digest

    (folder,), words = split_paths(args, CHECKPOINTS_HELP, 1)
    config = parse(CheckpointsConfig, words)
    if config.digest:
        return _check_digest(folder, config.digest)
    root, infos = _listing(folder)
    if not infos:
        print(_none_in(root, folder))
        return 0
    statuses = {info.name: _status(info, config.verify) for info in infos}
    good = [i for i in infos if statuses[i.name] in ("ok", "complete (not verified)")]
    steps = [i for i in infos if not i.name.startswith(BEST_PREFIX)]
    newest_good = max((i for i in good if i in steps), key=lambda i: i.global_step, default=None)
    rows = [("checkpoint", "step", "epoch", "metric", "size", "digest", "status")]
    for info in infos:
        manifest = info.manifest or {}
        status = statuses[info.name]
        if info.name.startswith(BEST_PREFIX):
            status += ", best"
        elif info is newest_good:
            status += ", newest"
        digest = checkpoint_digest(manifest) if manifest else "-"
        rows.append(
            (
                info.name,
                str(info.global_step),
                _epoch(manifest),
                _metric(manifest),
                _size(info.size),
                digest,
                status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(6)]
    print(f"{root}:")
    for row in rows:
        print(
            "  ".join(
                cell.ljust(width) if i in (0, 3, 5) else cell.rjust(width)
                for i, (cell, width) in enumerate(zip(row[:6], widths))
            )
            + "  "
            + row[6]
        )
    newest = steps[-1] if steps else None
    if newest is not None and newest is not newest_good:
        fallback = max(good, key=lambda i: i.global_step, default=None)
        then = (
            f"resume=auto would continue from {fallback.name}"
            if fallback is not None
            else "no checkpoint here can be resumed"
        )
        print(
            f"ddpkit: the newest checkpoint {newest.name} is not usable "
            f"({statuses[newest.name].split(':')[0].split(' (')[0]}); {then}",
            file=sys.stderr,
        )
        return 1
    return 0


def _none_in(root: str, folder: str) -> str:
    """The line for a folder without checkpoints: for the local folder of a run whose checkpoints are in a store,
    where they are (the URL ``ddpkit train`` recorded there) and the command that lists them."""
    from ddpkit.checkpoint import is_remote
    from ddpkit.train.run_folder import recorded_url

    url = "" if is_remote(folder) else recorded_url(folder)
    if url:
        return f"no checkpoints in {root}: this run keeps them in {url}; list them with ddpkit checkpoints {url}"
    return f"no checkpoints in {root}"


def _check_digest(folder: str, digest: str) -> int:
    """``digest=...``: 0 when every file of the checkpoint ``folder`` (a folder or a URL) verifies and matches."""
    import sys

    from ddpkit.checkpoint import CheckpointError, has_manifest, is_remote, local_checkpoint, verify_checkpoint

    if not is_remote(folder) and not has_manifest(folder):
        raise UserError(
            f"{folder} is not a checkpoint: digest=... checks one checkpoint; pass its folder "
            "(e.g. runs/latest/checkpoints/step-000000120)"
        )
    try:
        with local_checkpoint(folder) as (local, name):
            if is_remote(folder) and name != folder.rstrip("/"):  # a URL of a run, not of one checkpoint
                raise UserError(
                    f"{folder} is not a checkpoint: digest=... checks one checkpoint; pass its URL (e.g. {name})"
                )
            try:
                verify_checkpoint(local, digest=digest)
            except CheckpointError as e:
                raise CheckpointError(str(e).replace(str(local), name)) from None  # the URL, not the download's
    except CheckpointError as e:
        print(f"ddpkit: {e}", file=sys.stderr)
        return 1
    print(f"{folder}: ok, every file verifies and matches the digest {digest.lower()}")
    return 0


@dataclasses.dataclass(frozen=True)
class Listed:
    """One checkpoint of the listing, in a folder or in object storage."""

    name: str
    """Its name (``step-000000120``)."""
    where: str
    """Its folder, or its URL."""
    global_step: int
    manifest: dict[str, Any] | None
    """Its manifest, None without one (incomplete)."""
    problem: str
    """Why its manifest cannot be read."""
    unreadable: bool
    """The folder or manifest cannot be read (permissions), rather than damaged."""
    complete: bool
    finite: bool
    size: int


def _listing(folder: str) -> tuple[str, list[Listed]]:
    """The checkpoints folder of ``folder`` (a run's folder or URL, or the checkpoints' own) and its checkpoints
    (``step-*``, then ``best-*``)."""
    from pathlib import Path

    from ddpkit.checkpoint import (
        BEST_PREFIX,
        is_remote,
        list_checkpoints,
        remote_checkpoints,
        remote_root,
        resolve_checkpoint_dir,
    )

    if is_remote(folder):
        url = remote_root(folder)
        stored = remote_checkpoints(url) + remote_checkpoints(url, prefix=BEST_PREFIX)
        return url, [
            Listed(c.name, c.url, c.global_step, c.manifest, c.problem, False, c.complete, c.finite, c.size)
            for c in stored
        ]
    try:
        is_folder = Path(folder).is_dir()
    except OSError:
        is_folder = True  # not searchable: list_checkpoints says so in one line
    if not is_folder:
        raise UserError(f"{folder} is not a folder; pass a checkpoints folder or an output_dir")
    root = resolve_checkpoint_dir(folder)
    found = list_checkpoints(root) + list_checkpoints(root, prefix=BEST_PREFIX)
    return str(root), [
        Listed(
            i.path.name, str(i.path), i.global_step, i.manifest, i.problem, i.unreadable, i.complete, i.finite, i.size
        )
        for i in found
    ]


def _status(info: Listed, verify: bool) -> str:
    """The status column of one checkpoint: ok, or why it is not usable."""
    from ddpkit.checkpoint import CheckpointError, local_checkpoint, verify_checkpoint

    if not info.complete:
        return "incomplete (no manifest: an interrupted write or a copy in progress; not used)"
    if info.problem:
        return ("UNREADABLE: " if info.unreadable else "CORRUPT: ") + info.problem
    if not info.finite:
        return "NON-FINITE weights (NaN or infinity; not used)"
    if not verify:
        return "complete (not verified)"
    try:
        # A URL's checkpoint is downloaded, each file checked as it arrives, then loaded as a local one is.
        with local_checkpoint(info.where) as (local, name):
            try:
                verify_checkpoint(local)
            except CheckpointError as e:
                raise CheckpointError(str(e).replace(str(local), name)) from None  # the URL, not the download's
        return "ok"
    except CheckpointError as e:
        return ("UNREADABLE: " if "cannot be read" in str(e) else "CORRUPT: ") + str(e)


def _epoch(manifest: dict[str, Any]) -> str:
    if "completed_epochs" not in manifest:
        return "-"
    done, step, per_epoch = (
        manifest["completed_epochs"],
        manifest.get("step_in_epoch", 0),
        manifest.get("steps_per_epoch"),
    )
    if not step:
        return f"{done}"
    if per_epoch is None:  # no loader told the epoch's length: a loop without epochs, or inside its first
        return f"{done}+{step}" if done else "-"
    return f"{done}+{step}/{per_epoch}"


def _metric(manifest: dict[str, Any]) -> str:
    metrics = manifest.get("metrics") or {}
    for name in ("accuracy", "mse", "loss"):
        if name in metrics:
            return f"{name} {metrics[name]:.4f}"
    return "-"


def _size(num_bytes: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if num_bytes < 1024 or unit == "GB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    return f"{num_bytes:.1f} TB"
