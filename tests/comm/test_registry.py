"""Algorithms by name: resolution, errors, and the optional shared-memory module."""

from __future__ import annotations

import importlib
import sys

import pytest

from ddpkit.comm import (
    ALLREDUCE_ALGORITHMS,
    COLLECTIVES,
    available_allreduce_algorithms,
    butterfly,
    naive,
    registry,
    resolve,
    resolve_allreduce,
    ring,
    tree,
)


def test_every_required_name_is_registered():
    assert list(ALLREDUCE_ALGORITHMS) == ["builtin", "naive", "ring", "butterfly", "tree", "shm", "hierarchical"]
    assert ALLREDUCE_ALGORITHMS["ring"] is ring.all_reduce
    assert ALLREDUCE_ALGORITHMS["butterfly"] is butterfly.all_reduce
    assert ALLREDUCE_ALGORITHMS["tree"] is tree.all_reduce
    assert ALLREDUCE_ALGORITHMS["naive"] is naive.all_reduce


def test_resolve_allreduce_returns_the_algorithm_of_that_name():
    # Linux has shared memory: every name resolves here, shm and hierarchical included.
    assert available_allreduce_algorithms() == list(ALLREDUCE_ALGORITHMS)
    expected = {
        "builtin": registry.builtin_all_reduce,
        "naive": naive.all_reduce,
        "ring": ring.all_reduce,
        "butterfly": butterfly.all_reduce,
        "tree": tree.all_reduce,
        "shm": registry.shm_all_reduce,
        "hierarchical": registry.hierarchical_all_reduce,
    }
    assert {name: resolve_allreduce(name) for name in ALLREDUCE_ALGORITHMS} == expected
    # The two forwards reach modules that exist and define all_reduce.
    assert callable(importlib.import_module("ddpkit.comm.shm").all_reduce)
    assert callable(importlib.import_module("ddpkit.comm.hierarchical").all_reduce)


def test_unknown_name_lists_the_choices():
    with pytest.raises(
        ValueError,
        match=r"allreduce='rign' is not an all_reduce algorithm \(did you mean 'ring'\?\); "
        r"choose one of: builtin, naive, ring",
    ):
        resolve_allreduce("rign")


def test_missing_shm_module_is_reported_with_alternatives(monkeypatch):
    # None in sys.modules makes the import fail exactly as for an absent module.
    monkeypatch.setitem(sys.modules, "ddpkit.comm.shm", None)
    assert "shm" not in available_allreduce_algorithms()
    with pytest.raises(ValueError, match=r"'shm' is not available here \(ddpkit\.comm\.shm is not installed\)"):
        resolve_allreduce("shm")
    with pytest.raises(ValueError, match=r"choose one of builtin, naive, ring, butterfly, tree$"):
        resolve_allreduce("shm")


def test_resolve_any_collective_by_name():
    assert resolve("broadcast", "tree") is tree.broadcast
    assert resolve("all_gather", "ring") is ring.all_gather
    assert resolve("all_reduce", "ring") is ring.all_reduce
    for collective, algorithms in COLLECTIVES.items():
        assert "builtin" in algorithms, collective
        assert len(algorithms) >= 2, f"{collective} has no ddpkit algorithm"
    with pytest.raises(ValueError, match=r"unknown collective 'allreduce'; choose one of all_reduce"):
        resolve("allreduce", "ring")
    with pytest.raises(ValueError, match=r"unknown broadcast algorithm 'ring'; choose one of builtin, tree"):
        resolve("broadcast", "ring")
