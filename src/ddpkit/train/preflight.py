"""Checks made once, before any worker starts, so bad input fails fast and clearly."""

from __future__ import annotations

from ddpkit.config import TrainConfig
from ddpkit.data.datasets import DATASETS, FASHION_MNIST, MNIST
from ddpkit.data.sources import locate
from ddpkit.models.registry import get_model_spec
from ddpkit.train.loop import global_batch_size
from ddpkit.train.run import data_options

_FILE_DATASETS = {"fashion-mnist": FASHION_MNIST, "mnist": MNIST}


def check_before_launch(cfg: TrainConfig, world_size: int) -> None:
    """Validate ``cfg`` for ``world_size`` workers and fetch the dataset once.

    Raises:
        ValueError: unknown model or dataset, or a batch that does not divide.
        DataNotFoundError: the dataset is missing and cannot be downloaded.
    """
    get_model_spec(cfg.model)
    if cfg.dataset not in DATASETS:
        raise ValueError(f"unknown dataset {cfg.dataset!r}; choose one of: {', '.join(sorted(DATASETS))}")
    batch = global_batch_size(cfg, world_size)
    if batch % world_size:
        raise ValueError(
            f"global batch size {batch} does not divide among {world_size} workers; "
            f"use a multiple of {world_size} (batch_size=...) or batch_scope=per_worker"
        )
    if cfg.dataset in _FILE_DATASETS:
        # Here, once, rather than in N workers at the same time.
        options = data_options(cfg)
        locate(_FILE_DATASETS[cfg.dataset], options.data_dir, options.download, options.mirrors)
