"""Every random number generator of a worker, captured and restored exactly.

A resumed run draws the same dropout masks (and anything else random) as an
uninterrupted one only if every generator continues where it stopped: Python's
``random``, NumPy's global generator, torch's CPU generator and the generator of
each CUDA device. Each rank has its own states (dropout differs by rank), so a
checkpoint stores one entry per rank.

The states are kept as tensors, ints and tuples only, so that they load with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch's (CPU and every CUDA device).

    Call it on every rank before the model is built, with the same seed: the
    initial weights are then the same everywhere (``ddpkit.prepare_model``
    also copies rank 0's), and a run is repeatable. A resumed run needs no new
    seeding: the Checkpointer restores every generator where it stopped.

    Args:
        seed: any int; NumPy takes it modulo 2**32.
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state() -> dict[str, Any]:
    """This process's generator states, as tensors and plain values."""
    legacy = np.random.get_state(legacy=True)
    assert isinstance(legacy, tuple), "legacy=True: the (kind, keys, pos, has_gauss, cached) tuple"
    kind, keys, pos, has_gauss, cached = legacy
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set every generator of this process from ``capture_rng_state()``'s output.

    CUDA states are restored for the devices present (a checkpoint from a
    machine with more GPUs restores the first ones).
    """
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if torch.cuda.is_available() and state["cuda"]:
        count = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:count])
