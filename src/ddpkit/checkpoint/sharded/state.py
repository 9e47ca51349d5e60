"""Sharded checkpoints: every rank writes its own shards of the model and the optimizer; rank 0 completes the folder.

A model prepared with ``shard=True`` (FSDP2) holds on each rank only its
shard of every parameter and of the optimizer's state; no rank ever holds the
full model to save or to load it. Its checkpoint is the same verified folder
as any other (:mod:`ddpkit.checkpoint.disk.format`), with the model and optimizer
written by torch.distributed.checkpoint (DCP) instead of ``model.pt`` and
``optimizer.pt``::

    step-000000120/
      .metadata          DCP's index: which tensor, which slice, in which file (rank 0)
      __0_0.distcp       rank 0's shards of the model's and optimizer's tensors
      __1_0.distcp       rank 1's ...
      scheduler.pt ...   every other object, as in any checkpoint (rank 0)
      train.pt rng.pt    the counters, every rank's RNG states
      manifest.json      last: size and SHA-256 of every file above, "sharded": what DCP holds

How a write stays atomic (a collective):

1. rank 0 makes a hidden staging folder ``.step-000000120.tmp-<id>`` and tells every rank;
2. every rank writes its shards into it (``dcp.save``: fsynced files, the
   index by rank 0 once every rank wrote), hashes the files it wrote, and
   sends their sizes and SHA-256 to rank 0;
3. rank 0 writes the other files and the manifest last, then renames the
   folder into place (:func:`ddpkit.checkpoint.disk.format.finish_checkpoint`,
   by :class:`~ddpkit.checkpoint.sharded.writer.ShardedWriter`).

With ``async_save`` (by default on a GPU) step 2 runs in the background on
every rank: each rank first copies its shards to CPU memory (pinned, and
reused by the next save, on a GPU), so training changes its parameters at
once; the ranks' writes talk over a process group of their own (gloo), never
the one training uses; at most one save is in flight, and every rank waits
for it at the next save, ``wait()``, preemption and ``close()``. Rank 0
learns the outcome (the folder and its files, or why a rank could not
write) and completes the folder or reports the failure, in both modes alike.

A crash before the rename leaves only the hidden folder, never resumed and
removed by the next pruning. Resuming verifies every file against the
manifest (rank 0) before any rank reads; each rank then reads the slices of
its own shards (``dcp.load``), at the world size that wrote the checkpoint
or at any other (DCP reshards), through the readers of
:mod:`ddpkit.checkpoint.disk.sharded_reading`, which run no code from a
checkpoint. Models and optimizers are taken through torch's
``get_state_dict``/``set_state_dict`` (keys by parameter name, not by
position), so a plain or DDP model can resume a sharded checkpoint too.
"""

from __future__ import annotations

import os
import pickle
import shutil
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.filesystem import FileSystemWriter

from ddpkit.checkpoint.disk.async_save import BackgroundWriter
from ddpkit.checkpoint.disk.finite import nonfinite_tensors
from ddpkit.checkpoint.disk.format import CheckpointError, folder_mode
from ddpkit.checkpoint.disk.layout import SHARDED_KEY
from ddpkit.checkpoint.disk.reading import file_sha256
from ddpkit.checkpoint.disk.sharded_reading import SafeLoadPlanner, SafeReader, refused, unreadable
from ddpkit.checkpoint.disk.storage import StorageError, explain_write_error
from ddpkit.checkpoint.ranks import on_rank_zero
from ddpkit.comm.fsdp import is_sharded

__all__ = ["SHARDED_KEY", "ShardedState", "Staged", "sharded_names", "sharded_state"]

_FORMAT = "torch.distributed.checkpoint"


class Staged(NamedTuple):
    """What the ranks wrote for one save, as rank 0 learns it."""

    folder: Path
    """The staging folder the ranks wrote their shards into."""
    files: dict[str, dict[str, Any]]
    """The size and SHA-256 of every file there."""
    nonfinite: list[str]
    """The tensors some rank found NaN or infinity in (its shards; :func:`~ddpkit.checkpoint.disk.finite.nonfinite_tensors`)."""


class ShardedState:
    """The model (and optimizer) of a sharded run, saved and loaded by every rank through DCP.

    Args:
        model: the model (sharded by FSDP2, or plain to load a sharded checkpoint into).
        optimizer: its optimizer, or None.
        rank: this process's rank.
        world_size: the number of ranks.
        async_save: write the shards in the background (see the module docstring).
    """

    def __init__(self, model: nn.Module, optimizer: Any, rank: int, world_size: int, async_save: bool = False) -> None:
        self.model, self.optimizer = model, optimizer
        self.rank, self.world_size = rank, world_size
        self.names = ("model", "optimizer") if optimizer is not None else ("model",)
        """The Checkpointer's objects whose state DCP holds (the others are files of their own)."""
        self._writes = BackgroundWriter() if async_save else None
        self._group: Any = None  # the background writes' own process group, made at the first save
        self._stager: Any = None  # copies the shards to CPU memory (kept: on a GPU it reuses its pinned buffers)
        self._outcome: Future[Staged | None] | None = None  # the newest save's (rank 0: its Staged)

    def facts(self) -> dict[str, Any]:
        """The manifest's entry for what DCP holds."""
        return {SHARDED_KEY: {"format": _FORMAT, "objects": list(self.names), "world_size": self.world_size}}

    def save(
        self,
        root: Path,
        name: str,
        mode: int,
        needed_bytes: Callable[[], int],
        before: Callable[[], None] = lambda: None,
    ) -> None:
        """Every rank writes its shards into a new staging folder (a collective), now or in the background.

        Rank 0 then takes the outcome from :meth:`staged`. A write that fails (a full disk on some rank)
        raises nothing here: DCP fails it on every rank, rank 0 removes the staging folder, and
        :meth:`staged` raises StorageError, which rank 0's writer reports as any failed write.

        Args:
            root: the checkpoints folder.
            name: the checkpoint's folder name.
            mode: permission bits of the files.
            needed_bytes: the expected size of a checkpoint, for a failed write's message.
            before: rank 0, before it makes the staging folder (inside the collective that tells every
                rank the folder, which shares its error): the wait for its writer's completion of the
                previous save, whose pruning removes hidden folders left by crashes.
        """
        self.wait()  # at most one save in flight

        def make_staging() -> str:
            before()
            root.mkdir(parents=True, exist_ok=True, mode=folder_mode(mode))
            folder = root / f".{name}.tmp-{uuid.uuid4().hex[:8]}"
            folder.mkdir(mode=folder_mode(mode))
            os.chmod(folder, folder_mode(mode))
            return str(folder)

        staging = Path(on_rank_zero(make_staging, self.rank, self.world_size))
        outcome: Future[Staged | None] = Future()
        self._outcome = outcome
        state = self._state()
        if self._writes is None:
            _settle(outcome, lambda: self._write(state, staging, root, name, mode, needed_bytes, group=None))
            self._raise_bug()
            return
        group, staged_state = self._background_group(), self._stage(state)  # training may change `state` now
        self._writes.submit(
            lambda: _settle(outcome, lambda: self._write(staged_state, staging, root, name, mode, needed_bytes, group))
        )

    def staged(self) -> Staged:
        """Rank 0: the newest save's staging folder and files, once every rank wrote (waits for the background).

        Raises:
            StorageError: some rank could not write its shards (the staging folder is gone).
        """
        assert self._outcome is not None and self.rank == 0, "rank 0, after save()"
        result = self._outcome.result()
        assert result is not None, "rank 0's outcome holds the staging folder"
        return result

    def wait(self) -> None:
        """Wait until this rank's shards of the newest save are written; raise a bug of that write.

        A failed write (StorageError) is left to rank 0's writer, which reports it for every rank.
        """
        if self._writes is not None:
            self._writes.join()
        self._raise_bug()

    def close(self) -> None:
        """Wait for this rank's write in flight and raise nothing (an exception unwinds)."""
        if self._writes is not None:
            self._writes.join()

    def _raise_bug(self) -> None:
        """Raise (once) the exception of the newest write when it is a bug, not a failed write."""
        if self._outcome is not None and self._outcome.done():
            error = self._outcome.exception()
            if error is not None and not isinstance(error, StorageError):
                self._outcome = None
                raise error

    def _background_group(self) -> Any:
        """The process group of the background writes (a collective at the first save: every rank makes it)."""
        if self._group is None and dist.is_initialized():
            # Never the training's group (even of one rank, nccl's on a GPU): collectives of two threads on
            # one group would interleave.
            self._group = dist.new_group(backend="gloo")
        return self._group

    def _stage(self, state: dict[str, Any]) -> dict[str, Any]:
        """A copy of this rank's ``state`` in CPU memory (pinned and reused between saves when it is on a GPU)."""
        import torch
        from torch.distributed.checkpoint.staging import BlockingAsyncStager

        cached = torch.cuda.is_available()  # pinned buffers need CUDA; on the CPU each save copies afresh
        if self._stager is None:
            self._stager = BlockingAsyncStager(cache_staged_state_dict=cached)
        try:
            staged: dict[str, Any] = self._stager.stage(state)
        except Exception:
            if not cached:
                raise
            # The cached buffers no longer fit the state (its keys or shapes changed): stage into new ones.
            self._stager = BlockingAsyncStager(cache_staged_state_dict=True)
            staged = self._stager.stage(state)
        return staged

    def _write(
        self,
        state: dict[str, Any],
        staging: Path,
        root: Path,
        name: str,
        mode: int,
        needed_bytes: Callable[[], int],
        group: Any,
    ) -> Staged | None:
        """Every rank: DCP's write of ``state`` into ``staging``, then the files' digests to rank 0 (its Staged).

        Raises:
            StorageError: some rank could not write (on every rank: DCP tells them all).
        """
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict_saver import save

        nonfinite = nonfinite_tensors(state)  # this rank's shards; rank 0 marks the checkpoint for every rank's
        writer = _ShardWriter(staging, single_file_per_rank=True, sync_files=True, overwrite=False)
        try:
            save(state, storage_writer=writer, process_group=group)
        except CheckpointException as e:  # DCP raises it on every rank, with each failed rank's error
            if self.rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            errors = [failure[0] for failure in e.failures.values()]
            error = next((x for x in errors if isinstance(x, OSError)), None)
            if error is None:
                error = OSError(f"rank(s) {sorted(e.failures)} failed: {errors[0] if errors else e}")
            message = explain_write_error(root, name, error, needed_bytes()) if self.rank == 0 else str(error)
            raise StorageError(message) from None
        # Each rank hashes the files it wrote (in parallel; none reads another's), rank 0 gathers the digests.
        files = {p.name: _digest(p, mode) for p in sorted(staging.glob(f"__{self.rank}_*"))}
        if self.rank == 0:
            files.update({p.name: _digest(p, mode) for p in sorted(staging.iterdir()) if not p.name.startswith("__")})
        mine = (files, nonfinite)
        gathered: list[Any] = [mine]
        if self.world_size > 1:
            gathered = [None] * self.world_size if self.rank == 0 else []
            dist.gather_object(mine, gathered if self.rank == 0 else None, dst=0, group=group)
        if self.rank != 0:
            return None
        every_file = {file: facts for part, _ in gathered for file, facts in part.items()}
        every_nonfinite = sorted({name for _, names in gathered for name in names})
        return Staged(staging, every_file, every_nonfinite)

    def load(self, path: Path) -> None:
        """Every rank reads its slices of the model's (and optimizer's) state from ``path`` (a collective).

        Raises:
            CheckpointError: the checkpoint's tensors do not fit this run's model or optimizer.
        """
        from torch.distributed.checkpoint.api import CheckpointException
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        from torch.distributed.checkpoint.state_dict_loader import load

        state = self._state()
        try:
            load(state, storage_reader=SafeReader(str(path)), planner=SafeLoadPlanner())
            set_model_state_dict(self.model, state["model"])
            if self.optimizer is not None:
                set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"])
        except CheckpointException as e:  # raised on every rank, with each failed rank's error
            raise CheckpointError(unreadable(path, e)) from None
        except pickle.UnpicklingError as e:  # without a process group DCP raises it as it is
            raise CheckpointError(refused(path, e)) from None
        except (RuntimeError, ValueError, KeyError) as e:
            detail = "; ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())[:500]
            raise CheckpointError(
                f"checkpoint {path}: its sharded model or optimizer does not fit this run's ({detail}); resume "
                "with the model and optimizer it was written with, or start a new run in another folder"
            ) from None

    def load_whole(self, path: Path, model_state: Mapping[str, Any], optimizer_state: Mapping[str, Any] | None) -> None:
        """Every rank keeps its shards of a replicated checkpoint's whole state (which every rank read).

        A run that outgrew replicas resumes its checkpoint sharded: torch's
        ``set_state_dict(full_state_dict=True)`` slices each rank's part out.
        The optimizer's state is keyed by parameter position there: it is
        keyed by parameter name here first, position for position, as
        ``optimizer.load_state_dict`` would match it.

        Raises:
            CheckpointError: the checkpoint's model or optimizer does not fit this run's.
        """
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        try:
            set_model_state_dict(self.model, dict(model_state), options=options)
            if self.optimizer is not None and optimizer_state is not None:
                by_name = _keyed_by_name(self.model, self.optimizer, optimizer_state)
                set_optimizer_state_dict(self.model, self.optimizer, by_name, options=options)
        except (RuntimeError, ValueError, KeyError, TypeError) as e:
            detail = "; ".join(line.strip() for line in str(e).strip().splitlines() if line.strip())[:500]
            raise CheckpointError(
                f"checkpoint {path}: its model or optimizer does not fit this run's sharded one ({detail}); resume "
                "with the model and optimizer it was written with, or start a new run in another folder"
            ) from None

    def _state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        state: dict[str, Any] = {"model": get_model_state_dict(self.model)}
        if self.optimizer is not None:
            state["optimizer"] = get_optimizer_state_dict(self.model, self.optimizer)
        return state


class _ShardWriter(FileSystemWriter):
    """DCP's file writer, whose failed write raises the OSError underneath.

    torch.save reports a full disk as an unrelated RuntimeError ("unexpected pos"), the OSError only its
    context, which DCP's gathering of every rank's failure to every rank drops: the OSError is raised
    instead, so that rank 0 names the real cause ("No space left on device") for whichever rank it was.
    """

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except RuntimeError as e:
            cause = _os_error(e)
            if cause is None:
                raise
            raise cause from None


def _os_error(error: BaseException) -> OSError | None:
    """The OSError in ``error``'s chain of causes and contexts, if any."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError):
            return seen
        seen = seen.__cause__ or seen.__context__
    return None


def _keyed_by_name(model: nn.Module, optimizer: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """``optimizer.state_dict()``'s format (parameters by position) keyed by parameter name, as torch's
    ``get_optimizer_state_dict(full_state_dict=True)`` writes it; positions matched group by group.

    Raises:
        ValueError: the groups or their sizes differ from ``optimizer``'s.
    """
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    saved_groups, groups = state["param_groups"], optimizer.param_groups
    sizes = [len(group["params"]) for group in groups]
    if [len(group["params"]) for group in saved_groups] != sizes:
        raise ValueError(
            f"its parameter groups hold {[len(g['params']) for g in saved_groups]} tensors, this run's {sizes}"
        )
    name_of = {
        position: names[id(parameter)]
        for saved, group in zip(saved_groups, groups)
        for position, parameter in zip(saved["params"], group["params"])
    }
    return {
        "state": {name_of[position]: value for position, value in state["state"].items()},
        "param_groups": [{**group, "params": [name_of[p] for p in group["params"]]} for group in saved_groups],
    }


def _settle(outcome: Future[Any], task: Callable[[], Any]) -> None:
    """Run ``task`` and put its result, or its exception, into ``outcome``."""
    try:
        outcome.set_result(task())
    except BaseException as e:  # handed to whoever asks: rank 0's writer, or wait()
        outcome.set_exception(e)


def sharded_state(
    objects: Mapping[str, Any], rank: int, world_size: int, *, async_save: bool = False
) -> ShardedState | None:
    """The state of ``objects``' model (and optimizer) when the model is sharded (``prepare_model(shard=True)``)."""
    if not is_sharded(objects.get("model")):
        return None
    return ShardedState(objects["model"], objects.get("optimizer"), rank, world_size, async_save)


def sharded_names(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The objects a checkpoint holds in DCP's files (none for a checkpoint of a replicated model)."""
    entry = manifest.get(SHARDED_KEY) or {}
    return tuple(entry.get("objects", ()))


def _digest(path: Path, mode: int) -> dict[str, Any]:
    """Size and SHA-256 of a file DCP wrote, as the manifest lists them; its mode set to ``mode``."""
    os.chmod(path, mode)
    return {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
