"""What one checkpoint holds: a file per object, the counters, every rank's RNG, the config, the manifest's facts.

::

    model.pt optimizer.pt ...   each object's state_dict()
    train.pt                    global step, completed epochs, the step the epoch began at
    rng.pt                      every rank's generator states, in rank order
    <per_rank object>.pt        every rank's state of an object passed as per_rank=, in rank order
    config.yaml                 the run's config, for people (when given)
    manifest.json               the facts below, then the files' sizes and checksums (format.py)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ddpkit.checkpoint.disk.format import library_versions
from ddpkit.checkpoint.objects import RNG_FILE, TRAIN_FILE

__all__ = ["checkpoint_files", "config_texts", "manifest_facts"]


def checkpoint_files(
    objects: Mapping[str, Any],
    collective: Mapping[str, Any],
    counters: Mapping[str, int],
    rank_states: list[Mapping[str, Any]],
    per_rank: list[str],
    world_size: int,
) -> dict[str, Any]:
    """File name -> state for ``torch.save``.

    Each object's state_dict (``collective``: already asked of every rank),
    the counters, and from ``rank_states`` (each rank's, in rank order) the
    generator states and the ``per_rank`` objects' states, a list by rank.
    """
    files = {
        f"{name}.pt": collective[name] if name in collective else obj.state_dict()
        for name, obj in objects.items()
        if name not in per_rank
    }
    for name in per_rank:
        files[f"{name}.pt"] = {"ranks": [states[name] for states in rank_states]}
    files[TRAIN_FILE] = dict(counters)
    files[RNG_FILE] = {"world_size": world_size, "ranks": [states["rng"] for states in rank_states]}
    return files


def manifest_facts(
    *,
    reason: str,
    global_step: int,
    resume_point: tuple[int, int],
    steps_per_epoch: int | None,
    world_size: int,
    object_names: list[str],
    per_rank: list[str],
    metrics: Mapping[str, float],
    best: Mapping[str, Any],
    config: Mapping[str, Any],
    meta: Mapping[str, Any],
) -> dict[str, Any]:
    """The manifest's facts (``meta``, the caller's own, first): why, when, where in the epochs, what it holds."""
    epoch, step = resume_point
    return {
        **meta,
        "reason": reason,
        "global_step": global_step,
        "completed_epochs": epoch,
        "step_in_epoch": step,
        "steps_per_epoch": steps_per_epoch,
        "world_size": world_size,
        "objects": sorted(object_names),
        "per_rank": sorted(per_rank),
        "metrics": dict(metrics),
        "best": dict(best),
        "versions": library_versions(),
        "config": dict(config),
    }


def config_texts(config: Mapping[str, Any]) -> dict[str, str]:
    """``{"config.yaml": the config as YAML}``, or {} without a config."""
    if not config:
        return {}
    import yaml

    return {"config.yaml": yaml.safe_dump(dict(config), sort_keys=False)}
