"""One save, step by step: what every rank contributes, and the request rank 0 hands its writer.

The Checkpointer decides when (:mod:`ddpkit.checkpoint.manager.schedule`) and
tells a save its facts (:class:`SaveFacts`: why, the counters, where in
the epochs, the metrics); :class:`CheckpointSave` carries it out over the
parts it was given, never reading the Checkpointer:

1. every rank checks in (:mod:`ddpkit.checkpoint.manager.checkin`): a rank missing,
   or one gone on past the save, fails it naming the ranks;
2. a sharded model's ranks write their shards, or start to in the background (:mod:`ddpkit.checkpoint.sharded.state`);
3. every rank answers the collective ``state_dict()`` calls (a stream's
   loader), checks once that the extras agree, and rank 0 gathers every
   rank's generators and ``per_rank`` states;
4. rank 0 builds the files and manifest facts (:mod:`ddpkit.checkpoint.manager.contents`)
   into a :class:`~ddpkit.checkpoint.disk.writer.WriteRequest` for its writer;
   every rank learns the folder, or rank 0's error (:func:`~ddpkit.checkpoint.ranks.on_rank_zero`).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddpkit.checkpoint.disk.async_save import copy_state
from ddpkit.checkpoint.disk.folder_lock import FolderLock, lock_checkpoint_folder
from ddpkit.checkpoint.disk.format import checkpoint_name
from ddpkit.checkpoint.disk.storage import checkpoint_bytes, room_warning
from ddpkit.checkpoint.disk.writer import CheckpointWriter, FolderWriter, WriteRequest
from ddpkit.checkpoint.manager import select
from ddpkit.checkpoint.manager.advice import differing_extras
from ddpkit.checkpoint.manager.checkin import SaveCheckIns
from ddpkit.checkpoint.manager.contents import checkpoint_files, config_texts, manifest_facts
from ddpkit.checkpoint.objects import is_collective, state_to_agree, tensor_digest
from ddpkit.checkpoint.options import READABLE_BY, CheckpointOptions
from ddpkit.checkpoint.ranks import default_store, on_rank_zero
from ddpkit.checkpoint.remote.staging import shown_as_url
from ddpkit.checkpoint.remote.store import RemoteFolder
from ddpkit.checkpoint.remote.writer import RemoteWriter
from ddpkit.checkpoint.rng import capture_rng_state
from ddpkit.checkpoint.sharded.state import ShardedState, sharded_state
from ddpkit.checkpoint.sharded.writer import ShardedWriter
from ddpkit.log import get_logger

__all__ = ["CheckpointSave", "SaveFacts", "claim_folder", "make_writer", "saving_parts"]


@dataclass(frozen=True)
class SaveFacts:
    """What the Checkpointer tells one save: why, its counters, where in the epochs, metrics and best."""

    reason: str
    """Why it is written (every_steps, epoch_end, preempted, manual...)."""
    global_step: int
    completed_epochs: int
    epoch_start_step: int
    """Without a loader: the global step of the last ``epoch_end()``."""
    resume_point: tuple[int, int]
    """(epoch to train next, batches of it done), in the loop's numbering."""
    steps_per_epoch: int | None
    """The loader's, None without one."""
    metrics: dict[str, float] = field(default_factory=dict)
    best: bool = False
    """Make it the ``best-*`` checkpoint."""
    best_info: dict[str, Any] = field(default_factory=dict)
    """The manifest's ``best`` entry (metric, mode, value)."""
    replacing: bool = False
    """It replaces a checkpoint of the same step (said in the log line)."""

    def counters(self) -> dict[str, int]:
        """The Checkpointer's counters, as the checkpoint's train file holds them."""
        return {
            "global_step": self.global_step,
            "completed_epochs": self.completed_epochs,
            "epoch_start_step": self.epoch_start_step,
        }


def make_writer(
    root: Path,
    objects: Mapping[str, Any],
    world_size: int,
    options: CheckpointOptions,
    shards: ShardedState | None,
    async_save: bool,
    on_save: Callable[[Path, str], None],
    remote: RemoteFolder | None = None,
) -> CheckpointWriter:
    """Rank 0's writer: a :class:`~ddpkit.checkpoint.disk.writer.FolderWriter` (in the background or not), or a
    :class:`~ddpkit.checkpoint.sharded.writer.ShardedWriter` completing the folder of ``shards`` (in the
    background when they are); for a ``remote`` folder, either of them writing into the staging folder
    ``root``, under a :class:`~ddpkit.checkpoint.remote.writer.RemoteWriter` that uploads what they wrote."""

    def local(on_save: Callable[[Path, str], None]) -> CheckpointWriter:
        settings: dict[str, Any] = {
            "mode": READABLE_BY[options.readable_by],
            "keep": options.keep,
            "on_write_error": options.on_write_error,
            "needed_bytes": lambda: checkpoint_bytes(root, objects, world_size),
            "on_save": on_save,
            "shown": shown_as_url(remote, root),  # a staged checkpoint: named by its URL
        }
        if shards is not None:
            return ShardedWriter(root, staged=shards.staged, async_save=async_save, **settings)
        return FolderWriter(root, async_save=async_save, **settings)

    if remote is None:
        return local(on_save)
    return RemoteWriter(remote, root, local, keep=options.keep, on_write_error=options.on_write_error, on_save=on_save)


def saving_parts(
    root: Path,
    objects: Mapping[str, Any],
    per_rank: list[str],
    extras: list[str],
    options: CheckpointOptions,
    rank: int,
    world_size: int,
    async_save: bool,
    timeout: float,
    restart: str,
    config: Mapping[str, Any],
    meta: Mapping[str, Any],
    on_save: Callable[[Path, str], None],
    remote: RemoteFolder | None = None,
) -> CheckpointSave:
    """A Checkpointer's saving side: its :class:`CheckpointSave` over a sharded model's state (None for a
    replicated one), every rank's check-ins and rank 0's writer (None on the other ranks; uploading to
    ``remote`` what it writes in ``root`` when given)."""
    shards = sharded_state(objects, rank, world_size, async_save=async_save)
    writer = make_writer(root, objects, world_size, options, shards, async_save, on_save, remote) if rank == 0 else None
    check_ins = SaveCheckIns(next(_INSTANCES), rank, world_size, restart, timeout)
    mode = READABLE_BY[options.readable_by]
    return CheckpointSave(
        root,
        objects,
        per_rank=per_rank,
        extras=extras,
        shards=shards,
        check_ins=check_ins,
        writer=writer,
        rank=rank,
        world_size=world_size,
        mode=mode,
        config=config,
        meta=meta,
    )


_INSTANCES = itertools.count()
"""Checkpointers made by this process, numbered in order (the same on every rank)."""


def claim_folder(
    root: Path,
    objects: Mapping[str, Any],
    world_size: int,
    options: CheckpointOptions,
    restarted: bool,
    writer: CheckpointWriter | None = None,
) -> FolderLock | None:
    """Rank 0, before its first save: warn when the folder lacks room, and take its lock (None: it cannot be
    written, which the first save says in one line); a remote folder's lease first (the writer holds it).

    A run owns its folder for its life: a second run into it stops here, before writing. Rank 0 alone (no
    collective: this may come first in a save some ranks never reach); its exit ends the job.

    Raises:
        FolderInUseError: another live run holds the folder (or the remote prefix).
    """
    if isinstance(writer, RemoteWriter):
        writer.claim(restarted)
    if warning := room_warning(root, options.keep, checkpoint_bytes(root, objects, world_size)):
        get_logger().warning(warning)
    return lock_checkpoint_folder(root, READABLE_BY[options.readable_by], restarted)


class CheckpointSave:
    """Carries out each save over explicit parts; see the module docstring.

    Args:
        root: the checkpoints folder.
        objects: the Checkpointer's objects by name.
        per_rank: the names of the objects saved for every rank.
        extras: the names of the ``extra`` objects (saved from rank 0; checked once to agree).
        shards: a sharded model's state, which every rank writes; None for a replicated model.
        check_ins: every rank's arrival at each save.
        writer: rank 0's writer; None on the other ranks.
        rank: this process's rank.
        world_size: the number of ranks.
        mode: the files' permission bits.
        config: the run's configuration, stored with every checkpoint.
        meta: more facts for the manifest.
    """

    def __init__(
        self,
        root: Path,
        objects: Mapping[str, Any],
        *,
        per_rank: list[str],
        extras: list[str],
        shards: ShardedState | None,
        check_ins: SaveCheckIns,
        writer: CheckpointWriter | None,
        rank: int,
        world_size: int,
        mode: int,
        config: Mapping[str, Any],
        meta: Mapping[str, Any],
    ) -> None:
        self.root, self.objects, self.per_rank, self.extras = root, objects, per_rank, extras
        self.shards, self.check_ins, self.writer = shards, check_ins, writer
        self.rank, self.world_size, self.mode = rank, world_size, mode
        self.config, self.meta = config, meta
        self._folder_checked = False  # rank 0: by a resume, or the first save's check_resume(root, "never")
        self._extras_checked = False

    def before_choosing(self, choice: str) -> str:
        """Rank 0, before a resume makes ``choice`` (never, auto, a checkpoint): the writes in flight done; for a
        remote folder, its newest complete checkpoint staged, and a checkpoint's URL replaced by its staged copy
        (:meth:`ddpkit.checkpoint.remote.writer.RemoteWriter.pull`). Returns the choice to make."""
        if isinstance(self.writer, RemoteWriter):
            return self.writer.pull(choice)
        if self.writer is not None:
            self.writer.wait()
        return choice

    def folder_checked(self) -> None:
        """The folder was checked already (a resume chose from it): the first save does not check it again."""
        self._folder_checked = True

    def close(self, failed: bool) -> None:
        """Stop the saving side: a failed run's shard writes dropped, rank 0's writer done, the check-ins over."""
        if self.shards is not None and failed:
            self.shards.close()
        if self.writer is not None:
            self.writer.close(failed)
        self.check_ins.stop()

    def save(self, facts: SaveFacts, stopping: Callable[[], bool]) -> Path | None:
        """Write one checkpoint (a collective: every rank calls it); return its folder on every rank.

        Args:
            facts: what the Checkpointer tells of this save.
            stopping: True when this rank received a preemption signal (a check-in that waits says so).

        Returns:
            The checkpoint folder; None when it could not be written and ``on_write_error`` is "warn".
        """
        self.check_ins.check_in(default_store, facts.global_step, stopping)
        if self.shards is not None:  # every rank writes its shards; rank 0 completes the folder below
            self.shards.save(
                self.root,
                checkpoint_name(facts.global_step),
                self.mode,
                lambda: checkpoint_bytes(self.root, self.objects, self.world_size),
                # The previous save complete first (its pruning would remove the new staging folder).
                before=self.writer.wait if self.writer is not None else lambda: None,
            )
        # An object whose state_dict() is a collective (a stream's loader gathers every rank's position)
        # is asked on every rank; rank 0 writes what it returned.
        collective = {name: obj.state_dict() for name, obj in self.objects.items() if is_collective(obj)}
        self._check_extras_agree()
        # Every rank's own: its generators and its per_rank objects (on the CPU: rank 0 receives them).
        mine = {"rng": capture_rng_state()}
        for name in self.per_rank:
            mine[name] = copy_state(self.objects[name].state_dict(), copy_cpu=True, pin_memory=False)
        gathered: list[Any] | None = [mine]
        if self.world_size > 1:
            gathered = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(mine, gathered, dst=0)
        path: Path | None = on_rank_zero(
            lambda: self._write_on_rank_zero(facts, gathered, collective), self.rank, self.world_size
        )
        return path

    def _write_on_rank_zero(
        self, facts: SaveFacts, rank_states: list[Any] | None, collective: dict[str, Any]
    ) -> Path | None:
        """Rank 0: hand the writer this checkpoint's files and manifest facts."""
        assert self.writer is not None, "rank 0 has the writer"
        self.writer.wait()  # at most one save in flight
        if not self._folder_checked:
            self._folder_checked = True
            if isinstance(self.writer, RemoteWriter):  # the bucket is the truth; the staging folder a cache
                self.writer.check_fresh()
            else:
                select.check_resume(self.root, "never")
        assert rank_states is not None, "rank 0 gathered every rank's states"
        in_files = {name: obj for name, obj in self.objects.items() if not self.shards or name not in self.shards.names}
        files = checkpoint_files(in_files, collective, facts.counters(), rank_states, self.per_rank, self.world_size)
        meta = manifest_facts(
            reason=facts.reason,
            global_step=facts.global_step,
            resume_point=facts.resume_point,
            steps_per_epoch=facts.steps_per_epoch,
            world_size=self.world_size,
            object_names=list(self.objects),
            per_rank=self.per_rank,
            metrics=facts.metrics,
            best=facts.best_info,
            config=self.config,
            meta={**self.meta, **(self.shards.facts() if self.shards else {})},
        )
        why = facts.reason
        if facts.best and facts.best_info.get("value") is not None:
            why += f", best {facts.best_info['metric']} {facts.best_info['value']:.4f}"
        if facts.replacing:
            why += "; replaces this step's earlier checkpoint with the state as it is now"
        request = WriteRequest(
            checkpoint_name(facts.global_step),
            files,
            config_texts(self.config),
            meta,
            best=facts.best,
            reason=facts.reason,
            why=why,
        )
        return self.writer.write(request)

    def _check_extras_agree(self) -> None:
        """At the first save, every rank: warn (rank 0) when an extra's tensors differ between the ranks.

        An ``extra`` is saved from rank 0 and restored on every rank; one whose
        tensors differ (a prefetched batch) would hand rank 0's to the others.
        """
        if self.world_size == 1 or self._extras_checked:
            return
        digests = {name: tensor_digest(state_to_agree(self.objects[name])) for name in self.extras}
        every: list[Any] = [None] * self.world_size
        dist.all_gather_object(every, digests)
        self._extras_checked = True
        message = differing_extras(self.extras, every)
        if message and self.rank == 0:
            get_logger().warning(message)
