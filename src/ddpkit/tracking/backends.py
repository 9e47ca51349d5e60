"""The tracking backends by name, and the package each needs (checked without importing it)."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the class is imported with its backend's module, when a run opens
    from ddpkit.tracking.backend import Backend


@dataclass(frozen=True)
class BackendSpec:
    """Where a backend lives and what it needs installed."""

    module: str
    """The ddpkit module of its :class:`~ddpkit.tracking.backend.Backend` subclass."""
    cls: str
    """The class name in that module."""
    packages: tuple[str, ...]
    """Importable packages it needs."""
    extra: str
    """ddpkit's optional extra that installs them ("" when none is needed)."""


BACKENDS = {
    "csv": BackendSpec("ddpkit.tracking.csv_log", "CsvLog", (), ""),
    "jsonl": BackendSpec("ddpkit.tracking.jsonl_log", "JsonlLog", (), ""),
    "mlflow": BackendSpec("ddpkit.tracking.mlflow_run", "MlflowRun", ("mlflow", "sqlalchemy", "alembic"), "mlflow"),
    "tensorboard": BackendSpec(
        "ddpkit.tracking.tensorboard_events", "TensorBoardEvents", ("tensorboard",), "tensorboard"
    ),
    "wandb": BackendSpec("ddpkit.tracking.wandb_run", "WandbRun", ("wandb",), "wandb"),
}
"""Every tracking backend, by the name ``Tracker(kind)`` and ``ddpkit train logger=`` take."""


def missing_package(kind: str) -> str | None:
    """The first package ``kind`` needs that is not installed, or None (nothing is imported)."""
    for package in BACKENDS[kind].packages:
        try:
            if importlib.util.find_spec(package) is None:
                return package
        except (ImportError, ValueError):  # a parent that cannot be imported, or a module without a spec
            return package
    return None


def install_hint(kind: str) -> str | None:
    """For a backend whose package is missing: "the P package, which is not installed; pip install ..."; else None."""
    package = missing_package(kind)
    if package is None:
        return None
    return f"the {package} package, which is not installed; pip install 'ddpkit[{BACKENDS[kind].extra}]'"


def backend_class(kind: str) -> type[Backend]:
    """The Backend subclass of ``kind`` (its module imports the backend's package only when a run opens)."""
    spec = BACKENDS[kind]
    cls: type[Backend] = getattr(importlib.import_module(spec.module), spec.cls)
    return cls
