"""Starting a new model from trained weights: ``init_from=PATH`` and ``freeze=...``.

``init_from`` takes the weights of a checkpoint folder, a checkpoints folder
(its newest verified checkpoint), an export (``ddpkit export``), a file
holding a state_dict, or the URL of a checkpoint or run in object storage, and copies into the new model every tensor whose name
and shape match. The rest is reported, never silently dropped:

- *missing*: in the model, not in the file (they keep their fresh initialisation);
- *unexpected*: in the file, not in the model (ignored);
- *shape mismatch*: same name, other shape (e.g. a new classifier head).

``freeze`` names parameters not to train, as comma-separated prefixes of
their names (``freeze=0,2`` freezes the layers ``0`` and ``2`` of an
``nn.Sequential``; ``freeze=encoder`` every parameter under ``encoder.``).
Both happen before the model is wrapped for data parallelism, so DDP never
waits for gradients of frozen parameters.

Every file is read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ddpkit.checkpoint.disk.format import (
    CheckpointError,
    has_manifest,
    list_checkpoints,
    load_file,
    resolve_checkpoint_dir,
    verify_checkpoint,
)
from ddpkit.checkpoint.publishing.export_folder import EXPORT_INFO, read_export
from ddpkit.checkpoint.publishing.remote_source import local_checkpoint
from ddpkit.checkpoint.publishing.sharded_export import full_weights
from ddpkit.checkpoint.sharded.state import sharded_names
from ddpkit.errors import UserError


@dataclass(frozen=True)
class TransferReport:
    """What ``init_from`` and ``freeze`` did to a new model."""

    source: str
    """Where the weights came from ("" when only freezing)."""
    loaded: tuple[str, ...] = ()
    """Tensors copied (same name and shape)."""
    missing: tuple[str, ...] = ()
    """Model tensors absent from the source; they keep their fresh initialisation."""
    unexpected: tuple[str, ...] = ()
    """Source tensors the model does not have; ignored."""
    mismatched: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...] = ()
    """(name, shape in the source, shape in the model) of tensors not copied."""
    frozen: tuple[str, ...] = ()
    """Parameters excluded from training."""

    def lines(self) -> list[str]:
        """The report as log lines."""
        out = []
        if self.source:
            out.append(f"init_from {self.source}: loaded {len(self.loaded)} tensor(s)")
            if self.missing:
                out.append("  missing (kept their initialisation): " + ", ".join(self.missing))
            if self.unexpected:
                out.append("  unexpected (ignored): " + ", ".join(self.unexpected))
            for name, source_shape, model_shape in self.mismatched:
                out.append(
                    f"  shape mismatch (not loaded): {name}: {tuple(source_shape)} in the source, "
                    f"{tuple(model_shape)} in the model"
                )
        if self.frozen:
            out.append("frozen (not trained): " + ", ".join(self.frozen))
        return out


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """The state_dict stored at ``path`` (checkpoint, checkpoints folder, export, or .pt file).

    Raises:
        CheckpointError: nothing usable there, a damaged file, or a refused (unsafe) one.
    """
    path = Path(path)
    try:
        is_folder, is_file = path.is_dir(), path.is_file()
    except OSError as e:
        raise CheckpointError(
            f"init_from={path} cannot be read ({e.strerror or e}); make it readable by this user"
        ) from None
    if is_folder:
        if has_manifest(path):
            state = _checkpoint_weights(path)
            _refuse_nonfinite(path, state)
        elif (path / EXPORT_INFO).exists():
            state = read_export(path)[1]
        else:
            newest = newest_verified(path)
            state = _checkpoint_weights(newest)
            _refuse_nonfinite(newest, state)
    elif is_file:
        state = load_file(path)
        if isinstance(state, Mapping) and "state_dict" in state and isinstance(state["state_dict"], Mapping):
            state = state["state_dict"]
    else:
        raise CheckpointError(f"init_from={path} does not exist; pass a checkpoint, an export or a .pt file")
    if not isinstance(state, Mapping) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(
            f"{path} holds no state_dict (a mapping of names to tensors); "
            "pass a checkpoint, an export or a file saved with torch.save(model.state_dict())"
        )
    return dict(state)


def _checkpoint_weights(checkpoint: Path) -> Any:
    """A verified checkpoint's model state: its model.pt, or a sharded checkpoint's full weights."""
    loaded = verify_checkpoint(checkpoint)
    if "model" in sharded_names(loaded["manifest"]):
        return full_weights(checkpoint)
    return loaded["model.pt"]


def newest_verified(folder: str | Path) -> Path:
    """The newest checkpoint of a checkpoints folder (or output_dir) that verifies, as ``resume=auto`` takes it.

    Every file is checked and loaded safely (as resume does); a newer checkpoint that is incomplete,
    corrupt, unreadable or marked as holding non-finite weights is named in a warning and skipped (not set
    aside: the folder may be another run's, read here only).

    Raises:
        CheckpointError: the folder holds no complete, verified checkpoint.
    """
    from ddpkit.checkpoint.disk.finite import is_marked_nonfinite
    from ddpkit.log import get_logger

    root = resolve_checkpoint_dir(folder)
    problems = []
    infos = list_checkpoints(root)
    for info in reversed(infos):
        if not info.complete:
            problems.append(f"{info.path.name} is incomplete (no manifest)")
            continue
        try:
            if is_marked_nonfinite(info.manifest):
                raise CheckpointError(f"{info.path} holds NaN or infinite weights")
            verify_checkpoint(info.path)
        except CheckpointError as e:
            problems.append(str(e))
            continue
        for problem in problems:
            get_logger().warning(f"skipping a newer checkpoint than {info.path.name}: {problem}")
        return info.path
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(f"{folder} holds no complete, verified checkpoint{detail}; pass a checkpoint folder")


def _refuse_nonfinite(path: Path, state: Any) -> None:
    from ddpkit.checkpoint.disk.finite import nonfinite_tensors

    bad = nonfinite_tensors(state)
    if bad:
        raise CheckpointError(
            f"{path} holds NaN or infinite weights ({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); "
            "start from an earlier checkpoint of that run"
        )


def load_matching(model: nn.Module, state: Mapping[str, torch.Tensor], source: str) -> TransferReport:
    """Copy the tensors of ``state`` whose name and shape match into ``model``; report the rest."""
    own = model.state_dict()
    loaded, mismatched = [], []
    for name, tensor in state.items():
        if name in own:
            if tuple(own[name].shape) == tuple(tensor.shape):
                loaded.append(name)
            else:
                mismatched.append((name, tuple(tensor.shape), tuple(own[name].shape)))
    model.load_state_dict({name: state[name] for name in loaded}, strict=False)
    return TransferReport(
        source=source,
        loaded=tuple(loaded),
        missing=tuple(name for name in own if name not in state),
        unexpected=tuple(name for name in state if name not in own),
        mismatched=tuple(mismatched),
    )


def freeze_parameters(model: nn.Module, prefixes: str) -> tuple[str, ...]:
    """Set ``requires_grad=False`` on parameters named by comma-separated ``prefixes``; return their names.

    Raises:
        ValueError: a prefix matches no parameter (the message lists the names there are).
    """
    wanted = [p.strip() for p in str(prefixes).split(",") if p.strip()]
    names = [name for name, _ in model.named_parameters()]
    frozen = []
    for prefix in wanted:
        matches = [name for name in names if name == prefix or name.startswith(prefix + ".")]
        if not matches:
            raise UserError(
                f"freeze={prefix!r} matches no parameter of the model; its parameters are: {', '.join(names)}"
            )
        frozen += [name for name in matches if name not in frozen]
    parameters = dict(model.named_parameters())
    for name in frozen:
        parameters[name].requires_grad_(False)
    return tuple(frozen)


def apply_transfer(model: nn.Module, init_from: str | Path = "", freeze: str = "") -> TransferReport:
    """Start ``model`` from trained weights and freeze some of its parameters (transfer learning).

    Call it on the freshly built model, before ``ddpkit.prepare_model``: the
    gradient sync then never waits for gradients of frozen parameters::

        model = MyNet()
        for line in ddpkit.apply_transfer(model, init_from="runs/pretrained", freeze="encoder").lines():
            print(line)
        model = ddpkit.prepare_model(model)

    Args:
        model: the new model (not yet wrapped).
        init_from: a checkpoint folder, a checkpoints folder or run folder (its
            newest verified checkpoint), an export (``ddpkit export``), a
            ``.pt`` file of a state_dict, or such a checkpoint's or run's URL (``s3://...``); every tensor whose name and shape
            match is copied, the rest is reported. "" copies nothing.
        freeze: comma-separated prefixes of parameter names not to train
            (``"0,2"``, ``"encoder"``); "" freezes nothing.

    Returns:
        What was loaded, missing, unexpected, mismatched and frozen (``lines()`` for the log).

    Raises:
        CheckpointError: nothing usable at ``init_from``, or a damaged or refused file.
        UserError: a ``freeze`` prefix matches no parameter.
    """
    report = TransferReport(source="")
    if init_from:
        with local_checkpoint(init_from) as (local, name):  # a URL's checkpoint: downloaded and verified
            report = load_matching(model, read_weights(local), name)
    if freeze:
        report = TransferReport(**{**report.__dict__, "frozen": freeze_parameters(model, freeze)})
    return report
